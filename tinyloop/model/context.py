"""Attention contexts: where one forward's rows keep and read their K and V.

``PagedContext`` is the serving path: K and V live in the paged pool (``kvcache.KVPool``), each
row writes its new positions into the slot it is told and attends over everything its slot
holds. The pool's mode decides what is written: K and V (plain or 4-bit, dequantized after the
gather), or in h-mode the attention input h, from which the calling layer recomputes the keys'
K and V (``Attention.kv_from_h``) and RoPE is applied at each key's position. ``FullContext``
keeps nothing: plain causal attention over the tokens of this call, the no-cache reference that
incremental decoding is tested against. Both run their kernels on a ``Backend`` (``backend.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tinyloop.model.backend import TORCH, Backend
from tinyloop.model.kvcache import KVPool, SeqKV
from tinyloop.model.layers import Attention, Rope

__all__ = ["PagedContext", "FullContext"]


# The most new tokens a row whose attention goes through ``Backend.decode_attention`` (read in
# place); longer calls (prefill chunks) go through ``attention`` on gathered K and V, where SDPA's
# blocked kernels pay.
_IN_PLACE_TOKENS = 16


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def _key_rows(seqs: Sequence[SeqKV], n_slots: int, key_len: int, block_size: int, null_block: int) -> np.ndarray:
    """Every row's pool rows of its first ``key_len`` positions at every slot, ``[B, S, L]`` int64
    on the host: slices of each sequence's cached ``pool_rows``; positions past a sequence's
    blocks, and slots past its own, read the pool's null block (attention masks them)."""
    if len(seqs) == 1 and seqs[0].n_slots == n_slots and seqs[0].capacity() >= key_len:
        return seqs[0].pool_rows()[None, :, :key_len].copy()  # (the cache is read-only)
    pad = null_block * block_size + np.arange(key_len, dtype=np.int64) % block_size
    out = np.empty((len(seqs), n_slots, key_len), dtype=np.int64)
    out[:] = pad
    for b, s in enumerate(seqs):
        rows = s.pool_rows()
        n = min(rows.shape[1], key_len)
        out[b, :s.n_slots, :n] = rows[:, :n]
    return out


def block_tables(seqs: Sequence[SeqKV], max_blocks: int, n_slots: int, pad: int) -> torch.Tensor:
    """Every row's block ids as ``[B, n_slots, max_blocks]`` int64 on the host, padded with block
    ``pad`` (the pool's null block: attention masks the padding, and reads zeros there, never
    another sequence's K and V): one tensor built from lists, not one per row."""
    pad_slot = [pad] * max_blocks
    rows = [[table + [pad] * (max_blocks - len(table)) for table in s.tables] + [pad_slot] * (n_slots - s.n_slots)
            for s in seqs]
    return torch.tensor(rows, dtype=torch.long, device="cpu")


