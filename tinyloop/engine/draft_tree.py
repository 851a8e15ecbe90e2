"""Growing a speculative draft tree level by level under a width per level.

Pure bookkeeping: no model, no KV. ``speculative.py`` runs the draft forwards and hands each
level's candidates here; ``acceptance.py`` verifies the finished ``DraftTree``.

Every frontier node proposes its ``width`` most likely draft tokens (distinct, likeliest
first). A level keeps at most ``width`` of them: the draft's greedy chain first (the likeliest
child of a node on it, so the tree always holds what a chain draft of the same depth would),
then the rest by path log-probability (the sum of the draft's log-probabilities from the root),
wherever they hang. Siblings therefore appear at any depth where the draft is unsure, and a
tree of depth ``k`` has at most ``width * k`` nodes below its root.

The finished tree is stored in preorder with each node's children likeliest first, so the
greedy chain sits right after the root: when the verifier accepts it, no KV has to move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tinyloop.engine.acceptance import DraftTree

__all__ = ["Candidate", "TreeGrowth"]

Candidate = tuple[int, float]  # a draft token and its log-probability after its parent


@dataclass(eq=False)
class TreeGrowth:
    """A draft tree being grown; node 0 is the root (the pending token)."""

    root: int
    width: int
    tokens: list[int] = field(init=False)
    parents: list[int] = field(init=False)  # -1 for the root
    scores: list[float] = field(init=False)  # path log-probability from the root
    greedy: list[bool] = field(init=False)  # on the draft's greedy chain

    def __post_init__(self) -> None:
        self.tokens, self.parents, self.scores, self.greedy = [self.root], [-1], [0.0], [True]

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, node: int) -> list[int]:
        """The tokens from depth 1 down to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def grow(self, frontier: Sequence[int], candidates: Sequence[Sequence[Candidate]]) -> list[int]:
        """Add the next level: ``candidates[i]`` are the children proposed by ``frontier[i]``
        (distinct tokens, likeliest first). Returns the new nodes, by parent in frontier order,
        each parent's likeliest first."""
        ranked = []  # (sort key, frontier index, rank, token, score)
        for i, (parent, proposed) in enumerate(zip(frontier, candidates)):
            for rank, (token, logprob) in enumerate(proposed[: self.width]):
                on_chain = self.greedy[parent] and rank == 0
                score = self.scores[parent] + logprob
                ranked.append(((not on_chain, -score, i, rank), i, rank, token, score, on_chain))
        ranked.sort(key=lambda c: c[0])
        kept = sorted(ranked[: self.width], key=lambda c: (c[1], c[2]))
        added = []
        for _, i, _, token, score, on_chain in kept:
            self.tokens.append(token)
            self.parents.append(frontier[i])
            self.scores.append(score)
            self.greedy.append(on_chain)
            added.append(len(self.tokens) - 1)
        return added

    def tree(self) -> DraftTree:
        """The tree in preorder, children in the order they were added (likeliest first)."""
        children: list[list[int]] = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                children[parent].append(node)
        order: list[int] = []
        stack = [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children[node]))
        index = {node: i for i, node in enumerate(order)}
        depths = [0] * len(order)
        parents = [-1] * len(order)
        for i, node in enumerate(order[1:], start=1):
            parents[i] = index[self.parents[node]]
            depths[i] = depths[parents[i]] + 1
        return DraftTree(tuple(self.tokens[n] for n in order), tuple(parents), tuple(depths))
