"""Which drafted tokens the verifier keeps: draft trees and the acceptance rules.

Pure functions of the verifier's logits, the request's sampling params, its history and its
generator (and the EOS ids ``min_tokens`` keeps out); no model, no KV. Every rule chooses from
the logits as plain sampling does (``sampling.adjust_logits``: ``logit_bias``, ``min_tokens``,
penalties), after the path accepted so far. ``speculative.py`` drives the model around them.

A draft is a tree (``DraftTree``) rooted at the pending token (the last sampled token, not yet
in the KV cache). A chain is a tree with one branch. The verifier scores every node in one
forward; node ``i``'s logits are its distribution for the token after node ``i``.

Rules, each giving the distribution of plain decoding at the verifier's loops:

- greedy (``accept_greedy``): walk down from the root while a child holds the verifier's argmax
  (with penalties, after the tokens accepted so far); emit the path and the argmax at its end.
  Every emitted token is the argmax plain greedy decoding would pick after the same tokens.
- chain, sampled (``accept_chain_sampled``): standard speculative sampling. Draft ``x ~ q``;
  accept it with probability ``min(1, p(x) / q(x))``; at the first rejection emit a sample of
  ``norm(max(0, p - q))``; when every draft is accepted emit a bonus sample of ``p``. Each
  emitted token then has distribution ``p`` given the tokens before it.
- tree, sampled (``accept_tree_sampled``): recursive rejection with point-mass proposals. The
  children of a node are deterministic candidates ``c_1 .. c_K`` (distinct tokens). With the
  residual ``r_0 = p``: accept ``c_i`` with probability ``r_{i-1}(c_i)``; on rejection
  ``r_i = norm(r_{i-1} with c_i zeroed)``; if all are rejected emit a sample of ``r_K``. Then
  ``P(emit c_i) = prod_{j<i} (1 - r_{j-1}(c_j)) * r_{i-1}(c_i) = p(c_i)`` and ``P(emit x) =
  p(x)`` for every other x (by induction on i), so the emitted token has distribution ``p``;
  an accepted candidate continues at its node, whose logits are the verifier's conditional
  after it, so the whole output has plain sampling's distribution. (Proposals drawn from ``q``
  would need SpecInfer's form; a point mass is the special case ``q = delta_c``, where
  ``min(1, p/q)`` is ``p(c)`` and ``norm(max(0, p - q))`` is ``p`` without ``c``.) The argument
  holds at every node, whatever the tree's shape: siblings may hang at any depth, as long as a
  node's children are distinct tokens and the tree is fixed before the verifier's draws (the
  draft's choices use no randomness).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from tinyloop.engine.sampling import draw, greedy_token, target_probs
from tinyloop.requests import SamplingParams

__all__ = ["DraftTree", "Verdict", "accept_greedy", "accept_chain_sampled", "accept_tree_sampled"]


@dataclass(frozen=True, slots=True)
class DraftTree:
    """Nodes in storage order: node 0 is the root, every parent before its children (branch
    after branch for ``from_branches``, preorder for a tree grown by ``draft_tree.py``).

    Storage order is also the KV layout of the verify forward: node ``i`` is written at position
    ``start + i``, its RoPE position is ``start + depth``.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # -1 for the root
    depths: tuple[int, ...]

    @classmethod
    def from_branches(cls, root: int, branches: Sequence[Sequence[int]]) -> DraftTree:
        """The root with each branch hanging from it (a chain is one branch)."""
        tokens, parents, depths = [root], [-1], [0]
        for branch in branches:
            parent = 0
            for depth, token in enumerate(branch, start=1):
                tokens.append(token)
                parents.append(parent)
                depths.append(depth)
                parent = len(tokens) - 1
        return cls(tuple(tokens), tuple(parents), tuple(depths))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def mask(self) -> torch.Tensor:
        """``[T, T]`` bool: node i may attend to node j when j is i or one of its ancestors."""
        n = len(self.tokens)
        out = torch.zeros((n, n), dtype=torch.bool, device="cpu")  # built on the host
        for i in range(n):
            j = i
            while j >= 0:
                out[i, j] = True
                j = self.parents[j]
        return out

    def positions(self, start: int) -> list[int]:
        return [start + d for d in self.depths]

    def paths(self) -> list[list[int]]:
        """Each node's tokens below the root, by depth (the root's: empty)."""
        out: list[list[int]] = []
        for i, parent in enumerate(self.parents):
            out.append([] if parent < 0 else [*out[parent], self.tokens[i]])
        return out


@dataclass(frozen=True, slots=True)
class Verdict:
    """The accepted path (node ids below the root, by depth) and the tokens to emit: the path's
    tokens, then the verifier's own token after the path's last node."""

    path: list[int]
    tokens: list[int]
    nodes: list[int]  # the node whose logits produced each emitted token


def _verdict(tree: DraftTree, path: list[int], last: int) -> Verdict:
    return Verdict(path, [tree.tokens[i] for i in path] + [last], [0, *path])


def accept_greedy(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                  prompt: Sequence[int], output: Sequence[int], eos_ids: Collection[int] = ()) -> Verdict:
    """Greedy verification of ``tree`` against the verifier's ``logits`` ``[T, V]``."""
    path: list[int] = []
    node = 0
    while True:
        history = [*output, *(tree.tokens[i] for i in path)]
        best = greedy_token(logits[node], params, prompt, history, eos_ids)
        child = next((c for c in tree.children(node) if tree.tokens[c] == best), None)
        if child is None:
            return _verdict(tree, path, best)
        path.append(child)
        node = child


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device="cpu"))


def accept_chain_sampled(tree: DraftTree, logits: torch.Tensor, draft_probs: Sequence[torch.Tensor],
                         params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                         generator: torch.Generator, eos_ids: Collection[int] = ()) -> Verdict:
    """Speculative sampling of a chain whose node ``j + 1`` was drawn from ``draft_probs[j]``."""
    path: list[int] = []
    node = 0
    for q in draft_probs:
        p = target_probs(logits[node], params, prompt, [*output, *(tree.tokens[i] for i in path)], eos_ids)
        child = node + 1
        x = tree.tokens[child]
        if _uniform(generator) * float(q[x]) < float(p[x]):  # u < p(x)/q(x), q(x) > 0: x ~ q
            path.append(child)
            node = child
            continue
        residual = (p - q).clamp_min(0)  # [V]
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
            residual = p
        return _verdict(tree, path, draw(residual, generator))
    p = target_probs(logits[node], params, prompt, [*output, *(tree.tokens[i] for i in path)], eos_ids)
    return _verdict(tree, path, draw(p, generator))


def accept_tree_sampled(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                        prompt: Sequence[int], output: Sequence[int],
                        generator: torch.Generator, eos_ids: Collection[int] = ()) -> Verdict:
    """Recursive rejection over deterministic candidates (the module docstring's proof)."""
    path: list[int] = []
    node = 0
    while True:
        residual = target_probs(logits[node], params, prompt,
                                [*output, *(tree.tokens[i] for i in path)], eos_ids).clone()  # [V]
        accepted = None
        for child in tree.children(node):
            x = tree.tokens[child]
            mass = float(residual.sum())
            r_x = float(residual[x]) / mass
            # A residual with nothing left besides x means x had probability ~1: accept it.
            if r_x > 0 and (_uniform(generator) < r_x or mass - float(residual[x]) <= 0):
                accepted = child
                break
            residual[x] = 0
        if accepted is None:
            return _verdict(tree, path, draw(residual, generator))
        path.append(accepted)
        node = accepted
