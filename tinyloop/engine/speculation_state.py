"""A speculative sequence's own state (``modes.ModeState``): its draft counters and the length
its chains have grown to. Plain bookkeeping, no model and no KV: the planner reads the chain
length (``speculative.py``), drafting counts the chains it stopped (``drafting.py``), and the
commit counts what verification accepted and adapts the length."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tinyloop.engine.sequence import Sequence
from tinyloop.requests import GenerationResult

__all__ = ["CHAIN_GROWTH", "SpeculationState", "counters"]

# A chain accepted whole grows up to this many times the request's ``draft_ahead``.
CHAIN_GROWTH = 4


@dataclass(eq=False)
class SpeculationState:
    """A speculative sequence's counters (``modes.ModeState``): tokens drafted, and of them
    accepted and rejected by verification; chains cut short because the draft was unsure."""

    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    stopped_unsure: int = 0  # chains ended before ``draft_ahead`` by ``Engine.draft_min_prob``
    ahead: int = 0  # a chain's length now (0: the request's ``draft_ahead``)

    def chain_length(self, draft_ahead: int) -> int:
        """The length of this step's chain: ``draft_ahead``, doubled after each chain that ran to
        its length and was accepted whole (up to ``CHAIN_GROWTH`` times ``draft_ahead``), halved
        back toward it after a rejection. Where the draft is sure for long runs, each verify
        then covers more tokens; the draft-confidence stop still ends a chain where it is not."""
        if self.ahead == 0:
            self.ahead = draft_ahead
        self.ahead = min(max(self.ahead, draft_ahead), CHAIN_GROWTH * draft_ahead)
        return self.ahead

    def adapt(self, full: bool, all_accepted: bool) -> None:
        """After a chain's verification: grow after a whole accepted one, shrink after a rejection."""
        if full and all_accepted:
            self.ahead *= 2
        elif not all_accepted:
            self.ahead //= 2

    def blocks(self) -> int:
        return 0

    def release(self) -> None:
        pass

    def contribute(self, result: GenerationResult) -> GenerationResult:
        return dataclasses.replace(result, draft_tokens=self.drafted, accepted_draft_tokens=self.accepted,
                                   rejected_draft_tokens=self.rejected)


def counters(seq: Sequence) -> SpeculationState:
    """``seq``'s speculation counters (a speculative sequence gets them when it starts)."""
    state = seq.mode_state
    assert isinstance(state, SpeculationState), "a speculative sequence carries its counters"
    return state
