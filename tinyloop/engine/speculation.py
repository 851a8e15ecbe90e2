"""The strategy of the speculative modes (``speculative``: a chain; ``tree``): each step, draft
and verify through one ``Speculator`` (``speculative.py``), then append the verified runs.

Both modes share one strategy object: the step's draft budget (``Engine.max_draft_nodes``) is
shared evenly by all their sequences, and sequences with equal node counts share a verify
forward. A sequence that cannot speculate this step (no KV for its drafts, one token left, the
budget spent, or a draft or verify forward that raised) decodes plainly instead: drafts never
change the output. A sequence whose acceptance bookkeeping raises fails alone.
"""

from __future__ import annotations

import logging

import torch

from tinyloop.engine.modes import Core, Finish, guard, no_events, reserve_or_fail
from tinyloop.engine.output import Emission, accept_run
from tinyloop.engine.sequence import Sequence, TokenEvent
from tinyloop.engine.speculative import SpeculationState, Speculator
from tinyloop.errors import EngineBroken, RequestError

__all__ = ["SpeculativeDecoding", "check_drafting"]

_log = logging.getLogger("tinyloop.engine")


class SpeculativeDecoding:
    """The strategy (``modes.Strategy``) of modes ``speculative`` (a chain) and ``tree``: one
    ``Speculator`` drafts and verifies both, so they share the step's draft budget."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.speculator = Speculator(core)

    def new_state(self, seq: Sequence) -> SpeculationState:
        return SpeculationState()

    def prepare(self, seqs: list[Sequence]) -> list[Sequence]:
        return reserve_or_fail(seqs)

    def first(self, seq: Sequence, logits: torch.Tensor) -> list[TokenEvent] | None:
        return None  # the prompt's logits are sampled; speculation starts at the next step

    def plan(self, seqs: list[Sequence]) -> tuple[Finish, list[Sequence]]:
        """Speculate; when a draft or verify forward raises, these sequences decode plainly this
        step instead (drafts never change the output, and no KV was committed)."""
        try:
            with torch.inference_mode():
                runs, plain = self.speculator.run(seqs)
        except EngineBroken:
            raise
        except Exception:  # raised before any commit: every KV length is where it was
            _log.exception("speculation failed; %d sequences decode plainly this step", len(seqs))
            return no_events, list(seqs)

        def finish() -> list[TokenEvent]:
            events: list[TokenEvent] = []
            for seq, emissions in runs:
                events.extend(guard(seq, self._accept, seq, emissions) or [])
            return events
        return finish, plain

    def _accept(self, seq: Sequence, emissions: list[Emission]) -> list[TokenEvent]:
        """Append a verified run of tokens, stopping at the first stop condition."""
        return accept_run(seq, emissions, self.core.eos_ids, loops_each=seq.loops)


def check_drafting(max_draft_nodes: int, draft_min_prob: float) -> tuple[int, float]:
    """The engine's speculation options, checked: draft tokens per step (all sequences together)
    and the draft probability under which a chain stops (RequestError naming the option)."""
    if max_draft_nodes < 1:
        raise RequestError("max_draft_nodes must be >= 1", param="max_draft_nodes")
    if not 0 <= draft_min_prob <= 1:
        raise RequestError("draft_min_prob must be in [0, 1]", param="draft_min_prob")
    return max_draft_nodes, draft_min_prob
