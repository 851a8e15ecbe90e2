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
   tree (``draft_tree.py``) grows level by level, ``K`` nodes per level and ``k`` levels: every
   node of the frontier proposes its top ``K`` draft tokens (penalties applied, after its own
   path), and the level keeps ``K`` of them, the draft's greedy chain first, then by draft path
   probability, so siblings appear at any depth: at most ``K * k`` nodes. A chain stops early
   once the draft is unsure (``Engine.draft_min_prob``): when the token it just drafted has a
   draft probability below that, it is the chain's last, since the tokens after it would
   likely be rejected (each costs a draft forward and a verify row for nothing). On the demo
   model a chain of ``draft_ahead`` 8 at 1 draft loop went from 57% of its drafts accepted and
   1.04x plain decoding to 94% and 1.3x (``bench/RESULTS.md``). The stop depends on the draft
   only, so greedy output stays that of plain decoding and sampled output keeps its exact
   distribution (a draft length chosen from the drafted prefix leaves each position's
   accept-or-resample law as it is). The root drafts in
   the sequence's KV; each node of the next level drafts in a KV holding its ancestors' draft
   KV: its parent's fork, taken over by the parent's first child and forked (copy-on-write, only
   the partly filled block is copied) for the others and for the root's children. Forks are
   freed when their node has no children, and after drafting.
3. Verify. One forward at the sequence's loops over the root and every node (up to
   ``1 + K * k`` tokens; ``k + 1`` for a chain), node ``i`` written at position ``L + i`` with
   RoPE position and noise position ``L + depth``, attending to its ancestors only (``extra_mask``).
   Sequences with the same node count share one batched call.
