"""One scheduler over several engines (FakeEngines on the autojump clock): placement by prefix
and by load, a broken engine leaving the pool, per-engine metrics, drain on shutdown."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from tests.actors.support import CEILING_S, Outcomes, req, run_request, settle, until
from tinyloop import EngineBroken, GenerationResult, Runtime, SchedulerShutdown, Settings, open_runtime
from tinyloop.testing import FakeEngine

BLOCK = 16


@asynccontextmanager
async def engines_runtime(engines: list[FakeEngine], **settings: Any) -> AsyncIterator[Runtime]:
    async with open_runtime(engines, Settings(kv_block_size=BLOCK, **settings)) as rt:
        yield rt
        await settle()
        stats = rt.statistics()
        assert (stats.queue_depth, stats.in_flight) == (0, 0), rt
    assert all(e.live == 0 for e in engines), "every sequence is freed on every engine"


def where(engines: list[FakeEngine], request_id: str) -> int:
    (engine,) = [i for i, e in enumerate(engines) if request_id in e.started]
    return engine


def conversation(tag: int, turns: int) -> list[tuple[int, ...]]:
    """Each turn's prompt: the previous one plus a block of new tokens (a chat growing)."""
    prompts, prompt = [], tuple(tag * 1000 + i for i in range(2 * BLOCK))
    for turn in range(turns):
        prompts.append(prompt)
        prompt = prompt + tuple(tag * 1000 + 500 + turn * BLOCK + i for i in range(BLOCK))
    return prompts


async def test_load_spreads_requests_over_the_engines() -> None:
    engines = [FakeEngine(latency_ms=100), FakeEngine(latency_ms=100)]
    outcomes: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with engines_runtime(engines, max_batch_size=4) as rt:
            assert rt.statistics().slots == 8
            async with trio.open_nursery() as n:
                for i in range(4):  # distinct prompts, half the slots: nothing to follow but the load
                    await n.start(run_request, rt, req(prompt=(i,) * 40), outcomes)
                await settle()
                assert rt._dispatcher.statistics().engine_slots_used == (2, 2)  # not 4 on the first
                assert rt.statistics().in_flight == 4
    assert [len(e.started) for e in engines] == [2, 2]
    assert all(isinstance(o, GenerationResult) for o in outcomes.values())


async def test_a_conversation_stays_on_the_engine_that_has_its_prefix() -> None:
    engines = [FakeEngine(latency_ms=10), FakeEngine(latency_ms=10)]
    outcomes: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with engines_runtime(engines, max_batch_size=4) as rt:
            placed: dict[int, set[int]] = {0: set(), 1: set()}
            for turn in range(4):  # two conversations, turn by turn, both running at once
                requests = {tag: req(prompt=conversation(tag, 4)[turn]) for tag in (0, 1)}
                async with trio.open_nursery() as n:
                    for request in requests.values():
                        await n.start(run_request, rt, request, outcomes)
                for tag, request in requests.items():
                    placed[tag].add(where(engines, request.request_id))
            assert all(len(p) == 1 for p in placed.values()), placed
            assert placed[0] != placed[1], "the two conversations spread over both engines"
            assert rt._dispatcher.placement.statistics().by_prefix == 6  # every turn after the first


async def test_a_registered_prefix_draws_its_requests_to_its_engine() -> None:
    engines = [FakeEngine(latency_ms=10), FakeEngine(latency_ms=10)]
    outcomes: Outcomes = {}
    system = tuple(range(100, 100 + 3 * BLOCK))
    with trio.fail_after(CEILING_S):
        async with engines_runtime(engines, max_batch_size=4) as rt:
            await rt.register_prefix(tuple(range(900, 900 + 2 * BLOCK)))  # another prefix, on engine 0
            await rt.register_prefix(system)  # so this one goes to engine 1, the one with fewer entries
            (home,) = [i for i, e in enumerate(engines) if tuple(system) in e.prefixes]
            assert home == 1
            for i in range(3):
                request = req(prompt=system + (i, i))
                await run_request(rt, request, outcomes)
                assert where(engines, request.request_id) == home
            await settle()
            hits = rt.metrics.registry.get_sample_value("tinyloop_engine_prefix_cache_hit_tokens_total",
                                                        {"engine": str(home)})
            assert hits == 3 * len(system)  # every one of them started from the registered KV
            await rt.register_prefix(system + (7,), everywhere=True)
            assert [len(e.prefixes) for e in engines] == [2, 2]


