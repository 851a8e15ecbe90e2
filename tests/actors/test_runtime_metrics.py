"""The runtime's Prometheus series (seeds/scheduler.md) and the one clock they share with results.

On FakeEngine and the ``autojump_clock`` (``tests/actors/support.py`` says why)."""

from __future__ import annotations

from functools import partial

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.actors.support import (
    CEILING_S,
    SEED_BUCKETS_MS,
    SEED_COUNTERS,
    SEED_GAUGES,
    SEED_HISTOGRAMS,
    Outcomes,
    exposition,
    req,
    run_request,
    runtime,
    sample,
    settle,
)
from tinyloop import EngineError, GenerationResult, QueueFullError
from tinyloop.testing import FakeEngine


async def test_metrics_exposition_has_the_seed_series_and_moves(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1, max_queue_depth=1) as rt:
            families = {f.name: f for f in text_string_to_metric_families(rt.metrics_text())}
            for name in SEED_COUNTERS:
                assert families[name].type == "counter"
                assert [(s.name, s.value) for s in families[name].samples] == [(f"{name}_total", 0)]
            for name in SEED_GAUGES:
                assert families[name].type == "gauge"
            for name in SEED_HISTOGRAMS:
                assert families[name].type == "histogram"
                les = [float(s.labels["le"]) for s in families[name].samples if s.name == f"{name}_bucket"]
                assert les == SEED_BUCKETS_MS
                assert {s.name for s in families[name].samples} == {f"{name}_bucket", f"{name}_sum", f"{name}_count"}

            done, victim = req(), req()
            scope = trio.CancelScope()

            async def cancelled_caller(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with scope:
                    await run_request(rt, victim, out, task_status=task_status)

            async with trio.open_nursery() as n:
                await n.start(partial(run_request, rt, done, out, stream=True))
                await n.start(cancelled_caller)
                await settle()
                busy = exposition(rt)
                assert (busy["tinyloop_queue_depth"], busy["tinyloop_requests_in_flight"]) == (1, 1)
                with pytest.raises(QueueFullError):
                    await rt.submit(req())
                scope.cancel()
            engine.fail_with = EngineError("boom")
            with pytest.raises(EngineError):
                await rt.submit(req())
            engine.fail_with = None
            await settle()

            m = exposition(rt)
            assert m["tinyloop_requests_submitted_total"] == 3  # done, victim, the failing one
            assert m["tinyloop_requests_rejected_total"] == 1
            assert m["tinyloop_requests_completed_total"] == 1
            assert m["tinyloop_requests_cancelled_total"] == 1
            assert m["tinyloop_requests_errored_total"] == 1
            assert m["tinyloop_prefix_pool_hits_total"] == 0
            assert (m["tinyloop_queue_depth"], m["tinyloop_requests_in_flight"]) == (0, 0)
            assert m["tinyloop_request_wall_ms_count"] == 3  # every terminal state
            assert m["tinyloop_dispatch_ms_count"] == 2  # the cancelled one never reached the engine
            assert m["tinyloop_queue_wait_ms_count"] == 2
            assert m["tinyloop_queue_wait_ms_bucket{1.0}"] == 2  # both found the slot free
            assert m["tinyloop_dispatch_ms_bucket{50.0}"] == 0
            assert m["tinyloop_dispatch_ms_bucket{250.0}"] == 2  # prefill 100 ms, decode 0
            assert m["tinyloop_first_token_ms_count"] == 1  # only `done` was a stream
            assert m["tinyloop_first_token_ms_bucket{+Inf}"] == 1
            stats = rt.statistics()
            assert (stats.queue_depth, stats.in_flight, stats.dispatched) == (0, 0, 2)
    assert isinstance(out[done.request_id], GenerationResult)


async def test_tokens_count_as_they_are_generated_whatever_becomes_of_the_request(
        autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=list(range(1, 11)))
    with trio.fail_after(CEILING_S):
        async with runtime(engine) as rt:
            async with rt.submit_stream(req(max_tokens=10, prompt=(1, 2, 3))) as stream:
                async for chunk in stream:
                    if chunk.index == 3:
                        break  # cancelled after 4 of its 10 tokens
            await rt.submit(req(max_tokens=2, prompt=(1, 2)))
            await settle()
            counts = exposition(rt)
            assert counts["tinyloop_requests_cancelled_total"] == 1
            assert counts["tinyloop_tokens_generated_total"] >= 4 + 2
            assert counts["tinyloop_prompt_tokens_total"] == 3 + 2


async def test_results_and_metrics_read_one_clock(autojump_clock: trio.abc.Clock) -> None:
    """A result's wall time and time to first token run from submission on the runtime's clock,
    queue wait included, and equal what the histograms observed."""
    engine = FakeEngine(latency_ms=30, token_latency_ms=5)
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            async with trio.open_nursery() as n:
                n.start_soon(rt.submit, req())  # holds the only slot: the next one queues
                await settle()
                submitted = trio.current_time()
                async with rt.submit_stream(req()) as stream:
                    async for _ in stream:
                        pass
                finished = trio.current_time()
            result = stream.result
            assert result is not None and result.time_to_first_token_ms is not None
            assert result.wall_ms == pytest.approx((finished - submitted) * 1000)
            assert result.time_to_first_token_ms > 30  # it waited for the first request's prefill
            assert sample(rt, "tinyloop_first_token_ms_sum") == pytest.approx(result.time_to_first_token_ms)
            walls = sample(rt, "tinyloop_request_wall_ms_sum")
            assert walls - result.wall_ms == pytest.approx(40)  # the first request's own wall time
