"""Self-speculative decoding: draft with the same weights at fewer loops, verify in one forward.

One ``Speculator.run`` serves every speculative sequence of an engine step, batched:

1. Plan. A sequence with ``L`` tokens in its KV and a pending token drafts ``k = min(draft_ahead,
   tokens left - 1)`` tokens per branch, so an accepted run never passes ``max_tokens``. With
   ``k = 0`` (or no KV blocks to speculate with) it falls back to a plain decode step. A step
   drafts at most ``Engine.max_draft_nodes`` tokens over all its sequences, shared evenly: a
   sequence's branches and depth shrink to its share (the output does not change, only speed).
2. Draft (``drafting.py``). One-token forwards at ``draft_loops``, every draft row of every
   sequence in one batched call per depth. Draft rows run inside the verifier's KV layout (``RowSpec.kv_loops``): they
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
   1.04x plain decoding to 94% and 1.3x (``bench/LOG.md``). The stop depends on the draft
   only, so greedy output stays that of plain decoding and sampled output keeps its exact
   distribution (a draft length chosen from the drafted prefix leaves each position's
   accept-or-resample law as it is). The root drafts in
   the sequence's KV; each node of the next level drafts in a KV holding its ancestors' draft
   KV: its parent's fork, taken over by the parent's first child and forked (copy-on-write, only
   the partly filled block is copied) for the others and for the root's children. Forks are
   freed when their node has no children, and after drafting. On the CPU a lone greedy chain
   (its pick the draft's argmax) drafts in one C call instead (``LoopedLM.decode_burst``, ending
   after the first pick below ``draft_min_prob``): the same drafts, with no Python between them.
3. Verify. One forward at the sequence's loops over the root and every node (up to
   ``1 + K * k`` tokens; ``k + 1`` for a chain), node ``i`` written at position ``L + i`` with
   RoPE position and noise position ``L + depth``, attending to its ancestors only (``extra_mask``).
   Sequences with the same node count share one batched call. On the CPU a chain's tokens
   are verified as one-token rows of their sequence instead (``_verify_rows``), the plain
   decode step's call: the whole step in C (``cpu.step.FusedStep``), each weight read once for
   all the rows, where a chunk runs the blocks' modules op by op.
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

from collections import defaultdict
from collections.abc import Sequence as Seq

import torch

from tinyloop.engine.acceptance import DraftTree, Verdict, accept_chain_sampled, accept_greedy, accept_tree_sampled
from tinyloop.engine.drafting import Drafter, DraftJob
from tinyloop.engine.modes import Core
from tinyloop.engine.output import Emission as Emission
from tinyloop.engine.sampling import token_logprob
from tinyloop.engine.sequence import Sequence
from tinyloop.engine.speculation_state import CHAIN_GROWTH as CHAIN_GROWTH
from tinyloop.engine.speculation_state import SpeculationState as SpeculationState
from tinyloop.engine.speculation_state import counters as counters
from tinyloop.errors import KVCacheExhausted
from tinyloop.model.kvcache import SeqKV
from tinyloop.model.looped import LoopedLM, RowSpec

__all__ = ["CHAIN_GROWTH", "Emission", "SpeculationState", "Speculator", "counters"]


class Speculator:
    """Runs the speculative steps of one engine (same model, pool and thread)."""

    def __init__(self, core: Core) -> None:
        self.engine = core
        self.drafter = Drafter(core)

    def run(self, seqs: Seq[Sequence]) -> tuple[list[tuple[Sequence, list[Emission]]], list[Sequence]]:
        """Speculate for ``seqs``: (each sequence's tokens to append, in order; the sequences that
        need a plain decode step instead)."""
        jobs, plain = self._plan(seqs)
        if not jobs:
            return [], plain
        self.drafter.draft(jobs)
        verifying = []
        for job in jobs:
            job.tree = job.draft_tree()
            try:
                job.seq.kv.reserve(job.start + len(job.tree))
            except KVCacheExhausted:
                plain.append(job.seq)  # drafted for nothing; the root's block is still reserved
            else:
                verifying.append(job)
        by_size: dict[int, list[DraftJob]] = defaultdict(list)
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
    def _plan(self, seqs: Seq[Sequence]) -> tuple[list[DraftJob], list[Sequence]]:
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
            jobs.append(DraftJob(seq, start, depth, width, draft_loops, [[]] if width == 1 else []))
            left -= depth * width
        return jobs, plain

    # -- verify and commit ---------------------------------------------------------------------
    def _verify(self, jobs: list[DraftJob]) -> torch.Tensor:
        trees = [job.tree for job in jobs if job.tree is not None]
        if all(job.width == 1 for job in jobs):  # chains: causal at consecutive positions, the default
            if self.engine.device.type == "cpu" and isinstance(self.engine.model, LoopedLM):
                return self._verify_rows(jobs, trees)
            return self.engine.verify([j.seq for j in jobs], [list(t.tokens) for t in trees])  # [B, T, V]
        mask = torch.stack([t.mask() for t in trees])  # [B, T, T]
        return self.engine.verify([j.seq for j in jobs], [list(t.tokens) for t in trees], mask=mask,
                                  positions=[t.positions(j.start) for t, j in zip(trees, jobs)])  # [B, T, V]

    def _verify_rows(self, jobs: list[DraftJob], trees: list[DraftTree]) -> torch.Tensor:
        """Chains of T tokens on the CPU, as ``Engine.verify`` scores them, with each token a
        one-token row of its sequence (a ``LoopedLM``'s forward; Inkling-2's does not score a
        chunk so, and its chains verify as a chunk): row i at position ``start + i``, reading the
        keys up to its own (those its chain's earlier rows write in the same call included, as
        every row's K and V are written before any row attends). That is the plain decode step's
        call, so it runs as one C call (``cpu.step.FusedStep``) reading each weight once for all
        the rows, where a T-token chunk runs the blocks' modules op by op (bench/LOG.md); logits
        ``[B, T, V]``. (Under ``SpeculativeDecoding.plan``'s inference mode.)"""
        eng = self.engine
        kvs, starts, tokens, specs = [], [], [], []
        for job, tree in zip(jobs, trees):
            seq = job.seq
            for i, token in enumerate(tree.tokens):
                kvs.append(seq.kv)
                starts.append(job.start + i)
                tokens.append([token])
                specs.append(RowSpec(loops=seq.loops, window=seq.window, start=job.start + i,
                                     noise_seed=seq.noise_seed, exit=seq.exit))
        out = eng.run_model(torch.tensor(tokens, dtype=torch.long, device=eng.device), eng.context(kvs, starts, 1),
                            specs)
        return out.logits[:, -1].float().reshape(len(jobs), len(trees[0]), -1)  # (a group: one size)

    def _commit(self, job: DraftJob, logits: torch.Tensor) -> list[Emission]:
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
    def _accept(job: DraftJob, tree: DraftTree, logits: torch.Tensor, eos_ids: frozenset[int]) -> Verdict:
        seq = job.seq
        params = seq.request.sampling
        if params.greedy:
            return accept_greedy(tree, logits, params, seq.prompt, seq.output, eos_ids)
        if job.width == 1:
            return accept_chain_sampled(tree, logits, job.draft_probs, params, seq.prompt,
                                        seq.output, seq.generator, eos_ids)
        return accept_tree_sampled(tree, logits, params, seq.prompt, seq.output, seq.generator, eos_ids)


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
