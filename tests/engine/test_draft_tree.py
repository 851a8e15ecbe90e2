"""Draft trees with siblings at any depth: how they grow, and that verifying them is exact.

No model: the verifier's conditional distributions are made up per prefix, so the exact
distribution of what plain sampling would emit is known in closed form.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import product

import torch

from tinyloop.engine.acceptance import DraftTree, accept_greedy, accept_tree_sampled
from tinyloop.engine.draft_tree import TreeGrowth
from tinyloop.engine.sampling import draw, greedy_token, make_generator, target_probs
from tinyloop.requests import SamplingParams

V = 3
PROMPT = [2, 0]
OUTPUT = [1]  # the root (pending token) is the last output token
CHI2_DF26_P001 = 54.05  # the 0.999 quantile of chi-square with 26 degrees of freedom


def logits_after(path: tuple[int, ...]) -> torch.Tensor:
    """The verifier's logits [V] after the root and ``path``: fixed, different per prefix."""
    gen = torch.Generator().manual_seed(hash(path) % 2**31)
    return torch.randn(V, generator=gen)


def tree_of(paths: list[tuple[int, ...]]) -> DraftTree:
    """A tree from its nodes' paths (each parent's path listed before the node's)."""
    index = {(): 0}
    tokens, parents, depths = [OUTPUT[-1]], [-1], [0]
    for path in paths:
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
        depths.append(len(path))
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths))


# siblings at depth 1, 2 and 3; node (0, 1) lists every token as a child
TREE_PATHS = [(0,), (0, 1), (0, 1, 2), (0, 1, 0), (0, 1, 1), (0, 2), (0, 2, 1), (1,), (1, 0), (1, 0, 2), (1, 0, 0)]


def test_growth_keeps_the_greedy_chain_then_the_likeliest_paths() -> None:
    growth = TreeGrowth(root=9, width=2)
    lp = math.log
    assert growth.grow([0], [[(5, lp(0.6)), (6, lp(0.3))]]) == [1, 2]
    # node 1 (p .6) proposes .5/.5, node 2 (p .3) proposes .9: the chain's child, then .6 * .5
    assert growth.grow([1, 2], [[(7, lp(0.5)), (8, lp(0.5))], [(3, lp(0.9)), (4, lp(0.1))]]) == [3, 4]
    assert growth.tokens[3:] == [7, 8] and growth.parents[3:] == [1, 1]
    # the greedy chain is kept even when a path off it is likelier
    assert growth.grow([3, 4], [[(1, lp(0.1)), (2, lp(0.05))], [(1, lp(0.9)), (2, lp(0.05))]]) == [5, 6]
    assert growth.parents[5:] == [3, 4] and growth.path(6) == [5, 8, 1]
    tree = growth.tree()  # preorder, likeliest child first: the chain right after the root
    assert tree.tokens == (9, 5, 7, 1, 8, 1, 6)
    assert tree.parents == (-1, 0, 1, 2, 1, 4, 0) and tree.depths == (0, 1, 2, 3, 2, 3, 1)
    assert tree.children(1) == [2, 4]  # siblings at depth 2


def test_greedy_acceptance_follows_siblings_below_the_first_level() -> None:
    tree = tree_of(TREE_PATHS)
    params = SamplingParams(temperature=0)
    logits = torch.stack([logits_after(p) for p in [(), *TREE_PATHS]])  # [T, V]
    verdict = accept_greedy(tree, logits, params, PROMPT, OUTPUT)
    want: list[int] = []
    while len(want) < len(verdict.tokens):
        want.append(greedy_token(logits_after(tuple(want)), params, PROMPT, [*OUTPUT, *want]))
    assert verdict.tokens == want


def test_sampled_tree_acceptance_is_exact_with_siblings_at_every_depth() -> None:
    """The first three tokens emitted (verified from the tree, then sampled plainly when the
    tree emitted fewer) have plain sampling's joint distribution."""
    tree = tree_of(TREE_PATHS)
    assert [tree.depths[c] for c in range(len(tree)) if len(tree.children(c)) > 1] == [0, 1, 2, 2]
    params = SamplingParams(temperature=1.2, presence_penalty=0.5, repetition_penalty=1.1)
    logits = torch.stack([logits_after(p) for p in [(), *TREE_PATHS]])  # [T, V]

    def probs(path: tuple[int, ...]) -> torch.Tensor:
        return target_probs(logits_after(path), params, PROMPT, [*OUTPUT, *path])

    exact = {s: probs(())[s[0]].item() * probs(s[:1])[s[1]].item() * probs(s[:2])[s[2]].item()
             for s in product(range(V), repeat=3)}
    gen = make_generator(0)
    n = 6000
    counts: Counter[tuple[int, ...]] = Counter()
    lengths: Counter[int] = Counter()
    for _ in range(n):
        tokens = accept_tree_sampled(tree, logits, params, PROMPT, OUTPUT, gen).tokens[:3]
        lengths[len(tokens)] += 1
        while len(tokens) < 3:
            tokens.append(draw(probs(tuple(tokens)), gen))
        counts[tuple(tokens)] += 1
    assert lengths[3] > 0.1 * n and lengths[1] + lengths[2] > 0.1 * n  # deep and shallow verdicts
    assert min(exact.values()) * n > 5  # every cell expects enough samples for the test
    chi2 = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert chi2 < CHI2_DF26_P001, (chi2, counts, exact)
