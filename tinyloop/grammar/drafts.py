"""A constrained sequence's grammar during one speculative step (``engine/speculative.py``).

Drafts are chosen under the grammar's mask, so they are tokens the grammar allows (a refused
draft could only be rejected); the verifier's logits at every node are masked by the grammar's
state after that node's path, so acceptance picks exactly what plain constrained decoding picks
after the same tokens: greedy output is the same, sampled output keeps its distribution.

A chain walks the matcher along its draft (a mask per depth, recorded for the verifier) and
``restore`` walks it back; the emitted tokens then advance it as any token does
(``output.accept_token``). A tree's nodes each need the state after their own path: the matcher
goes down the path, fills the mask and comes back (``masks.node_masks``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinyloop.grammar.masks import apply_words, node_masks, words_per_row
from tinyloop.grammar.matcher import Matcher

__all__ = ["DraftGrammar"]


class DraftGrammar:
    """The grammar of one speculating sequence in one step."""

    __slots__ = ("matcher", "walked", "chain_masks")

    def __init__(self, matcher: Matcher) -> None:
        self.matcher = matcher
        self.walked = 0  # draft tokens the matcher took (a chain's); ``restore`` undoes them
        self.chain_masks: list[torch.Tensor] = []  # [W] per chain node: the state before its next token

    def _row(self, logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        row = logits.detach().to(device="cpu", dtype=torch.float32, copy=True)  # [V]
        return apply_words(row, words)

    def chain_row(self, logits: torch.Tensor) -> torch.Tensor:
        """A chain's draft ``logits`` ``[V]`` masked at the matcher's state (a CPU float32 copy)."""
        words = torch.zeros(words_per_row(logits.shape[-1]), dtype=torch.int32, device="cpu")
        self.matcher.fill(words)
        self.chain_masks.append(words)
        return self._row(logits, words)

    def chain_token(self, token: int) -> bool:
        """Walk the matcher past a drafted ``token``; True when the chain should end here (the
        grammar is complete, or refused it, which its mask rules out)."""
        if not self.matcher.accept(token):
            return True
        self.walked += 1
        return self.matcher.is_terminated()

    def chain_end(self, vocab: int) -> None:
        """The chain is drafted: record the mask after it (for the verifier's bonus token)."""
        words = torch.zeros(words_per_row(vocab), dtype=torch.int32, device="cpu")
        self.matcher.fill(words)
        self.chain_masks.append(words)

    def restore(self) -> None:
        """Walk the matcher back to the sequence's own state."""
        self.matcher.rollback(self.walked)
        self.walked = 0

    def node_row(self, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """A tree node's draft ``logits`` ``[V]`` masked at the state after ``path``."""
        return self._row(logits, node_masks(self.matcher, [path], logits.shape[-1])[0])

    def verify(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Mask the verifier's ``logits`` ``[T, V]`` in place, node i at the state after
        ``paths[i]`` (its tokens below the root); a chain's recorded masks serve when they fit."""
        if self.walked:
            self.restore()
        if len(self.chain_masks) == len(paths):
            words = torch.stack(self.chain_masks)  # [T, W]
        else:
            words = node_masks(self.matcher, paths, logits.shape[-1])  # [T, W]
        apply_words(logits, words)
