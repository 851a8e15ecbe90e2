"""Self-speculative decoding: draft with the same weights at fewer loops, verify in one forward.

One ``Speculator.run`` serves every speculative sequence of an engine step, batched:

1. Plan. A sequence with ``L`` tokens in its KV and a pending token drafts ``k = min(draft_ahead,
   tokens left - 1)`` tokens per branch, so an accepted run never passes ``max_tokens``. With
   ``k = 0`` (or no KV blocks to speculate with) it falls back to a plain decode step. A step
   drafts at most ``Engine.max_draft_nodes`` tokens over all its sequences, shared evenly: a
   sequence's branches and depth shrink to its share (the output does not change, only speed).
2. Draft. One-token forwards at ``draft_loops``, every draft row of every sequence in one batched
   call per depth. Draft rows run inside the verifier's KV layout (``RowSpec.kv_loops``): they
   read the prefix's KV of the loops they run (and its coda), and write their own KV at
   positions ``>= L`` that are never committed: ``SeqKV.length`` stays ``L`` and the verify
   forward overwrites those positions in every slot. A chain drafts in the sequence's own KV. A
   tree drafts its root in the sequence's KV, takes the top ``K`` draft tokens after it as the
   first level, then forks the KV once per branch (copy-on-write, only the root's partly filled
   block is copied) and extends every branch greedily to depth ``k``: ``K * k`` nodes. Forks are
   freed after drafting.
3. Verify. One forward at the sequence's loops over the root and every node (``1 + K * k``
   tokens; ``k + 1`` for a chain), node ``i`` written at position ``L + i`` with RoPE position
   and noise position ``L + depth``, attending to its ancestors only (``extra_mask``).
   Sequences with the same node count share one batched call.
4. Accept (``acceptance.py``) and commit: the root and the accepted path's nodes hold exactly
   the KV that plain decoding writes for those tokens (same positions, same ancestors). A path
   that is not stored right after the root (a tree branch other than the first) is moved there
   row by row; then the KV is truncated past the path, freeing whole blocks.

Only the verifier decides what is emitted, so drafts change the speed, never the output. Two
settings would break that and are refused by ``Engine.validate``: a cache window below the loops
(a token would read its predecessors' slots as filled by the same loop of the verify forward,
not by their last loop) and a model with an adaptive exit rule (a multi-token forward cannot
exit per token). Warm start is refused by the request itself.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tinyloop.engine.acceptance import (
    DraftTree, Verdict, accept_chain_sampled, accept_greedy, accept_tree_sampled,
)
from tinyloop.engine.modes import Core
from tinyloop.engine.output import Emission
from tinyloop.engine.sampling import (
    apply_penalties, draw, greedy_token, target_probs, token_logprob,
)
from tinyloop.engine.sequence import Sequence
from tinyloop.errors import KVCacheExhausted
from tinyloop.model.kvcache import SeqKV
from tinyloop.model.looped import ForwardOutput, RowSpec
from tinyloop.requests import GenerationResult

__all__ = ["Emission", "SpeculationState", "Speculator", "counters"]


@dataclass(eq=False)
class _Job:
    """One sequence's speculation in this step."""

    seq: Sequence
    start: int  # L: where the pending token goes
    depth: int  # k: drafted tokens per branch
    width: int  # K: branches (1 for a chain)
    draft_loops: int
    branches: list[list[int]] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q per drafted chain token
    forks: list[SeqKV] = field(default_factory=list)
    tree: DraftTree | None = None

    @property
    def sampled_chain(self) -> bool:
        return self.width == 1 and not self.seq.request.sampling.greedy


@dataclass(eq=False, slots=True)
class _Row:
    """One row of a draft forward: feed ``token`` at ``start`` into ``kv``."""

    job: _Job
    kv: SeqKV
    branch: int  # -1: the root of a tree, whose logits give the first level
    token: int
    start: int