class PagedContext:
    """B rows of T new tokens each; row b's new tokens sit at positions ``start_b .. start_b+T-1``.

    The caller reserves the blocks first (``SeqKV.reserve``) and advances ``SeqKV.length`` after.
    ``extra_mask`` (``[B, T, T]``, True = may attend) restricts attention among the new tokens,
    for tree verification; by default they are causal. A key whose token exited early and left a
    core slot unwritten (``SeqKV.gaps``) is masked out at that slot.
    """

    def __init__(self, pool: KVPool, rope: Rope, seqs: Sequence[SeqKV], starts: Sequence[int],
                 n_new: int, extra_mask: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, backend: Backend = TORCH) -> None:
        self.pool = pool
        self.backend = backend
        self._rope = rope
        self._seqs = seqs
        n_slots = max(s.n_slots for s in seqs)
        # The index math runs on the host in numpy (a decode step's is a slice of each sequence's
        # cached pool rows, ``SeqKV.pool_rows``: no torch op), then moves once.
        dev = pool.device
        start = np.asarray(starts, dtype=np.int64)  # [B]
        slots_pos = start[:, None] + np.arange(n_new, dtype=np.int64)  # [B, T] where each new token is stored
        key_len = int(start.max()) + n_new
        key_rows = _key_rows(seqs, n_slots, key_len, pool.block_size, pool.null_block)  # [B, S, L]
        b = len(seqs)
        write_rows = key_rows[np.arange(b)[:, None, None], np.arange(n_slots)[:, None], slots_pos[:, None, :]]
        self._write_rows = torch.from_numpy(write_rows).to(dev, non_blocking=True)  # [B, S, T]
        self._key_rows = torch.from_numpy(key_rows).to(dev, non_blocking=True)  # [B, S, L]
        # The same per slot, ready for a layer whose rows all share one (an int slot): no index op.
        self._write_by_slot = torch.from_numpy(np.ascontiguousarray(
            write_rows.transpose(1, 0, 2).reshape(n_slots, b * n_new))).to(dev, non_blocking=True)  # [S, B*T]
        self._keys_by_slot = torch.from_numpy(np.ascontiguousarray(
            key_rows.transpose(1, 0, 2))).to(dev, non_blocking=True)  # [S, B, L]
        self._key_len = key_len
        self._starts = list(starts)
        self._positions = positions
        self._key_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tables: torch.Tensor | None = None
        # the mask is made when first asked for (``mask``): a decode step on the kernels reads
        # each row's key count instead, and never needs it
        self._mask_of = (slots_pos, extra_mask)
        self._mask_tensor: torch.Tensor | None = None
        self._additive_mask: torch.Tensor | None = None
        # One new token that may see every key (decode at equal lengths: every row's start is the
        # last key), or every row's first tokens (no key before them, no tree): causal attention
        # over T == L needs no mask.
        if n_new == 1:
            self._unmasked = bool(self.mask.all()) if extra_mask is not None else all(x == key_len - 1 for x in starts)
        else:
            self._unmasked = extra_mask is None and key_len == n_new and not any(starts)
        # A few new tokens (decode, a speculative verify): row b's token t attends to its first
        # start_b + t + 1 keys, what Backend.decode_attention reads in place; a tree's node only to
        # the new tokens of its ancestors (``_tree``, which self.mask says too).
        few = n_new <= _IN_PLACE_TOKENS
        self._n_keys = torch.from_numpy(start + 1).to(dev) if few else None  # [B]
        self._tree = extra_mask.to(dev, non_blocking=True) if few and extra_mask is not None else None  # [B, T, T]
        rope_pos = (torch.from_numpy(slots_pos) if positions is None else positions).to(dev)  # tree tokens share depths
        self.cos, self.sin = rope.tables(rope_pos)  # [B, T, D]
        self._cos_sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)  # [B, 1, T, D]: broadcast over heads
        self._gaps = self._gap_depths(seqs, key_len)
        # one new token a row that may see its first n_keys keys (no tree, no loop gaps), K and V
        # stored, on the host: what a fused decode block takes (``decode_rows``, ``decode_slots``)
        self._plain_decode = not (self._n_keys is None or self._gaps is not None or self._tree is not None
                                  or n_new != 1 or pool.store.mode.h_mode or torch.device(dev).type != "cpu")

    @property
    def tables(self) -> torch.Tensor:
        """Every row's block ids ``[B, S, MB]`` (int64 on the pool's device, padded with the null
        block), made when first asked for."""
        if self._tables is None:
            seqs = self._seqs
            tables = block_tables(seqs, max(s.blocks_per_slot for s in seqs), max(s.n_slots for s in seqs),
                                  self.pool.null_block)
            self._tables = tables.to(self.pool.device, non_blocking=True)
        return self._tables

    @property
    def _key_pos(self) -> torch.Tensor:
        return torch.arange(self._key_len, dtype=torch.long, device=self.pool.device)  # [L]

    @property
    def mask(self) -> torch.Tensor:
        """``[B, 1, T, L]``, True where a new token may attend a key: causal by position, and
        among the new tokens as ``extra_mask`` says."""
        if self._mask_tensor is None:
            slots_pos, extra_mask = self._mask_of
            key_pos = torch.arange(self._key_len, dtype=torch.long, device="cpu")
            mask = key_pos[None, None, :] <= torch.from_numpy(slots_pos)[:, :, None]  # [B, T, L]
            if extra_mask is not None:
                n_new = slots_pos.shape[1]
                for b, s in enumerate(self._starts):
                    window = mask[b, :, s:s + n_new]
                    mask[b, :, s:s + n_new] = window & extra_mask[b].to("cpu")
            self._mask_tensor = mask[:, None].to(self.pool.device, non_blocking=True)
        return self._mask_tensor

    def _gap_depths(self, seqs: Sequence[SeqKV], key_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per row and key, the loop slots the key wrote ``[B, L]`` (a large number where all),
        and per row the slot index where the coda starts ``[B]``; None when no key has a gap."""
        if not any(s.gaps for s in seqs):
            return None
        written = torch.full((len(seqs), key_len), 1 << 30, dtype=torch.long, device="cpu")
        for b, s in enumerate(seqs):
            for pos, done in s.gaps.items():
                if pos < key_len:
                    written[b, pos] = done
        config = self.pool.config
        coda_start = torch.tensor([s.n_slots - config.n_coda for s in seqs], dtype=torch.long, device="cpu")
        return written.to(self.pool.device, non_blocking=True), coda_start.to(self.pool.device, non_blocking=True)

    def _mask(self, rows: torch.Tensor | None, slots: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor | None:
        """The attention mask ``[R, 1, T, L]`` of ``rows`` at ``slots`` (one per row, or one for
        all); None when every new token may see every key (or causal over T == L). Without gaps
        it is the same at every layer: additive in ``dtype``, made once (SDPA would convert a
        boolean one at every call); with gaps, boolean (True = may attend)."""
        if self._gaps is None:
            return None if self._unmasked else _take(self._additive(dtype), rows)
        mask = _take(self.mask, rows)
        written, coda_start = (_take(t, rows) for t in self._gaps)
        if isinstance(slots, int):
            slots = torch.full(coda_start.shape, slots, dtype=torch.long, device=coda_start.device)
        config = self.pool.config
        core = (slots >= config.n_prelude) & (slots < coda_start)
        depth = torch.where(core, (slots - config.n_prelude) // config.n_core, -1)  # [R] the loop slot
        return mask & (written > depth[:, None])[:, None, None, :]

    def _additive(self, dtype: torch.dtype) -> torch.Tensor:
        """``self.mask`` as SDPA adds it (0 where a key may be seen, -inf elsewhere), in
        ``dtype``: SDPA would convert the boolean mask at every layer's call."""
        if self._additive_mask is None or self._additive_mask.dtype != dtype:
            self._additive_mask = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._additive_mask

    def rope(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin
        return _take(cos, rows), _take(sin, rows)

    def _flat_index(self, rows: torch.Tensor | None, slots: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool rows where ``rows`` (at ``slots``: one per row, or one for all) write their new
        tokens ``[R*T]`` and read their keys ``[R, L]``."""
        if rows is None and isinstance(slots, int):
            return self._write_by_slot[slots], self._keys_by_slot[slots]  # [B*T], [B, L]
        at = torch.arange(self.cos.shape[0], dtype=torch.long, device=self.cos.device) if rows is None else rows
        return self._write_rows[at, slots].flatten(), self._key_rows[at, slots]

    def decode_rows(self, rows: torch.Tensor | None, slots: torch.Tensor | int) -> tuple[torch.Tensor, ...] | None:
        """For a plain decode step (``_plain_decode``): where ``rows`` at ``slots`` write their
        new K and V ``[R]``, the keys they read ``[R, L]``, how many of them each attends
        ``[R]``, and cos and sin at their positions ``[R or 1, 1, D]``, all contiguous on the
        host (what a fused decode block, ``cpu.block``, takes); None for any other step."""
        if not self._plain_decode:
            return None
        assert self._n_keys is not None
        write, keys = self._flat_index(rows, slots)
        cos, sin = _take(self.cos, rows), _take(self.sin, rows)
        return (write.contiguous(), keys.contiguous(), _take(self._n_keys, rows).contiguous(), cos.contiguous(),
                sin.contiguous())

    def decode_slots(self) -> tuple[torch.Tensor, ...] | None:
        """``decode_rows`` of every row at every slot at once: write rows ``[S, B]``, key rows
        ``[S, B, L]``, key counts ``[B]``, cos and sin ``[B, 1, D]``, contiguous on the host (a
        fused stack of blocks, ``cpu.block``, indexes them by slot); None for any other step."""
        if not self._plain_decode:
            return None
        assert self._n_keys is not None
        return (self._write_by_slot, self._keys_by_slot, self._n_keys, self.cos.contiguous(),
                self.sin.contiguous())

    def burst_slots(self) -> tuple[torch.Tensor, ...] | None:
        """For one row's greedy burst (``cpu.step.FusedStep.burst``: its T new tokens decoded one
        after another, token t stored at ``start + t`` and attending to ``start + t + 1`` keys):
        write rows ``[T, S]``, key rows ``[S, L]``, cos and sin ``[T, D]``, contiguous on the host;
        None where the context is not one row of plain causal tokens on the host."""
        if (len(self._starts) != 1 or self._gaps is not None or self._mask_of[1] is not None
                or self._positions is not None or self.pool.store.mode.h_mode
                or torch.device(self.pool.device).type != "cpu"):
            return None
        return (self._write_by_slot.t().contiguous(), self._keys_by_slot[:, 0], self.cos[0].contiguous(),
                self.sin[0].contiguous())

    @property
    def burst_start(self) -> int:
        """The first new token's position (one row's: ``burst_slots``)."""
        return self._starts[0]

    def key_rope(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at every key position of ``rows``, ``[R, L, D]`` each (h-mode's recompute).

        A key's position is its slot position, except this call's new tokens, which use the
        positions they were given (tree tokens share depths).
        """
        if self._key_rope is None:
            cos, sin = self._rope.tables(self._key_pos)  # [L, D]
            b = self.cos.shape[0]
            cos, sin = cos.expand(b, *cos.shape), sin.expand(b, *sin.shape)  # [B, L, D]
            if self._positions is not None:
                cos, sin = cos.clone(), sin.clone()
                n_new = self.cos.shape[1]
                for row, start in enumerate(self._starts):
                    cos[row, start:start + n_new] = self.cos[row]
                    sin[row, start:start + n_new] = self.sin[row]
            self._key_rope = cos, sin
        cos, sin = self._key_rope
        return _take(cos, rows), _take(sin, rows)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None, slots: torch.Tensor | int,
               h: torch.Tensor | None = None, layer: Attention | None = None) -> torch.Tensor:
        r, kvh, t, d = k.shape
        write, keys = self._flat_index(rows, slots)
        store, kernels = self.pool.store, self.backend
        if store.mode.h_mode:
            if h is None or layer is None:
                raise ValueError("an h-mode KV pool needs the attention input h and its layer")
            kernels.kv_write(store, write, h=h.reshape(r * t, -1))
            keys_k, keys_v = layer.kv_from_h(kernels.kv_read(store, "h", keys), store.dtype)  # [R, L, KVH, D]
            keys_k, keys_v = keys_k.transpose(1, 2).to(q.dtype), keys_v.transpose(1, 2).to(q.dtype)
            cos, sin = self.key_rope(rows)
            keys_k = self._rope.apply(keys_k, cos, sin)  # [R, KVH, L, D]
        else:
            if t == 1:  # [R, KVH, 1, D] is laid out as [R, 1, KVH, D] already
                new_k, new_v = k.squeeze(2), v.squeeze(2)
            else:
                new_k, new_v = k.transpose(1, 2).reshape(r * t, kvh, d), v.transpose(1, 2).reshape(r * t, kvh, d)
            kernels.kv_write(store, write, k=new_k, v=new_v)
            if self._n_keys is not None and self._gaps is None:
                return kernels.decode_attention(store, q, keys, _take(self._n_keys, rows),
                                                self._mask(rows, slots, q.dtype),
                                                None if self._tree is None else _take(self._tree, rows))
            if self._unmasked and self._gaps is None and not store.mode.int4 and store.dtype == q.dtype:
                # every key is one of this call's tokens (a first prefill chunk) and the pool keeps
                # them as they are: attend over k and v themselves, not a gathered copy of them
                return kernels.attention(q, k, v, None)
            keys_k = kernels.kv_read(store, "k", keys, q.dtype).transpose(1, 2)  # [R, KVH, L, D]
            keys_v = kernels.kv_read(store, "v", keys, q.dtype).transpose(1, 2)  # [R, KVH, L, D]
        return kernels.attention(q, keys_k, keys_v, self._mask(rows, slots, q.dtype))

    # -- a model that attends itself (Inkling-2: its own fields, ``KVStore``) -------------------
    def write_fields(self, rows: torch.Tensor | None, slots: torch.Tensor | int, **values: torch.Tensor) -> None:
        """Store each field's values for the new tokens of ``rows`` ``[R, T, *row_shape]`` at
        ``slots`` (the other fields untouched)."""
        write, _ = self._flat_index(rows, slots)
        self.pool.store.write(write, **{name: v.reshape(write.shape[0], *v.shape[2:]) for name, v in values.items()})

    def gather(self, rows: torch.Tensor | None, slots: torch.Tensor | int, names: Sequence[str],
               positions: torch.Tensor | None) -> list[torch.Tensor]:
        """Fields ``names`` of ``rows`` at ``slots`` at key ``positions`` ``[R, P]`` (below this
        call's last key; None: every key, ``P = L``): ``[R, P, *row_shape]`` each, in the pool's
        dtype, zeros at negative positions; the pool rows are found once for them all."""
        _, keys = self._flat_index(rows, slots)  # [R, L]
        at = keys if positions is None else keys.gather(1, positions.clamp(0, keys.shape[1] - 1))
        outs = [self.pool.store.read(name, at) for name in names]
        if positions is None or positions.numel() == 0 or int(positions.min()) >= 0:
            return outs
        below = positions < 0
        return [out.masked_fill(below.view(*positions.shape, *([1] * (out.dim() - 2))), 0) for out in outs]

    def visible(self, rows: torch.Tensor | None) -> torch.Tensor:
        """``[R, T, L]``: which keys each new token of ``rows`` may attend (causal by position,
        each row's own length)."""
        return _take(self.mask, rows)[:, 0]

    def field_width(self, name: str) -> int:
        """The width of a row of field ``name``."""
        return self.pool.store.row_shapes[name][-1]

    def copy_new(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy what the new tokens of ``rows`` stored (K and V, or h) from slot ``src`` to slot
        ``dst`` (per row)."""
        w_src, _ = self._flat_index(rows, src)
        w_dst, _ = self._flat_index(rows, dst)
        self.backend.kv_copy(self.pool.store, w_src, w_dst)


class FullContext:
    """No cache: causal attention over the T tokens of this call (positions 0..T-1)."""

    def __init__(self, rope: Rope, batch: int, n_tokens: int, backend: Backend = TORCH) -> None:
        self.backend = backend
        pos = torch.arange(n_tokens).expand(batch, n_tokens)
        cos, sin = rope.tables(pos)  # [B, T, D]
        self.cos, self.sin = cos[:, None], sin[:, None]  # [B, 1, T, D]

    def rope(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return _take(self.cos, rows), _take(self.sin, rows)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None, slots: torch.Tensor | int,
               h: torch.Tensor | None = None, layer: Attention | None = None) -> torch.Tensor:
        return self.backend.attention(q, k, v, None)

    def copy_new(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Nothing is kept, so there is nothing to copy."""