4. Accept (``acceptance.py``) and commit: the root and the accepted path's nodes hold exactly
   the KV that plain decoding writes for those tokens (same positions, same ancestors). A path
   that is not stored right after the root (one off the tree's first branch) is moved there
   row by row (a tree is stored in preorder, the draft's greedy chain right after the root);
   then the KV is truncated past the path, freeing whole blocks.

Under a grammar (structured outputs, ``grammar/drafts.py``) the drafts are chosen under its mask
(a chain walks the matcher along and back; a chain ends where the grammar is complete) and each
verified node's logits are masked at the grammar's state after its path, so acceptance chooses
what plain constrained decoding chooses.

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

from tinyloop.engine.acceptance import DraftTree, Verdict, accept_chain_sampled, accept_greedy, accept_tree_sampled
from tinyloop.engine.draft_tree import Candidate, TreeGrowth
from tinyloop.engine.modes import Core
from tinyloop.engine.output import Emission
from tinyloop.engine.sampling import adjust_logits, draw, greedy_token_prob, target_probs, token_logprob
from tinyloop.engine.sequence import Sequence
from tinyloop.errors import KVCacheExhausted
from tinyloop.grammar.drafts import DraftGrammar
from tinyloop.model.kvcache import SeqKV
from tinyloop.model.looped import ForwardOutput, RowSpec
from tinyloop.requests import GenerationResult

__all__ = ["CHAIN_GROWTH", "Emission", "SpeculationState", "Speculator", "counters"]

# A chain accepted whole grows up to this many times the request's ``draft_ahead``.
CHAIN_GROWTH = 4


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
    growth: TreeGrowth | None = None  # a tree's nodes while drafting (None for a chain)
    tree: DraftTree | None = None
    grammar: DraftGrammar | None = None  # a constrained sequence's grammar: masks drafts and verifier

    def __post_init__(self) -> None:
        if self.width > 1:
            self.growth = TreeGrowth(_pending(self.seq), self.width)
        if self.seq.matcher is not None:
            self.grammar = DraftGrammar(self.seq.matcher)

    def draft_tree(self) -> DraftTree:
        if self.growth is not None:
            return self.growth.tree()
        return DraftTree.from_branches(_pending(self.seq), self.branches)

    @property
    def sampled_chain(self) -> bool:
        return self.width == 1 and not self.seq.request.sampling.greedy


@dataclass(eq=False, slots=True)
class _Row:
    """One row of a draft forward: feed ``token`` at ``start`` into ``kv``."""

    job: _Job
    kv: SeqKV
    node: int  # the tree node fed (0: the root; always 0 for a chain)
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
            job.tree = job.draft_tree()
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
            if width == 1:  # a chain's length adapts to its acceptance (``SpeculationState.ahead``)
                ahead = counters(seq).chain_length(ahead)
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
        rows = [_Row(job, job.seq.kv, 0, _pending(job.seq), job.start) for job in jobs]
        try:
            while rows:
                logits = self._draft_forward(rows)  # [B, V]
                level: dict[_Job, list[tuple[_Row, torch.Tensor]]] = defaultdict(list)
                for row, lg in zip(rows, logits):
                    level[row.job].append((row, lg))
                rows = [nxt for job, fed in level.items() for nxt in self._extend(job, fed)]
        finally:
            for job in jobs:
                for fork in job.forks:
                    fork.free()
                job.forks = []
                if job.grammar is not None:
                    job.grammar.restore()  # the matcher back where the sequence is

    def _extend(self, job: _Job, fed: list[tuple[_Row, torch.Tensor]]) -> list[_Row]:
        """Choose the next draft token(s) from the logits of a job's rows just fed; the rows to
        feed next."""
        seq = job.seq
        if job.growth is None:  # a chain: one row, one token
            [(row, logits)] = fed
            if job.grammar is not None:
                logits = job.grammar.chain_row(logits)  # what the grammar refuses at -inf
            params = seq.request.sampling
            branch = job.branches[0]
            history = [*seq.output, *branch]
            eos = self.engine.eos_ids
            if job.sampled_chain:
                q = target_probs(logits, params, seq.prompt, history, eos)
                token = draw(q, seq.generator)
                job.draft_probs.append(q)
                sure = float(q[token])
            else:
                token, sure = greedy_token_prob(logits, params, seq.prompt, history, eos)
            branch.append(token)
            ended = job.grammar is not None and job.grammar.chain_token(token)  # the grammar is complete
            if len(branch) >= job.depth or sure < self.engine.draft_min_prob or ended:
                counters(seq).stopped_unsure += len(branch) < job.depth and not ended
                if job.grammar is not None:
                    job.grammar.chain_end(logits.shape[-1])
                return []
            return [_Row(job, row.kv, 0, token, row.start + 1)]
        growth = job.growth
        parents = [row for row, _ in fed]
        added = growth.grow([row.node for row in parents],
                            [_top_tokens(lg if job.grammar is None else job.grammar.node_row(lg, growth.path(row.node)),
                                         seq, job.width, growth.path(row.node), self.engine.eos_ids)
                             for row, lg in fed])
        if parents[0].start + 1 - job.start >= job.depth:  # the new level is the last one
            return []
        return self._fork(job, parents, added)

    def _fork(self, job: _Job, parents: list[_Row], added: list[int]) -> list[_Row]:
        """A KV per new node, holding its ancestors' draft KV: a parent's first child takes over
        the parent's fork, every other child (and every child of the root) gets a fork of it.
        Parents left without children free theirs; a short pool ends the tree at this level."""
        growth = job.growth
        assert growth is not None
        by_node = {row.node: row for row in parents}
        taken: set[int] = set()
        rows = []
        try:
            for node in added:
                parent = by_node[growth.parents[node]]
                kv = parent.kv
                if kv is not job.seq.kv and parent.node not in taken:
                    taken.add(parent.node)
                else:
                    kv = _branch(kv, parent.start + 1, job.start + job.depth)
                    job.forks.append(kv)
                rows.append(_Row(job, kv, node, growth.tokens[node], parent.start + 1))
        except KVCacheExhausted:
            for fork in job.forks:
                fork.free()
            job.forks = []
            return []
        for row in parents:
            if row.node not in taken and row.kv is not job.seq.kv:
                job.forks.remove(row.kv)
                row.kv.free()
        return rows

    def _draft_forward(self, rows: list[_Row]) -> torch.Tensor:
        eng = self.engine
        ctx = eng.context([r.kv for r in rows], [r.start for r in rows], 1)
        specs = [RowSpec(loops=r.job.draft_loops, window=r.job.seq.window, start=r.start,
                         noise_seed=r.job.seq.noise_seed, kv_loops=r.job.seq.loops) for r in rows]
        tokens = torch.tensor([[r.token] for r in rows], dtype=torch.long, device=eng.device)  # [B, 1]
        out: ForwardOutput = eng.run_model(tokens, ctx, specs, model=eng.draft_model)  # int8 with draft_weights
        return out.logits[:, -1]  # [B, V]

    # -- verify and commit ---------------------------------------------------------------------
    def _verify(self, jobs: list[_Job]) -> torch.Tensor:
        trees = [job.tree for job in jobs if job.tree is not None]
        if all(job.width == 1 for job in jobs):  # chains: causal at consecutive positions, the default
            return self.engine.verify([j.seq for j in jobs], [list(t.tokens) for t in trees])  # [B, T, V]
        mask = torch.stack([t.mask() for t in trees])  # [B, T, T]
        return self.engine.verify([j.seq for j in jobs], [list(t.tokens) for t in trees], mask=mask,
                                  positions=[t.positions(j.start) for t, j in zip(trees, jobs)])  # [B, T, V]

    def _commit(self, job: _Job, logits: torch.Tensor) -> list[Emission]:
        """Accept against the verifier's ``logits`` [T, V], fix the KV, count, emit."""
        seq, tree = job.seq, job.tree
        assert tree is not None
        raw = logits  # what logprobs are reported from: the logits before a grammar's mask
        if job.grammar is not None:  # each node's logits masked at the grammar's state after its path
            raw = logits.clone() if seq.request.sampling.logprobs or seq.request.sampling.top_logprobs else logits
            job.grammar.verify(logits, tree.paths())
        verdict = self._accept(job, tree, logits, self.engine.eos_ids)
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
        if job.width == 1:
            count.adapt(full=len(tree) - 1 == job.depth, all_accepted=n == len(tree) - 1)
        seq.last_loops = seq.loops
        params = seq.request.sampling
        return [(tok, token_logprob(raw[node], tok, params))
                for tok, node in zip(verdict.tokens, verdict.nodes)]

    @staticmethod
    def _accept(job: _Job, tree: DraftTree, logits: torch.Tensor, eos_ids: frozenset[int]) -> Verdict:
        seq = job.seq
        params = seq.request.sampling
        if params.greedy:
            return accept_greedy(tree, logits, params, seq.prompt, seq.output, eos_ids)
        if job.width == 1:
            return accept_chain_sampled(tree, logits, job.draft_probs, params, seq.prompt,
                                        seq.output, seq.generator, eos_ids)
        return accept_tree_sampled(tree, logits, params, seq.prompt, seq.output, seq.generator, eos_ids)


def _pending(seq: Sequence) -> int:
    assert seq.pending is not None, "a decoding sequence always has a pending token"
    return seq.pending


def _top_tokens(logits: torch.Tensor, seq: Sequence, k: int, path: list[int],
                eos_ids: frozenset[int]) -> list[Candidate]:
    """The ``k`` most likely draft tokens after the pending one and ``path``, bias, ``min_tokens``
    and penalties applied (temperature and the filters keep the order), with their
    log-probabilities at the request's temperature (1 for greedy), which rank them against other
    nodes' children."""
    raw = logits.detach().to(device="cpu", dtype=torch.float32)  # [V]
    params = seq.request.sampling
    penalised = adjust_logits(raw, params, seq.prompt, [*seq.output, *path], eos_ids)  # [V]
    scaled = penalised
    if not params.greedy:
        scaled = (penalised - penalised.max()) / max(params.temperature, torch.finfo(torch.float32).tiny)
    logprobs = torch.log_softmax(scaled, dim=-1)  # [V]
    top = torch.topk(penalised, k).indices
    # a token at -inf (refused by a grammar, kept out by min_tokens) could never be accepted
    return [(int(t), float(logprobs[t])) for t in top if penalised[t] > float("-inf")]


def _branch(kv: SeqKV, length: int, end: int) -> SeqKV:
    """A fork of ``kv`` keeping its first ``length`` positions, with room up to ``end``: the
    partly filled block it writes next is copied, later blocks are its own."""
    fork = kv.fork()
    fork.length = length
    try:
        fork.truncate(length)
        fork.reserve(end)
    except KVCacheExhausted:
        fork.free()
        raise
    return fork


def _move_positions(kv: SeqKV, src: list[int], dst: list[int], device: torch.device) -> None:
    """Copy what positions ``src`` store (K and V, 4-bit or h, per the pool's mode) to ``dst`` in
    every slot of ``kv``; its blocks there are its own (``reserve`` copied any shared one)."""
    pool = kv.pool
    bs = pool.block_size
    tables = torch.tensor(kv.tables, dtype=torch.long, device="cpu")  # [S, NB] host index math
    s, d = torch.tensor(src, dtype=torch.long, device="cpu"), torch.tensor(dst, dtype=torch.long, device="cpu")
    src_rows = (tables[:, s // bs] * bs + s % bs).flatten()  # [S * n] rows of the store
    dst_rows = (tables[:, d // bs] * bs + d % bs).flatten()  # [S * n]
    pool.store.copy_rows(src_rows.to(device), dst_rows.to(device))


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