async def test_a_broken_engine_fails_only_its_requests_and_leaves_the_pool() -> None:
    engines = [FakeEngine(latency_ms=50), FakeEngine(latency_ms=50)]
    outcomes: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with engines_runtime(engines, max_batch_size=2) as rt:
            async with trio.open_nursery() as n:
                first = [req(prompt=(i,) * 20) for i in range(4)]
                for request in first:
                    await n.start(run_request, rt, request, outcomes)
                await settle()
                engines[1].fail_with = EngineBroken("device lost")
            broke = [r for r in first if isinstance(outcomes[r.request_id], EngineBroken)]
            assert len(broke) == 2  # engine 1's two slots' worth
            assert all(where(engines, r.request_id) == 0 for r in first if r not in broke)
            assert all(isinstance(outcomes[r.request_id], GenerationResult) for r in first if r not in broke)
            stats = rt.statistics()
            assert stats.healthy and stats.engines[1].broken and stats.engines[0].broken is None
            assert stats.slots == 2  # the broken engine's slots left with it
            later = [req(prompt=(9,) * 20) for _ in range(4)]
            async with trio.open_nursery() as n:
                for request in later:
                    n.start_soon(run_request, rt, request, outcomes)
            assert all(isinstance(outcomes[r.request_id], GenerationResult) for r in later)
            assert all(where(engines, r.request_id) == 0 for r in later)
            text = rt.metrics_text()
            assert 'tinyloop_engine_healthy{engine="1"} 0.0' in text
            assert 'tinyloop_engine_healthy{engine="0"} 1.0' in text


async def test_every_engine_broken_refuses_new_requests() -> None:
    engines = [FakeEngine(latency_ms=10, fail_with=EngineBroken("gone")) for _ in range(2)]
    outcomes: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with engines_runtime(engines, max_batch_size=1) as rt:
            async with trio.open_nursery() as n:
                for i in range(2):
                    n.start_soon(run_request, rt, req(prompt=(i,) * 20), outcomes)
            assert all(isinstance(o, EngineBroken) for o in outcomes.values())
            assert not rt.healthy
            assert "engine 0: gone" in (rt.statistics().broken or "")
            await run_request(rt, late := req(), outcomes)
            assert isinstance(outcomes[late.request_id], SchedulerShutdown)


async def test_per_engine_counters_add_up_to_the_totals() -> None:
    engines = [FakeEngine(latency_ms=10, stream_tokens=[1, 2, 3, 4]) for _ in range(2)]
    outcomes: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with engines_runtime(engines, max_batch_size=2) as rt:
            async with trio.open_nursery() as n:
                for i in range(6):
                    n.start_soon(run_request, rt, req(max_tokens=4, prompt=(i,) * 20), outcomes)
            await until(lambda: len(outcomes) == 6)
            await settle()
            registry = rt.metrics.registry
            total = registry.get_sample_value("tinyloop_tokens_generated_total")
            per = [registry.get_sample_value("tinyloop_engine_tokens_generated_total", {"engine": str(i)})
                   for i in range(2)]
            assert total == 24 and per[0] is not None and per[1] is not None and per[0] + per[1] == 24
            done = [registry.get_sample_value("tinyloop_engine_requests_completed_total", {"engine": str(i)})
                    for i in range(2)]
            assert done == [len(engines[0].started), len(engines[1].started)]


async def test_one_engine_shows_no_engine_series() -> None:
    async with open_runtime(FakeEngine(latency_ms=1), Settings()) as rt:
        await rt.submit(req())
        assert "tinyloop_engine_" not in rt.metrics_text()
        assert rt.statistics().engines[0].broken is None


async def test_drain_on_shutdown_finishes_every_engines_requests() -> None:
    engines = [FakeEngine(latency_ms=100, token_latency_ms=50) for _ in range(2)]
    outcomes: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with open_runtime(engines, Settings(max_batch_size=2)) as rt:
            async with trio.open_nursery() as n:
                for i in range(6):  # 4 run, 2 wait in the queue
                    await n.start(run_request, rt, req(prompt=(i,) * 20), outcomes)
                await settle()
                assert rt.statistics().queue_depth == 2
                await rt.shutdown(drain=True)
            assert len(outcomes) == 6 and all(isinstance(o, GenerationResult) for o in outcomes.values())
            assert sum(len(e.started) for e in engines) == 6 and all(e.started for e in engines)
        assert all(e.live == 0 for e in engines)


async def test_shutdown_without_drain_cancels_every_engines_requests() -> None:
    engines = [FakeEngine(latency_ms=100, token_latency_ms=1000, stream_tokens=list(range(50))) for _ in range(2)]
    outcomes: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with open_runtime(engines, Settings(max_batch_size=1)) as rt:
            async with trio.open_nursery() as n:
                for i in range(3):  # one on each engine, one queued
                    await n.start(run_request, rt, req(max_tokens=50, prompt=(i,) * 20), outcomes)
                await trio.sleep(0.5)
                assert all(e.started for e in engines) and rt.statistics().queue_depth == 1
                await rt.shutdown(drain=False)
            assert len(outcomes) == 3 and all(isinstance(o, SchedulerShutdown) for o in outcomes.values())
    assert all(e.live == 0 for e in engines)


async def test_a_beam_search_wider_than_an_engine_runs_alone_on_one() -> None:
    engines = [FakeEngine(latency_ms=10) for _ in range(2)]
    outcomes: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with engines_runtime(engines, max_batch_size=2) as rt:
            wide = req(prompt=(5,) * 20, mode="beam", num_beams=3)
            async with trio.open_nursery() as n:
                await n.start(run_request, rt, wide, outcomes)
                await n.start(run_request, rt, req(prompt=(6,) * 20), outcomes)
                await settle()
                assert sorted(rt._dispatcher.statistics().engine_slots_used) == [1, 3]
    assert all(isinstance(o, GenerationResult) for o in outcomes.values())
