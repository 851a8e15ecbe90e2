"""One request's place in its grammar, and the engine's hooks around it.

``Matcher`` wraps an ``llguidance.LLMatcher`` copied from the constraint's compiled prototype.
The engine keeps it on ``Sequence.matcher``: ``matcher_for`` makes it when a sequence starts,
``advance`` moves it on each accepted token (``output.accept_token``), ``fork`` copies it with a
sequence (beams, ``Engine.fork``). Speculation advances it along a draft and rolls it back.

llguidance counts the tokens it consumed, but not an end-of-text token given where the grammar
is already complete (only EOS may follow); rolling back past its count breaks the matcher for
good. So the wrapper keeps its own history, one flag a token: whether llguidance counted it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection
from collections.abc import Sequence as Seq

import llguidance
import torch

from tinyloop.engine.sequence import Sequence
from tinyloop.errors import EngineError
from tinyloop.grammar.compile import prototype
from tinyloop.requests import Constraint, GenerationRequest
from tinyloop.tokenizer import Tokenizer

__all__ = ["Matcher", "advance", "fill_batch", "fork", "matcher_for"]

_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


class Matcher:
    """A grammar matcher: which tokens may come next (``fill``), ``accept`` one, ``rollback``."""

    __slots__ = ("_inner", "_counted", "eos_ids", "kind")

    def __init__(self, inner: llguidance.LLMatcher, eos_ids: Collection[int], kind: str) -> None:
        self._inner = inner
        self._counted: list[bool] = []  # per accepted token: consumed by llguidance (not an EOS at the end)
        self.eos_ids = frozenset(eos_ids)
        self.kind = kind

    @classmethod
    def start(cls, constraint: Constraint, tokenizer: Tokenizer) -> Matcher:
        """A matcher at the start of ``constraint``'s grammar (compiled once, then copied)."""
        return cls(prototype(constraint, tokenizer).deep_copy(), tokenizer.eos_ids, constraint.kind)

    def __repr__(self) -> str:
        state = "error" if self.failed else "terminated" if self.is_terminated() else (
            "can end" if self.can_end() else "open")
        return f"<Matcher {self.kind} tokens={len(self._counted)} {state}>"

    def fill(self, words: torch.Tensor) -> None:
        """Write the allowed next tokens into ``words``, a contiguous int32 CPU row of
        ``ceil(vocab / 32)`` words: bit ``t % 32`` of word ``t // 32`` is set when token t may come
        next (the EOS ids where the grammar may end; only they once it is terminated)."""
        if words.dtype != torch.int32 or not words.is_contiguous() or words.device.type != "cpu":
            raise ValueError("a mask row must be a contiguous int32 CPU tensor")
        self._inner.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (nothing changes) when the grammar does not allow it."""
        if self._inner.is_stopped():
            ok = token in self.eos_ids and not self._inner.is_error()
            if ok:
                self._counted.append(False)
            return ok
        if self._inner.try_consume_tokens([token]) != 1:
            return False
        self._counted.append(True)
        return True

    def accept_all(self, tokens: Seq[int]) -> int:
        """Advance by each of ``tokens`` in turn, up to the first one refused; how many it took."""
        for n, token in enumerate(tokens):
            if not self.accept(token):
                return n
        return len(tokens)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if n > len(self._counted):
            raise EngineError(f"grammar rollback of {n} tokens past the {len(self._counted)} accepted")
        if n <= 0:
            return
        counted = sum(self._counted[-n:])
        del self._counted[-n:]
        if counted and not self._inner.rollback(counted):
            raise EngineError(f"the grammar matcher could not roll back: {self.error}")

    def completes(self, token: int) -> bool:
        """Whether ``token`` would complete the grammar (nothing but end-of-text after it); the
        matcher is left where it was."""
        if not self.accept(token):
            return False
        done = self.is_terminated()
        self.rollback(1)
        return done

    def is_terminated(self) -> bool:
        """The grammar is complete and nothing but end-of-text may follow."""
        return self._inner.is_stopped()

    def can_end(self) -> bool:
        """End-of-text is allowed here: the output so far is a complete match."""
        return self._inner.is_accepting()

    @property
    def failed(self) -> bool:
        return self._inner.is_error()

    @property
    def error(self) -> str:
        return self._inner.get_error()

    @property
    def tokens(self) -> int:
        """Tokens accepted so far."""
        return len(self._counted)

    def fork(self) -> Matcher:
        """An independent copy in the same state."""
        twin = Matcher(self._inner.deep_copy(), self.eos_ids, self.kind)
        twin._counted = list(self._counted)
        return twin


PARALLEL_ROWS = 8  # rows from which a batch's masks are filled on llguidance's threads ...
PARALLEL_CPUS = 8  # ... on a machine with at least this many CPUs


def fill_batch(matchers: Seq[Matcher], words: torch.Tensor) -> None:
    """``matchers[j].fill(words[j])`` for every j: ``words`` ``[N, W]`` contiguous int32 on the CPU.
    A large batch on a large machine fills its rows in parallel on llguidance's threads (the GIL
    released); on two cores that was slower than one thread (16 rows of the demo model:
    constrained decoding at 88% of free tokens/s against 95%), its threads taking the cores
    the next forward needs."""
    if len(matchers) != words.shape[0] or not words.is_contiguous() or words.dtype != torch.int32:
        raise ValueError("fill_batch needs one contiguous int32 row per matcher")
    if len(matchers) < PARALLEL_ROWS or (os.cpu_count() or 1) < PARALLEL_CPUS:
        for row, m in zip(words, matchers):
            m.fill(row)
    else:
        _parallel().unsafe_compute_mask_ptr([(m._inner, j) for j, m in enumerate(matchers)],
                                            words.data_ptr(), words.shape[1] * 4, words.shape[0])


def _parallel() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:  # its threads run while the caller waits for them, never beside a forward
            _executor = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
        return _executor


def matcher_for(req: GenerationRequest, tokenizer: Tokenizer) -> Matcher | None:
    """The matcher of a new sequence for ``req`` (None without a constraint); a constraint that
    does not compile raises ``RequestError(param="response_format")``."""
    return None if req.constraint is None else Matcher.start(req.constraint, tokenizer)


def fork(matcher: Matcher | None) -> Matcher | None:
    """``matcher.fork()``, None for None: a forked sequence's own copy."""
    return None if matcher is None else matcher.fork()


def advance(seq: Sequence, token: int) -> None:
    """Move ``seq``'s matcher (if any) past ``token``, its next output token; when that completes
    the grammar (only end-of-text may follow), the request ends there with finish_reason "stop"
    (stop_reason "eos": where the grammar forces the end of text). A token the grammar refuses
    (the mask should make that impossible) raises EngineError: the sequence fails alone."""
    matcher: Matcher | None = seq.matcher
    if matcher is None:
        return
    if not matcher.accept(token):
        raise EngineError(f"the {matcher.kind} constraint refused token {token} after "
                          f"{matcher.tokens} tokens{': ' + matcher.error if matcher.error else ''}")
    if matcher.is_terminated() and not seq.finished:
        seq.finish("stop", "eos")
