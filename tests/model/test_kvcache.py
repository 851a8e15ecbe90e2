"""The paged KV cache: slot mapping, exact allocation, sharing, rollback, exhaustion."""

from __future__ import annotations

import pytest
import torch

from tinyloop.errors import KVCacheExhausted
from tinyloop.model.config import ModelConfig, kv_bytes_per_token
from tinyloop.model.kvcache import KVPool, SeqKV, slot_count

CFG = ModelConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=32,
                  n_prelude=2, n_core=3, n_coda=1, default_loops=4, max_loops=8)


@pytest.mark.parametrize("loops", [1, 4, 8])
@pytest.mark.parametrize("window", [1, 2, None])
def test_allocation_matches_the_bytes_per_token_formula(loops: int, window: int | None) -> None:
    w = loops if window is None else window
    pool = KVPool(CFG, 4096, block_size=16, dtype=torch.float16)
    kv = SeqKV(pool, slot_count(CFG, loops, w))
    kv.reserve(64)  # four full blocks per slot
    expected_slots = CFG.n_prelude + CFG.n_coda + CFG.n_core * min(w, loops)
    assert kv.n_slots == expected_slots
    assert pool.statistics().blocks_used == expected_slots * 4
    bytes_used = pool.statistics().blocks_used * pool.statistics().bytes_per_block
    assert bytes_used == 64 * kv_bytes_per_token(CFG, loops, w, bytes_per_elem=2)
    assert kv_bytes_per_token(CFG, loops, w) == 2 * 2 * 8 * 2 * expected_slots


def test_fork_shares_blocks_and_copies_on_write() -> None:
    pool = KVPool(CFG, 64, block_size=4)
    kv = SeqKV(pool, 2)
    kv.reserve(6)
    kv.length = 6
    pool.k[kv.tables[0][1]].fill_(1.0)
    child = kv.fork()
    assert pool.statistics().blocks_used == 4  # nothing copied yet
    child.reserve(7)  # writes into the shared, partly filled second block of each slot
    assert child.tables[0][0] == kv.tables[0][0]
    assert child.tables[0][1] != kv.tables[0][1]
    assert torch.equal(pool.k[child.tables[0][1]], pool.k[kv.tables[0][1]])
    assert pool.statistics().blocks_used == 6
    kv.free()
    child.free()
    assert pool.statistics().blocks_used == 0


def test_truncate_frees_whole_blocks_past_the_new_length() -> None:
    pool = KVPool(CFG, 64, block_size=4)
    kv = SeqKV(pool, 3)
    kv.reserve(10)
    kv.length = 10
    kv.truncate(5)
    assert kv.length == 5 and kv.blocks_per_slot == 2
    assert pool.statistics().blocks_used == 6
    with pytest.raises(ValueError):
        kv.truncate(6)


def test_exhaustion_is_all_or_nothing() -> None:
    pool = KVPool(CFG, 5, block_size=4)
    kv = SeqKV(pool, 3)
    with pytest.raises(KVCacheExhausted, match="need 6 blocks, 5 of 5 free"):
        kv.reserve(5)
    assert pool.free_blocks == 5 and kv.num_blocks == 0
    kv.reserve(4)
    assert pool.free_blocks == 2
    assert "used=3/5" in repr(pool)


def test_pool_rows_follow_every_change_to_the_tables() -> None:
    pool = KVPool(CFG, 64, block_size=4)
    kv = SeqKV(pool, 2)

    def expected() -> list[list[int]]:
        return [[block * 4 + offset for block in table for offset in range(4)] for table in kv.tables]

    kv.reserve(6)
    assert kv.pool_rows().tolist() == expected()
    assert not kv.pool_rows().flags.writeable  # (a cache: contexts copy what they take)
    kv.length = 6
    child = kv.fork()
    assert child.pool_rows().tolist() == kv.pool_rows().tolist()
    child.reserve(7)  # copy-on-write: the child's second blocks are new ones
    assert child.pool_rows().tolist() != kv.pool_rows().tolist()
    kv.reserve(13)  # a new block a slot
    assert kv.pool_rows().shape == (2, 16) and kv.pool_rows().tolist() == expected()
    kv.truncate(3)
    assert kv.pool_rows().tolist() == expected()
    kv.free()
    assert kv.pool_rows().shape == (2, 0)


@pytest.mark.parametrize("blocks", [[3, 4, 5, 9], [7], list(range(40, 0, -2))])  # runs; one; scattered (index_fill)
def test_allocated_blocks_are_zeroed_whatever_their_last_owner_left(blocks: list[int]) -> None:
    pool = KVPool(CFG, 64, block_size=4)
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("inf"))
    pool._free = sorted(set(range(64)) - set(blocks), reverse=True) + list(reversed(blocks))
    got = pool.allocate(len(blocks))
    assert sorted(got) == sorted(blocks)
    for b in range(64):
        cleared = b in blocks
        assert bool((pool.k[b] == 0).all()) == cleared  # [block_size, kv_heads, head_dim] a block
        assert bool((pool.v[b] == 0).all()) == cleared
