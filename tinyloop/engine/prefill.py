"""Prefill chunks, one sequence's or a group's together in one forward.

A burst of new requests would prefill one forward each, one after the other. ``BatchedPrefill``
groups a step's prefilling sequences that may share a forward (plain mode, the same loops and
window: ``group_key``) and runs each group's next chunks (up to ``prefill_chunk`` tokens each)
in one forward, right-padded to the longest (``prefill_chunks``):

- a row's pads come after its real tokens, so the causal mask keeps every real token from
  attending to them;
- their KV lands past the row's real length, in blocks reserved for the padded length;
  ``kv.length`` advances by the real count only and the blocks that hold nothing real go back
  at once (``SeqKV.truncate``): the sequence holds what a chunk of its own would leave. Later
  writes overwrite the pads of its last block, and no forward attends past a key's length;
- a row's logits and warm state come from its last real token (``RowSpec.last``).

Rows that would not run the same padded (a one-token chunk under a stop rule: the rule and its
KV gaps act on one-token forwards only; ``gate_expected`` weights a row's logits by its last
column's exit probability, so it shares only with chunks of its own length), a group whose
padded reservation does not fit in the free blocks (it would evict prefix-cache blocks that a
chunk of its own would not) or whose pads would pass the model's positions, and other modes,
prefill alone. A batched row may differ from its prefill alone in float rounding (the matrix
products sum over more rows, as in batched decode); greedy outputs are the same. A batched
forward that raises is retried one sequence at a time, as ``plain.decode`` does.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tinyloop.engine.modes import Core, guard
from tinyloop.engine.sequence import Sequence
from tinyloop.errors import EngineBroken
from tinyloop.model.looped import ForwardOutput, LoopedLM

__all__ = ["BatchedPrefill", "advance", "group_key", "prefill_chunks"]

PAD_TOKEN = 0  # what fills a short row: its KV lies past the row's length, never attended


def advance(model: LoopedLM, seqs: Seq[Sequence], out: ForwardOutput, counts: Seq[int]) -> None:
    """After a forward of ``counts`` real tokens per row: each sequence's KV length and gaps, its
    loops, and its warm state (its last real token's final core state)."""
    for row, (s, used, n) in enumerate(zip(seqs, out.loops_used, counts)):
        s.kv.gaps.pop(s.kv.length, None)  # a retried step rewrites the position
        if used < s.loops and n == 1 and s.exit.exited_kv == "skip":
            s.kv.gaps[s.kv.length] = used  # its later loop slots stay unwritten
        s.kv.length += n
        s.last_loops = used
        if s.request.warm_start:
            final = out.state[row, n - 1]
            s.warm_state = (model.final_norm(final) if s.request.warm_start_from == "normed" else final).clone()


def prefill_chunks(core: Core, seqs: Seq[Sequence]) -> list[torch.Tensor | None]:
    """Run each sequence's next chunk in one forward (right-padded when they differ); per
    sequence the last logits ``[V]`` once its context is in (None before, and for a resumed
    preempted sequence, whose pending token decodes next)."""
    chunks = [s.context[s.kv.length:s.kv.length + core.prefill_chunk] for s in seqs]
    width = max(len(c) for c in chunks)
    out = core.forward(seqs, core.host_tokens([c + [PAD_TOKEN] * (width - len(c)) for c in chunks]),
                       warm=False, counts=[len(c) for c in chunks])
    results: list[torch.Tensor | None] = []
    for row, (s, chunk) in enumerate(zip(seqs, chunks)):
        if len(chunk) < width:
            s.kv.truncate(s.kv.length)  # the blocks that hold only pads
        core.prefilled_tokens += len(chunk)
        if s.prefilling or s.resumed:
            s.resumed = s.resumed and s.prefilling  # a resumed sequence's pending token decodes next
            results.append(None)
            continue
        s.loops_total += out.loops_used[row]
        results.append(out.logits[row, -1])
    return results


def group_key(seq: Sequence, chunk: int) -> tuple[int, int, int] | None:
    """Sequences of one key may prefill in one forward; None: this one prefills alone."""
    n = min(seq.context_length - seq.kv.length, chunk)
    if seq.request.mode != "generate" or (n == 1 and seq.exit.stops):
        return None
    return seq.loops, seq.window, n if seq.exit.kind == "gate_expected" else 0


class BatchedPrefill:
    """A step's prefill: the groups ``group_key`` forms in one forward each, the others alone."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def run(self, seqs: Seq[Sequence]) -> list[tuple[Sequence, torch.Tensor | None]]:
        """Each of ``seqs`` (prefilling) with its ``prefill_step`` result, in order; a sequence
        that failed is finished with its error and has None."""
        groups: dict[tuple[int, int, int], list[Sequence]] = {}
        for s in seqs:
            key = group_key(s, self.core.prefill_chunk)
            if key is not None:
                groups.setdefault(key, []).append(s)
        done: dict[int, torch.Tensor | None] = {}
        for group in groups.values():
            if len(group) > 1 and self._fits(group):
                done.update(self._together(group))
        return [(s, done[id(s)] if id(s) in done else guard(s, self.core.prefill_step, s)) for s in seqs]

    def _fits(self, group: list[Sequence]) -> bool:
        """Whether the group's padded chunks fit the model's positions and the free blocks."""
        width = max(min(s.context_length - s.kv.length, self.core.prefill_chunk) for s in group)
        ends = [s.kv.length + width for s in group]
        need = sum(s.kv.blocks_to_reserve(end) for s, end in zip(group, ends))
        return max(ends) <= self.core.config.max_position and need <= group[0].kv.pool.free_blocks

    def _together(self, group: list[Sequence]) -> dict[int, torch.Tensor | None]:
        """The group in one forward; when it raises, each sequence alone (as before the call)."""
        saved = [(s.kv.length, s.last_loops, s.warm_state) for s in group]
        try:
            with torch.inference_mode():
                return {id(s): logits for s, logits in zip(group, prefill_chunks(self.core, group))}
        except EngineBroken:
            raise
        except Exception:
            for s, (length, last, warm) in zip(group, saved):
                s.kv.truncate(length)  # the reserved blocks and whatever a row stored
                s.last_loops, s.warm_state = last, warm
            return {}
