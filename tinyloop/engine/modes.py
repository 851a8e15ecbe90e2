"""What the decoding modes and the engine core see of each other: two protocols and one helper.

The engine core (``engine.py``) implements ``Core``: the engine contract's model work (prefill,
decode, verify), the raw forward for drafting, and token acceptance. A mode's ``Strategy``
(``plain.py``, ``speculative.py``, ``beam.py``) is given a ``Core`` and drives its sequences
through it; the batch iteration (``batch.py``) runs every strategy's part of one step. Neither
side imports the other: both import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from tinyloop.engine.sequence import ModeState, Sequence, TokenEvent
from tinyloop.errors import EngineBroken, KVCacheExhausted
from tinyloop.model.config import ModelConfig
from tinyloop.model.context import PagedContext
from tinyloop.model.kvcache import SeqKV
from tinyloop.model.looped import ForwardOutput, LoopedLM, RowSpec
from tinyloop.requests import TokenLogprob

__all__ = ["Core", "Finish", "Strategy", "guard", "no_events", "reserve_or_fail"]

_T = TypeVar("_T")

Finish = Callable[[], list[TokenEvent]]  # a strategy's last part of a step, after sampling


class Core(Protocol):
    """The engine core as a strategy uses it (``Engine`` implements it)."""

    config: ModelConfig
    device: torch.device
    max_draft_nodes: int
    draft_min_prob: float
    draft_model: nn.Module  # what speculative drafts run on (the model, or its int8 twin)
    prefill_chunk: int  # prompt tokens a sequence prefills per step
    prefilled_tokens: int  # prompt tokens run through the model so far
    decode_burst: int  # a lone greedy sequence's tokens per step (plain.py)
    max_seq_len: int
    vocab_limit: int  # ids the sampler may pick: the tokenizer's (a checkpoint's padding rows never)
    model: LoopedLM

    @property
    def eos_ids(self) -> frozenset[int]: ...

    def prefill_step(self, seq: Sequence) -> torch.Tensor | None: ...

    def decode(self, seqs: Seq[Sequence]) -> torch.Tensor: ...


    def forward(self, seqs: Seq[Sequence], tokens: torch.Tensor, warm: bool,
                counts: Seq[int] | None = None) -> ForwardOutput: ...

    def host_tokens(self, rows: Seq[Seq[int | None]]) -> torch.Tensor: ...

    def verify(self, seqs: Seq[Sequence], tokens: Seq[Seq[int]], *, mask: torch.Tensor | None = None,
               positions: Seq[Seq[int]] | None = None) -> torch.Tensor: ...

    def context(self, kvs: Seq[SeqKV], starts: Seq[int], n_new: int, extra_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> PagedContext: ...

    def run_model(self, tokens: torch.Tensor, ctx: Any, specs: Seq[RowSpec], last_only: bool = True,
                  model: nn.Module | None = None) -> ForwardOutput: ...

    def accept(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> TokenEvent: ...


class Strategy(Protocol):
    """One decoding mode's part of an engine step.

    Per step, for the decoding sequences of its mode: ``prepare`` before any prefill (reserve
    what the step needs; a sequence that cannot get it fails), ``plan`` runs the mode's own
    forwards and returns what to do after sampling plus the sequences that decode plainly this
    step instead. ``first`` takes a sequence's prompt logits once prefilled (None: sample them
    like any decode row). ``new_state`` is the mode's state for a new sequence.
    """

    def new_state(self, seq: Sequence) -> ModeState | None: ...

    def prepare(self, seqs: list[Sequence]) -> list[Sequence]: ...

    def plan(self, seqs: list[Sequence]) -> tuple[Finish, list[Sequence]]: ...

    def first(self, seq: Sequence, logits: torch.Tensor) -> list[TokenEvent] | None: ...


def no_events() -> list[TokenEvent]:
    """A ``Finish`` with nothing left to do."""
    return []


def guard(seq: Sequence, fn: Callable[..., _T], *args: Any) -> _T | None:
    """``fn(*args)``, or None with ``seq`` failed when it raises (EngineBroken propagates)."""
    try:
        return fn(*args)
    except EngineBroken:
        raise
    except Exception as exc:
        seq.fail(exc)
        return None


def reserve_or_fail(seqs: list[Sequence]) -> list[Sequence]:
    """The sequences that could reserve KV for one more position; the others fail."""
    ok = []
    for s in seqs:
        try:
            s.kv.reserve(s.kv.length + 1)
        except KVCacheExhausted as exc:
            s.fail(exc)
        else:
            ok.append(s)
    return ok
