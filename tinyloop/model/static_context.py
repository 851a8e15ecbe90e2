"""``StaticContext``: a decode step's attention context at fixed shapes, for CUDA graphs.

``PagedContext`` sizes its index tensors by the step (the longest row's keys) and builds them on
the host; a captured graph replays the same kernels on the same memory, so its context keeps its
inputs in buffers of fixed shape that the host rewrites before each replay:

- ``tables`` ``[R, S, MB]``: each row's block ids per slot, padded with the pool's null block;
- ``write`` ``[S, R]``: the pool row where each row's new token goes in each slot;
- ``positions`` ``[R]``: that token's position (RoPE); ``n_keys`` ``[R]``: the keys it sees.

Everything derived from them is computed on the device inside the step (``begin``): RoPE's
tables at the positions, and on CUDA the key counts in int32 once for every layer. Attention
reads each row's keys through its table (``Backend.paged_attention``), up to ``MB * block_size``
keys. Rows past the batch (the graph's bucket is larger) point at the null block with one key.
One new token a row, no gaps, K and V stored (not h-mode). The slots are the graph's: a row's
table for a slot is whichever of its own slots stands there (``DecodeGraphs.slot_map``), so rows
of different loop counts and windows share one context.
"""

from __future__ import annotations

import torch

from tinyloop.model.backend import Backend
from tinyloop.model.kvcache import KVPool
from tinyloop.model.layers import Attention, Rope

__all__ = ["StaticContext"]


class StaticContext:
    """Buffers for ``rows`` decode rows over ``n_slots`` slots of at most ``max_blocks`` blocks
    each; ``inputs`` (``[3 * rows + n_slots * rows]`` int64 on the pool's device) holds tokens,
    positions, key counts and write rows back to back, so the host fills them with one copy."""

    def __init__(self, pool: KVPool, rope: Rope, rows: int, n_slots: int, max_blocks: int, backend: Backend) -> None:
        self.pool, self.backend, self._rope = pool, backend, rope
        self.rows, self.n_slots, self.max_blocks = rows, n_slots, max_blocks
        self.max_keys = max_blocks * pool.block_size
        dev = pool.device
        self.inputs = torch.zeros(self.input_size(rows, n_slots), dtype=torch.long, device=dev)
        self.tokens, self.positions, self.n_keys, self.write = split_inputs(self.inputs, rows, n_slots)
        self.tables = torch.full((rows, n_slots, max_blocks), pool.null_block, dtype=torch.long, device=dev)
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._keys = self.n_keys

    @staticmethod
    def input_size(rows: int, n_slots: int) -> int:
        return 3 * rows + n_slots * rows

    def begin(self) -> None:
        """The step's first ops: RoPE tables at this step's positions, the key counts as the
        kernels read them."""
        cos, sin = self._rope.tables(self.positions)  # [R, D]
        self._cos_sin = cos[:, None, None], sin[:, None, None]  # [R, 1, 1, D]: broadcast over heads
        self._keys = self.n_keys.to(torch.int32) if self.n_keys.is_cuda else self.n_keys

    def rope(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if rows is not None or self._cos_sin is None:
            raise ValueError("a static context serves every row at once, after begin()")
        return self._cos_sin

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None, slots: torch.Tensor | int,
               h: torch.Tensor | None = None, layer: Attention | None = None) -> torch.Tensor:
        if rows is not None or not isinstance(slots, int) or q.shape[2] != 1:
            raise ValueError("a static context serves one token a row, every row at one slot")
        store = self.pool.store
        self.backend.kv_write(store, self.write[slots], k=k.squeeze(2), v=v.squeeze(2))
        return self.backend.paged_attention(store, q, self.tables[:, slots], self._keys, self.max_keys)

    def copy_new(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        raise ValueError("a static context has no early exits to fill in")


def split_inputs(flat: torch.Tensor, rows: int, n_slots: int) -> tuple[torch.Tensor, ...]:
    """Views of a flat ``StaticContext.inputs``-shaped tensor: tokens ``[R, 1]``, positions
    ``[R]``, key counts ``[R]``, write rows ``[S, R]``."""
    return flat[:rows].view(rows, 1), flat[rows:2 * rows], flat[2 * rows:3 * rows], flat[3 * rows:].view(n_slots, rows)
