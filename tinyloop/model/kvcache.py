"""The paged KV cache with loop slots.

One preallocated pool of fixed-size blocks holds K and V for every layer application of every
sequence: ``k[num_blocks, block_size, kv_heads, head_dim]`` (and ``v``). A sequence owns one
block table per *slot*; a slot is one layer application that keeps KV:

    slot(prelude i)            = i
    slot(core i, loop r)       = n_prelude + (r mod W) * n_core + i
    slot(coda j)               = n_prelude + W * n_core + j

with ``W = min(cache_window, loops)``: DESIGN.md's mapping, so loop ``r`` of core layer ``i``
reuses the slot of loop ``r - W`` and past tokens keep what they last wrote. Every slot of a
sequence covers the same positions, so all of its tables grow by one block together and a
sequence holds exactly ``n_slots * ceil(length / block_size)`` blocks.

Blocks are reference counted: ``fork`` shares a sequence's blocks (prefix pool, beam) and the
first write into a shared block copies it (copy-on-write). The pool's ``cache`` (``blockcache.py``)
may keep full blocks of ended sequences for automatic prefix caching, holding one reference of
its own; ``allocate`` evicts its idle entries before it reports the pool exhausted.

What a block holds per position is the pool's ``KVMode`` (``kvmode.py``): K and V, 4-bit K and V,
or the attention input h; a ``KVStore`` (``kvstore.py``) does the storing. Block tables and
reference counts do not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tinyloop.errors import KVCacheExhausted, RequestError
from tinyloop.model.blockcache import BlockCache
from tinyloop.model.config import ModelConfig
from tinyloop.model.kvstore import KVStore
from tinyloop.vocabulary import KVMode, kv_slots_per_token

__all__ = ["KVDemand", "KVPool", "KVPoolStats", "SeqKV", "slot_count"]


def slot_count(config: ModelConfig, loops: int, cache_window: int) -> int:
    """Slots a sequence at ``loops``/``cache_window`` owns (the bytes-per-token formula's factor)."""
    return kv_slots_per_token(config, loops, cache_window)


@dataclass(frozen=True, slots=True)
class KVPoolStats:
    """A snapshot of the pool: blocks in use, free, total, and bytes per block.

    ``blocks_used`` counts blocks held by live sequences (and prefix-pool entries);
    ``blocks_cached`` the prefix cache's idle blocks, held by no sequence and evicted on demand.
    ``blocks_used + blocks_free + blocks_cached == blocks_total``.
    """

    blocks_total: int
    blocks_used: int
    blocks_free: int
    block_size: int
    bytes_per_block: int
    blocks_cached: int = 0


@dataclass(frozen=True, slots=True)
class KVDemand:
    """What a running sequence will ask of the pool (the engine actor plans with it).

    ``next_blocks``: blocks its next step may take beyond what it holds. ``outstanding``: for a
    sequence that set its worst case aside at start (not ``preemptible``: a recompute would not
    reproduce its KV), the blocks of that worst case it does not hold yet. ``headroom``: the
    blocks one more block of positions takes (its slot count).
    """

    next_blocks: int
    outstanding: int
    preemptible: bool
    headroom: int


class KVPool:
    """A fixed pool of KV blocks with a free list and reference counts.

    ``dtype`` is the model's compute dtype: full mode stores K and V in it, h-mode stores h in
    it (or in 16 bits with ``fp16_qkv``), int4 stores codes and fp16 scales whatever it is.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 mode: KVMode | str | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        mode = KVMode.parse(mode)
        if config.architecture == "inkling2" and (mode.h_mode or mode.int4):
            raise RequestError(f"kv_cache_mode {mode.name} is not available for an Inkling-2 model (its pool keeps "
                               "K, V and the short convolutions' inputs as they are); use full",
                               param="kv_cache_mode")
        if mode.h_mode and (config.value_embeds or config.qk_head_norm):
            # h-mode recomputes K,V as the layer's projection of h, which these layers' are not
            raise RequestError(f"kv_cache_mode {mode.name} is not available for this model (value embeddings or a "
                               "per-head q/k norm after RoPE: its K,V are not a projection of h); use full or int4",
                               param="kv_cache_mode")
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self.mode = mode
        # One more block than the free list hands out: the null block, never allocated and kept
        # zero, that pads the block tables of shorter rows in a batch (``PagedContext``).
        self.null_block = num_blocks
        self.store = KVStore(self.mode, config, (num_blocks + 1) * block_size, block_size, dtype, device)
        self.refcount = [0] * num_blocks
        # A stack: the most recently freed block is reused first (warm in cache).
        self._free = list(range(num_blocks - 1, -1, -1))
        self.cache = BlockCache(self.refcount, self.incref, self.release)

    # -- storage -------------------------------------------------------------------------------
    @property
    def k(self) -> torch.Tensor:
        """Full mode's K ``[N, bs, KVH, D]`` (TypeError in the other modes)."""
        return self.store.tensor("k")

    @property
    def v(self) -> torch.Tensor:
        """Full mode's V ``[N, bs, KVH, D]`` (TypeError in the other modes)."""
        return self.store.tensor("v")

    # -- accounting ----------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def bytes_per_token_slot(self) -> int:
        """Bytes one position of one slot takes, measured on the store's tensors."""
        return self.store.bytes_per_row

    def bytes_per_token(self, loops: int, cache_window: int | None = None) -> int:
        """Bytes a token of a sequence at ``loops``/``cache_window`` takes in this pool."""
        return self.bytes_per_token_slot * kv_slots_per_token(self.config, loops, cache_window)

    def statistics(self) -> KVPoolStats:
        """O(1) from counters, never iterating the cache: safe to call on the event loop while
        the engine's worker thread changes the pool (a read in the middle of a change may be
        off by the blocks that change moves, for that one read)."""
        cached = self.cache.idle_blocks()
        used = self.num_blocks - len(self._free) - cached
        per_block = self.bytes_per_token_slot * self.block_size
        return KVPoolStats(self.num_blocks, used, len(self._free), self.block_size, per_block, cached)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<KVPool used={s.blocks_used}/{s.blocks_total} cached={s.blocks_cached} block_size={s.block_size} "
                f"mode={self.mode.name}>")

    # -- blocks --------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each) or raise KVCacheExhausted, taking none.

        Idle prefix-cache blocks are evicted first when the free list is short."""
        if n > len(self._free):
            self.cache.evict(n - len(self._free))
        if n > len(self._free):
            raise KVCacheExhausted(
                f"KV cache exhausted: need {n} blocks, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        # What a block's last owner left there is read back, masked, by the new owner (the
        # positions of its last block past its length): zero it, or a non-finite value the last
        # owner wrote (a diverging request) turns the new owner's attention into NaN.
        self.store.clear_blocks(out)
        return out

    def incref(self, blocks: list[int]) -> None:
        held = self.cache.holders
        for b in blocks:
            self.refcount[b] += 1
            if self.refcount[b] == 2 and held[b]:  # a cached block was idle, a sequence shares it now
                self.cache.idle -= 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block with none left returns to the free list."""
        held = self.cache.holders
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)
            elif self.refcount[b] == 1 and held[b]:  # only the cache holds it now: idle
                self.cache.idle += 1
            elif self.refcount[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than taken")

    def copy_block(self, src: int, dst: int) -> None:
        self.store.copy_block(src, dst)


class SeqKV:
    """One sequence's block tables: ``n_slots`` tables of equal length over a shared pool.

    ``gaps`` maps a position to the loops its token ran when it exited early and left the core
    slots of the later loops unwritten (``ExitRule.exited_kv == "skip"``): attention leaves that
    key out at those slots (``PagedContext``).
    """

    def __init__(self, pool: KVPool, n_slots: int) -> None:
        self.pool = pool
        self.n_slots = n_slots
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self.length = 0  # positions written (the same in every slot)
        self.gaps: dict[int, int] = {}
        self.version = 0  # bumped by every change to ``tables`` (a copy kept elsewhere knows it is stale)
        self._rows: tuple[int, int, np.ndarray] | None = None  # pool_rows at (version, blocks_per_slot)

    @property
    def blocks_per_slot(self) -> int:
        return len(self.tables[0]) if self.tables else 0

    @property
    def num_blocks(self) -> int:
        return self.n_slots * self.blocks_per_slot

    def __repr__(self) -> str:
        return f"<SeqKV slots={self.n_slots} length={self.length} blocks={self.num_blocks}>"

    def pool_rows(self) -> np.ndarray:
        """The pool row of every slot and position this sequence has blocks for, ``[n_slots,
        capacity]`` int64 on the host (read-only): made again only when the tables change, so a
        decode step's index math is a slice of it (``PagedContext``)."""
        blocks = self.blocks_per_slot
        if self._rows is None or self._rows[:2] != (self.version, blocks):
            bs = self.pool.block_size
            tables = np.asarray(self.tables, dtype=np.int64).reshape(self.n_slots, blocks)
            rows = (tables[:, :, None] * bs + np.arange(bs, dtype=np.int64)).reshape(self.n_slots, blocks * bs)
            rows.flags.writeable = False
            self._rows = (self.version, blocks, rows)
        return self._rows[2]

    def capacity(self) -> int:
        return self.blocks_per_slot * self.pool.block_size

    def blocks_to_reserve(self, new_length: int) -> int:
        """The blocks ``reserve(new_length)`` would take now (new ones and copies of shared ones)."""
        bs = self.pool.block_size
        need_per_slot = max(-(-new_length // bs) - self.blocks_per_slot, 0)
        first = self.length // bs
        shared = 0
        if first < self.blocks_per_slot:
            shared = sum(1 for t in self.tables if self.pool.refcount[t[first]] > 1)
        return need_per_slot * self.n_slots + shared

    def reserve(self, new_length: int) -> None:
        """Make room for positions ``[length, new_length)`` in every slot, copying shared blocks.

        All-or-nothing: raises KVCacheExhausted without taking any block when the pool is short.
        """
        bs, have = self.pool.block_size, self.blocks_per_slot
        need_per_slot = max(-(-new_length // bs) - have, 0)
        first_write_block = self.length // bs
        refcount = self.pool.refcount
        shared = ([s for s, table in enumerate(self.tables) if refcount[table[first_write_block]] > 1]
                  if first_write_block < have else [])
        total = need_per_slot * self.n_slots + len(shared)
        if total == 0:  # (most decode steps: the token goes into a block of its own)
            return
        fresh = self.pool.allocate(total)
        self.version += 1
        for s in shared:  # copy-on-write of the partly filled block we are about to write into
            old = self.tables[s][first_write_block]
            new = fresh.pop()
            self.pool.copy_block(old, new)
            self.tables[s][first_write_block] = new
            self.pool.release([old])
        for table in self.tables:
            for _ in range(need_per_slot):
                table.append(fresh.pop())

    def truncate(self, new_length: int) -> None:
        """Forget positions ``>= new_length`` (speculation rollback); frees whole blocks past it."""
        if new_length > self.length:
            raise ValueError("truncate cannot grow a sequence")
        keep = -(-new_length // self.pool.block_size)
        self.version += 1
        for table in self.tables:
            self.pool.release(table[keep:])
            del table[keep:]
        self.length = new_length
        self.gaps = {pos: done for pos, done in self.gaps.items() if pos < new_length}

    def fork(self) -> SeqKV:
        """A new sequence sharing every block (copy-on-write on the next write)."""
        other = SeqKV(self.pool, self.n_slots)
        other.tables = [list(t) for t in self.tables]
        other.length = self.length
        other.gaps = dict(self.gaps)
        for t in other.tables:
            self.pool.incref(t)
        return other

    def columns(self, n_blocks: int) -> list[list[int]]:
        """The block ids of every slot at each of the first ``n_blocks`` block indices."""
        return [[table[i] for table in self.tables] for i in range(n_blocks)]

    def adopt(self, columns: list[list[int]]) -> None:
        """Start an empty sequence on shared full blocks (the caller took their references)."""
        if self.length or self.blocks_per_slot:
            raise ValueError("adopt needs an empty sequence")
        self.version += 1
        for s, table in enumerate(self.tables):
            table.extend(col[s] for col in columns)
        self.length = len(columns) * self.pool.block_size

    def free(self) -> None:
        """Give every block back; the sequence is empty afterwards."""
        self.version += 1
        for table in self.tables:
            self.pool.release(table)
            table.clear()
        self.length = 0
        self.gaps.clear()
