"""The prefix pool as the runtime dispatches through it.

On FakeEngine and the ``autojump_clock`` (``tests/actors/support.py`` says why)."""

from __future__ import annotations

import trio

from tests.actors.support import CEILING_S, req, runtime, sample, settle
from tinyloop.testing import FakeEngine


async def test_prefix_pool_hits_count_generate_dispatches_while_the_pool_has_entries(
        autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10)
    with trio.fail_after(CEILING_S):
        async with runtime(engine) as rt:
            await rt.submit(req(prompt=(1, 2, 3, 4)))
            await settle()
            assert sample(rt, "tinyloop_prefix_pool_hits_total") == 0  # empty pool
            await rt.register_prefix([1, 2, 3])
            assert rt.statistics().prefix_pool_size == 1
            assert engine.prefixes == [(1, 2, 3)]
            await settle()
            assert sample(rt, "tinyloop_prefix_pool_hits_total") == 0  # registering is no dispatch

            await rt.submit(req(prompt=(1, 2, 3, 4)))  # the prefix matches
            await rt.submit(req(prompt=(9, 9)))  # no match, counted all the same (the seeds' rule)
            for mode in ("speculative", "tree", "beam"):  # through the pool, but not counted
                await rt.submit(req(prompt=(1, 2, 3, 4), mode=mode))
            await settle()
            assert sample(rt, "tinyloop_prefix_pool_hits_total") == 2
            assert rt.statistics().dispatched == 6
            # Every started request is looked up; the pool's 3 tokens serve the four (1, 2, 3, 4).
            assert sample(rt, "tinyloop_prefix_cache_queried_tokens_total") == 4 + 4 + 2 + 3 * 4
            assert sample(rt, "tinyloop_prefix_cache_hit_tokens_total") == 4 * 3
