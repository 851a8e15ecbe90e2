"""The prefix cache's idle-block count: kept as blocks change hands, and safe to read from another
thread while the engine's worker inserts and evicts."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tinyloop.errors import KVCacheExhausted
from tinyloop.model.blockcache import BlockCache, block_keys
from tinyloop.model.config import ModelConfig
from tinyloop.model.kvcache import KVPool, SeqKV

CFG = ModelConfig(vocab_size=64, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=8,
                  n_prelude=1, n_core=1, n_coda=1, default_loops=1, max_loops=1)
BS, SLOTS, SALT = 2, 2, ("test",)


def recount(cache: BlockCache) -> int:
    """The idle blocks counted the slow way: every cached block only the cache references."""
    return sum(1 for blocks in list(cache._entries.values()) for b in blocks if cache._refcount[b] == 1)


class Seq:
    """A sequence as the engine drives one: its tokens and their KV."""

    def __init__(self, pool: KVPool, tokens: list[int]) -> None:
        self.pool, self.tokens, self.kv = pool, tokens, SeqKV(pool, SLOTS)

    def keys(self, n_blocks: int) -> list[bytes]:
        return block_keys(self.tokens, BS, n_blocks, SALT)

    def start(self) -> bool:
        """Adopt the cached prefix, then room for the rest; False (nothing held) when short."""
        self.kv.adopt(self.pool.cache.lookup(self.keys(len(self.tokens) // BS)))
        return self.grow([])

    def grow(self, more: list[int]) -> bool:
        try:
            self.kv.reserve(len(self.tokens) + len(more))
        except KVCacheExhausted:
            return False
        self.tokens += more
        self.kv.length = len(self.tokens)
        return True

    def cache(self) -> None:
        n = self.kv.length // BS
        self.pool.cache.insert(self.keys(n), self.kv.columns(n))

    def fork(self) -> Seq:
        child = Seq(self.pool, list(self.tokens))
        child.kv = self.kv.fork()
        return child

    def truncate(self, length: int) -> None:
        self.kv.truncate(length)
        del self.tokens[length:]


def random_ops(seed: int, steps: int) -> Iterator[tuple[str, KVPool]]:
    """Seeded random start/grow/cache/fork/truncate/free/evict/clear on a small pool, with
    prompts over two tokens so prefixes repeat and the cache hits, shares and evicts."""
    rng = random.Random(seed)
    pool = KVPool(CFG, 48, block_size=BS)
    live: list[Seq] = []
    for _ in range(steps):
        op = rng.choice(["start", "start", "grow", "cache", "cache", "fork", "truncate", "free",
                         "free", "evict", "clear"] if live else ["start", "evict"])
        seq = rng.choice(live) if live else None
        if op == "start":
            fresh = Seq(pool, [rng.randint(1, 2) for _ in range(rng.randint(0, 9))])
            if fresh.start():
                live.append(fresh)
            else:
                fresh.kv.free()
        elif op == "grow" and seq is not None:
            seq.grow([rng.randint(1, 2) for _ in range(rng.randint(1, 3))])
        elif op == "cache" and seq is not None:
            seq.cache()
        elif op == "fork" and seq is not None:
            live.append(seq.fork())
        elif op == "truncate" and seq is not None:
            seq.truncate(rng.randint(0, seq.kv.length))
        elif op == "free" and seq is not None:
            seq.kv.free()
            live.remove(seq)
        elif op == "evict":
            pool.cache.evict(rng.randint(1, 8))
        elif op == "clear" and rng.random() < 0.2:
            pool.cache.clear()
        yield op, pool
    for seq in live:
        seq.kv.free()
    pool.cache.clear()
    yield "end", pool


@pytest.mark.parametrize("seed", range(8))
def test_idle_count_matches_a_recount_after_every_operation(seed: int) -> None:
    seen = set()
    for op, pool in random_ops(seed, 400):
        stats = pool.statistics()
        assert stats.blocks_cached == recount(pool.cache), (seed, op)
        assert stats.blocks_used >= 0 and stats.blocks_used + stats.blocks_free + stats.blocks_cached == 48
        seen.add(op)
    assert stats == pool.statistics() and (stats.blocks_used, stats.blocks_free) == (0, 48)
    assert {"start", "cache", "fork", "truncate", "evict", "free"} <= seen


def test_the_random_operations_exercise_hits_sharing_and_eviction() -> None:
    hits = evictions = shared_idle = 0
    for _, pool in random_ops(0, 400):
        hits, evictions = pool.cache.hits, pool.cache.evictions
        shared_idle = max(shared_idle, pool.statistics().blocks_cached)
    assert hits > 0 and evictions > 0 and shared_idle > 0


def test_statistics_from_another_thread_while_the_cache_inserts_and_evicts() -> None:
    """The event loop reads the pool's statistics while the engine's worker thread changes the
    cache (many entries, so a read that iterated them would meet a change midway)."""
    pool = KVPool(CFG, 4096, block_size=1)
    stop, errors = threading.Event(), []

    def worker() -> None:
        n = 0
        try:
            while not stop.is_set():
                kv = SeqKV(pool, 1)
                kv.reserve(256)  # evicts idle entries once the free list runs dry
                pool.cache.insert([n.to_bytes(8, "big") + bytes([i % 256, i // 256]) for i in range(256)],
                                  kv.columns(256))
                for blocks in pool.cache.lookup([n.to_bytes(8, "big") + bytes([0, 0])]):  # LRU order
                    pool.release(blocks)
                kv.free()
                n += 1
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: mid-read changes become likely
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    reads = 0
    try:
        # at least a second of reads, and on a slow machine until the worker has evicted (at most 20 s)
        start = time.monotonic()
        while not errors and (time.monotonic() < start + 1.0
                              or (pool.cache.evictions == 0 and time.monotonic() < start + 20.0)):
            stats = pool.statistics()
            assert 0 <= stats.blocks_cached <= 4096 and stats.blocks_free <= 4096
            reads += 1
    finally:
        stop.set()
        thread.join(timeout=10)
        sys.setswitchinterval(interval)
    assert not thread.is_alive() and not errors, errors
    assert reads > 0 and pool.cache.evictions > 0
    assert pool.statistics().blocks_cached == recount(pool.cache)
