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

Prompt logprobs (``GenerationRequest.prompt_logprobs``) come from the prefill the request runs
anyway: while a sequence still lacks some, its chunks run with every position's logits
(``last_only=False``) and it prefills alone (a batched forward would compute the head at every
position of every row for one row's sake). Position ``p``'s logits give prompt token ``p + 1``'s
entry (``sampling.logprob_entries``: raw logits, as sampled tokens' logprobs), the first token's
is None, and a chunk's last position gives the next chunk's first token; each chunk's entries
are made at once and its full logits dropped, only the last position's kept. Entries go in
position order and a position already covered is skipped, so a sequence preempted and
prefilled again (``Engine.preempt``) neither repeats nor loses one; the prefix cache and the
prefix pool serve none of the positions whose logits are still needed
(``prompt_logits_from``, ``PrefixCache.attach``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from tinyloop.engine.modes import Core, guard
from tinyloop.engine.sampling import logprob_entries
from tinyloop.engine.sequence import Sequence
from tinyloop.errors import EngineBroken
from tinyloop.model.looped import ForwardOutput, LoopedLM

__all__ = ["BatchedPrefill", "PrefillCore", "advance", "group_key", "prefill_chunks", "prompt_logits_from"]

PAD_TOKEN = 0  # what fills a short row: its KV lies past the row's length, never attended
ENTRY_ROWS = 256  # positions turned into prompt logprob entries at a time: bounds the log_softmax copy


class PrefillCore(Core, Protocol):
    """The engine core as the prefill uses it: ``forward`` can return every position's logits."""

    def forward(self, seqs: Seq[Sequence], tokens: torch.Tensor, warm: bool,
                counts: Seq[int] | None = None, last_only: bool = True) -> ForwardOutput: ...


def prompt_logits_from(seq: Sequence) -> int | None:
    """The first position whose logits ``seq``'s prompt logprobs still need (the entries so far
    cover the tokens before the next one), or None when it needs none (not asked, or all made)."""
    if seq.request.prompt_logprobs is None:
        return None
    made = 1 if seq.prompt_logprobs is None else len(seq.prompt_logprobs)  # the first token's None counts
    return made - 1 if made < len(seq.prompt) else None


def _prompt_entries(seq: Sequence, logits: torch.Tensor, start: int) -> None:
    """Append the prompt logprob entries that a chunk's logits ``[n, V]`` (positions ``start`` on)
    give and ``seq`` lacks."""
    entries = seq.prompt_logprobs
    assert entries is not None, "prefill_chunks starts the entries"
    first = len(entries) - 1 - start  # the chunk row giving the next missing entry
    end = min(logits.shape[0], len(seq.prompt) - 1 - start)  # rows past it give output tokens
    if first < 0:
        raise RuntimeError(f"prompt logprobs of {seq!r} would skip positions {len(entries) - 1}..{start - 1}")
    top = seq.request.prompt_logprobs or 0
    for at in range(first, end, ENTRY_ROWS):
        stop = min(at + ENTRY_ROWS, end)
        entries.extend(logprob_entries(logits[at:stop], seq.prompt[start + at + 1:start + stop + 1], top))


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


def prefill_chunks(core: PrefillCore, seqs: Seq[Sequence]) -> list[torch.Tensor | None]:
    """Run each sequence's next chunk in one forward (right-padded when they differ); per
    sequence the last logits ``[V]`` once its context is in (None before, and for a resumed
    preempted sequence, whose pending token decodes next). A sequence that needs its chunk's
    every logits for prompt logprobs (the module docstring) gets its entries made here."""
    chunks = [s.context[s.kv.length:s.kv.length + core.prefill_chunk] for s in seqs]
    starts = [s.kv.length for s in seqs]
    for s in seqs:
        if s.request.prompt_logprobs is not None and s.prompt_logprobs is None:
            s.prompt_logprobs = [None]  # the first prompt token has nothing before it
    every = [prompt_logits_from(s) is not None for s in seqs]
    width = max(len(c) for c in chunks)
    out = core.forward(seqs, core.host_tokens([c + [PAD_TOKEN] * (width - len(c)) for c in chunks]),
                       warm=False, counts=[len(c) for c in chunks], last_only=not any(every))
    results: list[torch.Tensor | None] = []
    for row, (s, chunk) in enumerate(zip(seqs, chunks)):
        if len(chunk) < width:
            s.kv.truncate(s.kv.length)  # the blocks that hold only pads
        core.prefilled_tokens += len(chunk)
        if every[row]:
            _prompt_entries(s, out.logits[row, :len(chunk)], starts[row])
        if s.prefilling or s.resumed:
            s.resumed = s.resumed and s.prefilling  # a resumed sequence's pending token decodes next
            results.append(None)
            continue
        s.loops_total += out.loops_used[row]
        # all positions' logits: keep a copy of the last, not a view that holds them all
        results.append(out.logits[row, -1] if not any(every) else out.logits[row, len(chunk) - 1].clone())
    return results


def group_key(seq: Sequence, chunk: int) -> tuple[int, int, int] | None:
    """Sequences of one key may prefill in one forward; None: this one prefills alone (also
    while it needs every position's logits for its prompt logprobs)."""
    n = min(seq.context_length - seq.kv.length, chunk)
    if seq.request.mode != "generate" or (n == 1 and seq.exit.stops) or prompt_logits_from(seq) is not None:
        return None
    return seq.loops, seq.window, n if seq.exit.kind == "gate_expected" else 0


class BatchedPrefill:
    """A step's prefill: the groups ``group_key`` forms in one forward each, the others alone."""

    def __init__(self, core: PrefillCore) -> None:
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
