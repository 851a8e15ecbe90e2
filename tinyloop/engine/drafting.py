"""Drafting, step 2 of a speculative step (``speculative.py``'s docstring): one-token forwards
at each sequence's ``draft_loops``, every draft row of every sequence in one batched call per
depth, growing a chain (in the sequence's own KV) or a tree (level by level, each node in a
copy-on-write fork holding its ancestors' draft KV). Forks are freed by the time ``draft``
returns, whatever happens; the sequence's committed KV length never moves here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from tinyloop.engine.acceptance import DraftTree
from tinyloop.engine.draft_tree import Candidate, TreeGrowth
from tinyloop.engine.modes import Core
from tinyloop.engine.sampling import adjust_logits, draw, greedy_token_prob, picks_argmax, target_probs
from tinyloop.engine.sequence import Sequence
from tinyloop.engine.speculation_state import counters
from tinyloop.errors import KVCacheExhausted
from tinyloop.grammar.drafts import DraftGrammar
from tinyloop.model.kvcache import SeqKV
from tinyloop.model.looped import ForwardOutput, LoopedLM, RowSpec

__all__ = ["DraftJob", "Drafter"]


@dataclass(eq=False)
class DraftJob:
    """One sequence's speculation in this step: planned and committed by ``Speculator``, drafted
    by ``Drafter``."""

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

    job: DraftJob
    kv: SeqKV
    node: int  # the tree node fed (0: the root; always 0 for a chain)
    token: int
    start: int


class Drafter:
    """Drafts for the speculative sequences of one engine's step (same model, pool and thread)."""

    def __init__(self, core: Core) -> None:
        self.engine = core

    def draft(self, jobs: list[DraftJob]) -> None:
        """Draft every job's chain or tree; its forks are freed and its grammar restored on the way out."""
        if len(jobs) == 1 and self._burst(jobs[0]):
            return
        rows = [_Row(job, job.seq.kv, 0, _pending(job.seq), job.start) for job in jobs]
        try:
            while rows:
                logits = self._forward(rows)  # [B, V]
                level: dict[DraftJob, list[tuple[_Row, torch.Tensor]]] = defaultdict(list)
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

    def _burst(self, job: DraftJob) -> bool:
        """A lone greedy chain (its pick the draft's argmax: no grammar, bias or penalty) drafted
        in one C call (``LoopedLM.decode_burst``: the steps ``_forward`` runs one by one, ending
        after the first pick below ``draft_min_prob``, as ``_extend`` ends it); False where the
        draft model has no such call (the chain is then drafted step by step)."""
        seq, model = job.seq, self.engine.draft_model
        if (job.growth is not None or job.grammar is not None or not picks_argmax(seq.request.sampling)
                or not isinstance(model, LoopedLM)):
            return False
        ctx = self.engine.context([seq.kv], [job.start], job.depth)
        spec = RowSpec(loops=job.draft_loops, window=seq.window, start=job.start, noise_seed=seq.noise_seed,
                       kv_loops=seq.loops)
        done = model.decode_burst(_pending(seq), ctx, spec, job.depth, self.engine.vocab_limit, (),
                                  self.engine.draft_min_prob)
        if done is None:
            return False
        job.branches[0].extend(done.tokens)  # (unusable logits end the chain: it is only a draft)
        counters(seq).stopped_unsure += len(done.tokens) < job.depth and not done.unusable
        return True

    def _extend(self, job: DraftJob, fed: list[tuple[_Row, torch.Tensor]]) -> list[_Row]:
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

    def _fork(self, job: DraftJob, parents: list[_Row], added: list[int]) -> list[_Row]:
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

    def _forward(self, rows: list[_Row]) -> torch.Tensor:
        eng = self.engine
        ctx = eng.context([r.kv for r in rows], [r.start for r in rows], 1)
        specs = [RowSpec(loops=r.job.draft_loops, window=r.job.seq.window, start=r.start,
                         noise_seed=r.job.seq.noise_seed, kv_loops=r.job.seq.loops) for r in rows]
        tokens = torch.tensor([[r.token] for r in rows], dtype=torch.long, device=eng.device)  # [B, 1]
        out: ForwardOutput = eng.run_model(tokens, ctx, specs, model=eng.draft_model)  # int8 with draft_weights
        return out.logits[:, -1]  # [B, V]


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
