"""One request's state inside the engine: its tokens, KV, sampler state and stop state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tinyloop.engine.sampling import StopMatcher
from tinyloop.errors import EngineError, TinyLoopError
from tinyloop.model.kvcache import SeqKV
from tinyloop.requests import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    StopReason,
    TokenLogprob,
)
from tinyloop.tokenizer import StreamingDetokenizer
from tinyloop.vocabulary import ExitRule

__all__ = ["ModeState", "Sequence", "TokenEvent"]


class ModeState(Protocol):
    """What a decoding mode keeps on a sequence (speculation counters, a beam search): owned by
    the mode's strategy; the sequence only asks it these three things."""

    def blocks(self) -> int:
        """KV blocks held beyond ``seq.kv`` (a beam search's live beams)."""
        ...

    def release(self) -> None:
        """Give those blocks back (safe to call twice)."""
        ...

    def contribute(self, result: GenerationResult) -> GenerationResult:
        """``result`` with this mode's fields filled in (draft counts, beam score)."""
        ...


@dataclass(eq=False)
class Sequence:
    """A request being prefilled or decoded.

    ``kv.length`` tokens are in the cache; ``pending`` is the last sampled token, fed to the
    model by the next decode step. ``warm_state`` is the previous token's final core state when
    the request warm-starts.

    A sequence prefills ``context`` (its prompt; after a preemption, the prompt and every output
    token but the pending one, ``Engine.preempt``) before it decodes. ``prefill_only``: a
    registered prefix, which stops once its prompt is in the KV and samples nothing.
    """

    request: GenerationRequest
    loops: int
    window: int
    exit: ExitRule  # the rule it runs under (``Resolved.exit``: its own, or the model's)
    kv: SeqKV
    generator: torch.Generator
    noise_seed: int
    detokenizer: StreamingDetokenizer
    stop_matcher: StopMatcher
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    pending: int | None = None
    warm_state: torch.Tensor | None = None
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled by the prefill when the request asks
    matcher: Any = None  # the request's grammar matcher (``tinyloop.grammar``), advanced on each accepted token
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix pool or prefix cache
    last_loops: int = 0  # loops run by the forward that produced the latest logits
    loops_total: int = 0  # loops run for the generated tokens (the first one: the prompt's last)
    mode_state: ModeState | None = None  # the mode's own state (speculative.py, beam.py)
    finish_reason: FinishReason | None = None
    stop_reason: StopReason | None = None
    error: BaseException | None = None
    resumed: bool = False  # preempted: rebuilding its KV, the pending token decodes next
    prefill_only: bool = False
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def context_length(self) -> int:
        """Positions the KV must hold before the next decode step."""
        return len(self.prompt) + (len(self.output) - 1 if self.resumed else 0)

    @property
    def context(self) -> list[int]:
        """The tokens at those positions."""
        return self.prompt + self.output[:-1] if self.resumed else self.prompt

    @property
    def prefilling(self) -> bool:
        return self.kv.length < self.context_length

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        """Every token of the sequence: prompt then output."""
        return self.prompt + self.output

    def __repr__(self) -> str:
        state = self.finish_reason or ("prefill" if self.prefilling else "decode")
        return (f"<Sequence {self.request_id[:8]} {state} prompt={len(self.prompt)} "
                f"out={len(self.output)} loops={self.loops} W={self.window} kv={self.kv.length}>")

    def finish(self, reason: FinishReason, stop_reason: StopReason) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_at = time.perf_counter()

    def fail(self, exc: BaseException) -> None:
        """Finish with an error of this sequence alone (a foreign one becomes EngineError)."""
        if not isinstance(exc, TinyLoopError):
            err = EngineError(f"{type(exc).__name__}: {exc}")
            err.__cause__ = exc
            exc = err
        self.error = exc
        self.finish("error", "error")

    def result(self) -> GenerationResult:
        """The finished request as a GenerationResult."""
        end = self.finished_at or time.perf_counter()
        n = len(self.output)
        ttft = None if self.first_token_at is None else (self.first_token_at - self.started) * 1000
        result = GenerationResult(
            tokens=list(self.output),
            text="".join(self.text_parts),
            finish_reason=self.finish_reason or "length",
            prompt_tokens=len(self.prompt),
            completion_tokens=n,
            wall_ms=(end - self.started) * 1000,
            stop_reason=self.stop_reason or "length",
            logprobs=list(self.logprobs) if self.request.sampling.logprobs
            or self.request.sampling.top_logprobs else None,
            loops_used=self.loops,
            mean_loops=self.loops_total / n if n else None,
            time_to_first_token_ms=ttft,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            cached_tokens=self.cached_tokens,
        )
        return result if self.mode_state is None else self.mode_state.contribute(result)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What one engine step produced for one sequence: a token, its text, and whether it ended."""

    sequence: Sequence
    token_id: int
    text: str
    index: int
    logprob: TokenLogprob | None
    loops_used: int
    finished: bool

    def chunk(self) -> GenerationChunk:
        return GenerationChunk(token_id=self.token_id, text=self.text, index=self.index,
                               logprob=self.logprob, loops_used=self.loops_used)
