"""Grammar masks on logits: bitmasks filled on the host by the matchers, applied as tensor ops
wherever the logits are (CPU or GPU).

A mask row is ``ceil(V / 32)`` int32 words, bit ``t % 32`` of word ``t // 32`` for token t
(llguidance's layout). ``MaskBuffer`` keeps one host block for a whole batch (pinned when the
logits are on a GPU, so its copy is asynchronous), the matchers fill their rows of it (in
parallel, without the GIL, through llguidance's executor), one copy takes it to the logits'
device and ``masked_fill_`` sets every refused token's logit to -inf. Only constrained rows are
touched: a free row of the same batch samples exactly as without them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from tinyloop.grammar.matcher import Matcher, fill_batch

__all__ = ["MaskBuffer", "apply_words", "constrain_rows", "cpu_bias", "node_masks", "refused_reference",
           "words_per_row"]

def words_per_row(vocab: int) -> int:
    return (vocab + 31) // 32


class MaskBuffer:
    """A reusable host bitmask ``[rows, words]`` int32, grown when a batch needs more.

    Reuse is safe on a GPU too: the copy of one step's masks is queued before that step's
    sampling, whose results the host waits for before the next step fills the buffer again."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None

    def take(self, rows: int, words: int, pinned: bool) -> torch.Tensor:
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != words or host.is_pinned() != pinned:
            host = torch.zeros((max(rows, 8), words), dtype=torch.int32, device="cpu", pin_memory=pinned)
            self._host = host
        return host[:rows]  # [R, W] contiguous: a prefix of rows


def constrain_rows(logits: torch.Tensor, matchers: Sequence[Matcher | None], buffer: MaskBuffer) -> list[int]:
    """Mask every row of ``logits`` ``[B, V]`` (in place) that has a matcher; the rows whose
    matcher has failed (none should: the caller fails those sequences)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return []
    vocab = logits.shape[-1]
    host = buffer.take(len(rows), words_per_row(vocab), pinned=logits.device.type == "cuda")
    live = [m for m in matchers if m is not None]
    fill_batch(live, host)
    failed = [i for i, m in zip(rows, live) if m.failed]
    words = host.to(logits.device, non_blocking=True)  # [R, W] (the buffer itself on the CPU)
    apply_words(logits, words, None if len(rows) == logits.shape[0] else rows)
    return failed


# each byte value's 8 bits (least significant first) as additive logit bias: 0 allowed, -inf refused
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                      np.float32(0.0), np.float32(-np.inf)).astype(np.float32)  # [256, 8]


def cpu_bias(words: torch.Tensor, vocab: int) -> np.ndarray:
    """``words`` ``[..., W]`` int32 (CPU) as an additive bias ``[..., vocab]`` float32: 0 where a
    token is allowed, -inf where refused (ids past ``32 W`` too). A little-endian int32's bytes
    hold its bits in order, so one table lookup per byte unpacks it."""
    packed = words.contiguous().numpy().view(np.uint8)  # [..., 4 W]
    bias = np.take(_BYTE_BIAS, packed, axis=0).reshape(*packed.shape[:-1], -1)  # [..., 32 W] (take: 8x [] here)
    if bias.shape[-1] >= vocab:
        return bias[..., :vocab]
    pad = np.full((*bias.shape[:-1], vocab - bias.shape[-1]), -np.inf, dtype=np.float32)
    return np.concatenate([bias, pad], axis=-1)


def _on_host(logits: torch.Tensor, words: torch.Tensor) -> bool:
    """Whether ``cpu_bias`` serves: float32 logits and words on the CPU of a little-endian host."""
    return (logits.device.type == "cpu" and words.device.type == "cpu" and logits.dtype == torch.float32
            and sys.byteorder == "little")


def refused_reference(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``words`` ``[..., W]`` int32 unpacked to ``[..., vocab]`` bool, True where a token is refused
    (ids past ``32 W`` too), as tensor ops on the words' device: each word shifted by 0..31."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)  # [32]
    bits = ((words.unsqueeze(-1) >> shifts) & 1).flatten(-2) == 0  # [..., 32 W]
    if bits.shape[-1] >= vocab:
        return bits[..., :vocab]
    pad = torch.ones((*bits.shape[:-1], vocab - bits.shape[-1]), dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=-1)


def apply_words(logits: torch.Tensor, words: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
    """``logits`` ``[..., V]`` (or its ``rows``) with every token the mask ``words`` ``[..., W]``
    refuses at -inf, in place. On the CPU ``cpu_bias`` is added in numpy (adding 0 leaves a logit
    exactly as it was; numpy runs it on this thread, where torch's small ops wake its thread
    pool, ten times slower on a busy machine); elsewhere ``refused_reference`` is filled."""
    vocab = logits.shape[-1]
    if _on_host(logits, words):
        values = logits.detach().numpy()
        if rows is None:
            values += cpu_bias(words, vocab)
        else:
            at = np.asarray(rows, dtype=np.int64)
            values[at] += cpu_bias(words, vocab)
        return logits
    refused = refused_reference(words.to(logits.device), vocab)
    if rows is None:
        return logits.masked_fill_(refused, float("-inf"))
    at_t = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    return logits.index_copy_(0, at_t, logits.index_select(0, at_t).masked_fill_(refused, float("-inf")))


def node_masks(matcher: Matcher, paths: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """The masks ``[N, W]`` after each of ``paths`` (tokens from the matcher's state; a draft
    tree's nodes), the matcher left where it was. A path the grammar refuses gets an empty mask
    (its node can never be reached: its own token was masked out at its parent)."""
    out = torch.zeros((len(paths), words_per_row(vocab)), dtype=torch.int32, device="cpu")
    for row, path in zip(out, paths):
        taken = matcher.accept_all(path)
        if taken == len(path):
            matcher.fill(row)
        matcher.rollback(taken)
    return out