class Speculator:
    """Runs the speculative steps of one engine (same model, pool and thread)."""

    def __init__(self, core: Core) -> None:
        self.engine = core

    def run(self, seqs: Seq[Sequence]) -> tuple[list[tuple[Sequence, list[Emission]]], list[Sequence]]:
        """Speculate for ``seqs``: (each sequence's tokens to append, in order; the sequences that
        need a plain decode step instead)."""
        jobs, plain = self._plan(seqs)
        if not jobs:
            return [], plain
        self._draft(jobs)
        verifying = []
        for job in jobs:
            job.tree = DraftTree.from_branches(_pending(job.seq), job.branches)
            try:
                job.seq.kv.reserve(job.start + len(job.tree))
            except KVCacheExhausted:
                plain.append(job.seq)  # drafted for nothing; the root's block is still reserved
            else:
                verifying.append(job)
        by_size: dict[int, list[_Job]] = defaultdict(list)
        for job in verifying:
            by_size[len(job.tree or ())].append(job)
        # Every verify forward runs before any commit: a forward that raises leaves every KV
        # length as it was, and the engine decodes these sequences plainly instead.
        verified = [(group, self._verify(group)) for group in by_size.values()]  # [B, T, V] each
        out: list[tuple[Sequence, list[Emission]]] = []
        for group, logits in verified:
            for b, job in enumerate(group):
                try:
                    out.append((job.seq, self._commit(job, logits[b])))
                except Exception as exc:  # this sequence's bookkeeping: it fails alone
                    job.seq.fail(exc)
        return out, plain

    # -- plan ----------------------------------------------------------------------------------
    def _plan(self, seqs: Seq[Sequence]) -> tuple[list[_Job], list[Sequence]]:
        jobs, plain = [], []
        # The step's draft nodes are capped (``Engine.max_draft_nodes``) and shared evenly, so
        # one request's wide tree cannot make every other sequence's step slow.
        left = self.engine.max_draft_nodes
        share = max(left // max(len(seqs), 1), 1)
        for seq in seqs:
            spec = seq.request.speculation
            assert spec is not None
            draft_loops, ahead, width = spec
            cap = min(share, left)
            if cap < 1:  # the step's draft budget is spent: a plain step this time
                plain.append(seq)
                continue
            width = min(width, cap)
            start = seq.kv.length
            depth = min(ahead, seq.request.max_tokens - len(seq.output) - 1, cap // max(width, 1))
            # a tree's nodes are stored side by side past its root: keep them inside the model's
            # positions (h-mode derives RoPE tables from storage positions)
            depth = min(depth, (self.engine.config.max_position - start - 1) // width)
            if depth < 1:  # one token left: a plain step gives it
                plain.append(seq)
                continue
            try:  # a chain drafts and verifies in place; a tree reserves for its nodes later
                seq.kv.reserve(start + (depth + 1 if width == 1 else 1))
            except KVCacheExhausted:
                plain.append(seq)
                continue
            jobs.append(_Job(seq, start, depth, width, draft_loops, [[]] if width == 1 else []))
            left -= depth * width
        return jobs, plain

    # -- draft ---------------------------------------------------------------------------------
    def _draft(self, jobs: list[_Job]) -> None:
        rows = [_Row(job, job.seq.kv, -1 if job.width > 1 else 0, _pending(job.seq), job.start)
                for job in jobs]
        try:
            while rows:
                logits = self._draft_forward(rows)  # [B, V]
                rows = [nxt for row, lg in zip(rows, logits) for nxt in self._extend(row, lg)]
        finally:
            for job in jobs:
                for fork in job.forks:
                    fork.free()
                job.forks = []

    def _extend(self, row: _Row, logits: torch.Tensor) -> list[_Row]:
        """Choose the next draft token(s) from a draft row's logits; the rows to feed next."""
        job, seq = row.job, row.job.seq
        params = seq.request.sampling
        if row.branch < 0:
            first = _top_tokens(logits, seq, job.width)
            job.branches = [[t] for t in first]
            return self._fork(job, first) if job.depth > 1 else []
        branch = job.branches[row.branch]
        history = [*seq.output, *branch]
        if job.sampled_chain:
            q = target_probs(logits, params, seq.prompt, history)
            token = draw(q, seq.generator)
            job.draft_probs.append(q)
        else:
            token = greedy_token(logits, params, seq.prompt, history)
        branch.append(token)
        if len(branch) >= job.depth:
            return []
        return [_Row(job, row.kv, row.branch, token, row.start + 1)]

    def _fork(self, job: _Job, first: list[int]) -> list[_Row]:
        """One KV fork per branch, holding the root's draft KV; a short pool keeps depth 1."""
        kv = job.seq.kv
        kv.length = job.start + 1  # the root's draft KV is in: forks copy its block on write
        try:
            for _ in first:
                fork = kv.fork()
                job.forks.append(fork)
                fork.reserve(job.start + job.depth)
        except KVCacheExhausted:
            for fork in job.forks:
                fork.free()
            job.forks = []
            job.depth = 1
            return []
        finally:
            kv.length = job.start
        return [_Row(job, fork, b, t, job.start + 1) for b, (fork, t) in enumerate(zip(job.forks, first))]

    def _draft_forward(self, rows: list[_Row]) -> torch.Tensor:
        eng = self.engine
        ctx = eng.context([r.kv for r in rows], [r.start for r in rows], 1)
        specs = [RowSpec(loops=r.job.draft_loops, window=r.job.seq.window, start=r.start,
                         noise_seed=r.job.seq.noise_seed, kv_loops=r.job.seq.loops) for r in rows]
        tokens = torch.tensor([[r.token] for r in rows], dtype=torch.long, device=eng.device)  # [B, 1]
        out: ForwardOutput = eng.run_model(tokens, ctx, specs)
        return out.logits[:, -1]  # [B, V]

    # -- verify and commit ---------------------------------------------------------------------
    def _verify(self, jobs: list[_Job]) -> torch.Tensor:
        trees = [job.tree for job in jobs if job.tree is not None]
        mask = torch.stack([t.mask() for t in trees])  # [B, T, T]
        return self.engine.verify([j.seq for j in jobs], [list(t.tokens) for t in trees], mask=mask,
                                  positions=[t.positions(j.start) for t, j in zip(trees, jobs)])  # [B, T, V]

    def _commit(self, job: _Job, logits: torch.Tensor) -> list[Emission]:
        """Accept against the verifier's ``logits`` [T, V], fix the KV, count, emit."""
        seq, tree = job.seq, job.tree
        assert tree is not None
        verdict = self._accept(job, tree, logits)
        n = len(verdict.path)
        seq.kv.length = job.start + len(tree)
        wanted = list(range(1, n + 1))
        if verdict.path != wanted:
            _move_positions(seq.kv, [job.start + i for i in verdict.path],
                            [job.start + i for i in wanted], self.engine.device)
        seq.kv.truncate(job.start + 1 + n)
        count = counters(seq)
        count.drafted += len(tree) - 1
        count.accepted += n
        count.rejected += len(tree) - 1 - n
        seq.last_loops = seq.loops
        params = seq.request.sampling
        return [(tok, token_logprob(logits[node], tok, params))
                for tok, node in zip(verdict.tokens, verdict.nodes)]

    @staticmethod
    def _accept(job: _Job, tree: DraftTree, logits: torch.Tensor) -> Verdict:
        seq = job.seq
        params = seq.request.sampling
        if params.greedy:
            return accept_greedy(tree, logits, params, seq.prompt, seq.output)
        if job.width == 1:
            return accept_chain_sampled(tree, logits, job.draft_probs, params, seq.prompt,
                                        seq.output, seq.generator)
        return accept_tree_sampled(tree, logits, params, seq.prompt, seq.output, seq.generator)


def _pending(seq: Sequence) -> int:
    assert seq.pending is not None, "a decoding sequence always has a pending token"
    return seq.pending


def _top_tokens(logits: torch.Tensor, seq: Sequence, k: int) -> list[int]:
    """The ``k`` most likely draft tokens after the pending one, penalties applied (temperature
    and the filters keep the order)."""
    raw = logits.detach().to(device="cpu", dtype=torch.float32)  # [V]
    penalised = apply_penalties(raw, seq.request.sampling, seq.prompt, seq.output)  # [V]
    return [int(t) for t in torch.topk(penalised, k).indices]


def _move_positions(kv: SeqKV, src: list[int], dst: list[int], device: torch.device) -> None:
    """Copy what positions ``src`` store (K and V, 4-bit or h, per the pool's mode) to ``dst`` in
    every slot of ``kv``; its blocks there are its own (``reserve`` copied any shared one)."""
    pool = kv.pool
    bs = pool.block_size
    tables = torch.tensor(kv.tables, dtype=torch.long)  # [S, NB]
    s, d = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)  # [n]
    src_rows = (tables[:, s // bs] * bs + s % bs).flatten()  # [S * n] rows of the store
    dst_rows = (tables[:, d // bs] * bs + d % bs).flatten()  # [S * n]
    pool.store.copy_rows(src_rows.to(device), dst_rows.to(device))


@dataclass(eq=False)
class SpeculationState:
    """A speculative sequence's counters (``modes.ModeState``): tokens drafted, and of them
    accepted and rejected by verification."""

    drafted: int = 0
    accepted: int = 0
    rejected: int = 0

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
