"""Engine replicas: one model's weights, a KV pool each; two stepping at once in two threads
give each request what one engine alone gives it."""

from __future__ import annotations

import threading

from tests.engine.test_engine import MIXED, make_engine, req
from tinyloop.requests import GenerationResult


def test_a_replica_shares_the_weights_and_owns_its_kv() -> None:
    engine = make_engine(max_seq_len=256, block_size=8)
    twin = engine.replica()
    assert twin.model is engine.model
    assert twin.pool is not engine.pool and twin.batch is not engine.batch
    assert twin.prefix_cache.pool is twin.pool and twin.limits is not engine.limits
    long = req(list(range(10, 31)), max_tokens=4)  # two full blocks of 8 go to the prefix cache
    twin.generate(long)
    assert twin.kv_statistics().blocks_cached > 0
    assert engine.kv_statistics().blocks_cached == 0  # the original's pool is untouched
    seq = twin.start(long)
    assert seq.cached_tokens == 16  # the twin's cache serves it
    twin.free(seq)
    assert engine.start(long).cached_tokens == 0


def test_replicas_stepping_in_two_threads_match_one_engine() -> None:
    engine = make_engine(max_seq_len=256, block_size=8)
    alone = [engine.generate(r) for r in MIXED]
    replicas = [engine, engine.replica()]
    results: dict[int, list[GenerationResult]] = {}

    def run(i: int) -> None:
        results[i] = [replicas[i].generate(r) for r in MIXED]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(2):
        assert [r.tokens for r in results[i]] == [r.tokens for r in alone]
        assert replicas[i].kv_statistics().blocks_used == 0
