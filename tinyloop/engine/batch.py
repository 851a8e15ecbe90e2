"""One engine iteration over the running sequences, each driven by its mode's strategy.

``Batch.step(seqs)``: a prefill chunk for each prefilling sequence (the plain ones of the same
loops and window in one forward: ``prefill.py``); for the decoding ones, each
mode's strategy (``modes.Strategy``) reserves and runs its own forwards (speculation drafts and
verifies; a beam search decodes its beams), the plain sequences and every strategy's fallbacks
share one batched decode forward, the rows are sampled, and each strategy finishes its part.
A request with ``max_tokens == 0`` finishes (``length``) once its prompt is in, its prompt's
logits unsampled: no token, no event; the caller gets its result (and prompt logprobs) only.

Failures stay with their sequence: one that cannot get KV blocks, whose prefill, sampling (a NaN
row), stop check, detokenisation, speculation or beam bookkeeping raises finishes with
``seq.error`` and the others go on. When a batched forward raises, its sequences are retried one
by one in the same step and only those that fail alone fail. ``EngineBroken`` is the exception:
the engine cannot run anything, so it propagates.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tinyloop.engine.beam import BeamDecoding
from tinyloop.engine.modes import Finish, Strategy, guard
from tinyloop.engine.plain import PlainDecoding
from tinyloop.engine.prefill import BatchedPrefill, PrefillCore
from tinyloop.engine.sequence import ModeState, Sequence, TokenEvent
from tinyloop.engine.speculation import SpeculativeDecoding

__all__ = ["Batch"]


class Batch:
    """The strategies of one engine and the step that runs them."""

    def __init__(self, core: PrefillCore) -> None:
        self.plain = PlainDecoding(core)
        self.beam = BeamDecoding(core)
        # chain and tree sequences draft and verify together: one step's draft budget
        # (``max_draft_nodes``) is shared by both, and equal node counts share a verify forward
        self.speculative = SpeculativeDecoding(core)
        self.core = core
        self.prefill = BatchedPrefill(core)  # the step's prefill chunks, grouped into shared forwards
        # in the order their parts of a step run (and their events come out)
        self.strategies: dict[str, Strategy] = {
            "generate": self.plain, "beam": self.beam, "speculative": self.speculative, "tree": self.speculative}

    def strategy(self, seq: Sequence) -> Strategy:
        return self.strategies.get(seq.request.mode, self.plain)

    def new_state(self, seq: Sequence) -> ModeState | None:
        return self.strategy(seq).new_state(seq)

    def step(self, seqs: Seq[Sequence]) -> list[TokenEvent]:
        """One iteration over ``seqs`` (the module docstring)."""
        groups: dict[int, tuple[Strategy, list[Sequence]]] = {}
        for strategy in self.strategies.values():
            groups.setdefault(id(strategy), (strategy, []))
        for s in seqs:
            if not s.finished and not s.prefilling:
                groups[id(self.strategy(s))][1].append(s)
        prepared = [(st, st.prepare(group)) for st, group in groups.values() if group]
        ready: list[tuple[Sequence, torch.Tensor]] = []
        for seq, logits in self.prefill.run([s for s in seqs if not s.finished and s.prefilling]):
            if logits is None or seq.prefill_only:
                continue
            if seq.request.max_tokens == 0:
                seq.finish("length", "length")  # the prompt alone was asked for (its logprobs)
            else:
                ready.append((seq, logits))
        finishes: list[Finish] = []
        plain: list[Sequence] = []
        for st, group in prepared:
            finish, fallback = st.plan(group)
            finishes.append(finish)
            plain.extend(fallback)
        events: list[TokenEvent] = []
        if (len(plain) == 1 and not ready and len(prepared) == 1 and prepared[0][0] is self.plain
                and sum(not s.finished for s in seqs) == 1):
            burst = self.plain.burst(plain[0])  # a lone greedy sequence: several tokens in one call
            if burst is not None:
                events.extend(burst)
                plain = []
        ready.extend(self.plain.decode(plain))
        sample: list[tuple[Sequence, torch.Tensor]] = []
        for seq, logits in ready:
            first = guard(seq, self.strategy(seq).first, seq, logits)
            if first is None and not seq.finished:
                sample.append((seq, logits))
            events.extend(first or [])
        if sample:
            events.extend(self.plain.sample([s for s, _ in sample], [row for _, row in sample]))
        for finish in finishes:
            events.extend(finish())
        return events
