"""The runtime's scheduling, admission, cancellation and metrics, on FakeEngine (seeds/scheduler.md).

Every test runs on the ``autojump_clock``: FakeEngine's latencies are Trio sleeps, so a test
that "waits" half a second takes a few real milliseconds and always sees the same interleaving.
``settle()`` lets every task run until all are blocked without moving the clock; the
``fail_after`` ceilings are virtual seconds, so a deadlock fails at once instead of hanging.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from tinyloop import (
    AdmissionRejected, EngineBroken, EngineError, GenerationRequest, GenerationResult, QueueFullError,
    RequestError, RequestState, RequestStream, Runtime, SchedulerShutdown, Settings, TinyLoopError,
    open_runtime,
)
from tinyloop.vocabulary import ExitRule
from tinyloop.testing import FakeEngine

CEILING_S = 60  # virtual seconds

SEED_BUCKETS_MS = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, math.inf]
SEED_COUNTERS = ["tinyloop_requests_submitted", "tinyloop_requests_rejected", "tinyloop_requests_completed",
                 "tinyloop_requests_errored", "tinyloop_requests_cancelled", "tinyloop_prefix_pool_hits"]
SEED_HISTOGRAMS = ["tinyloop_queue_wait_ms", "tinyloop_dispatch_ms", "tinyloop_first_token_ms",
                   "tinyloop_request_wall_ms"]
SEED_GAUGES = ["tinyloop_queue_depth", "tinyloop_requests_in_flight"]

Outcomes = dict[str, GenerationResult | TinyLoopError]

settle = trio.testing.wait_all_tasks_blocked


def req(max_tokens: int = 3, prompt: tuple[int, ...] = (1, 2), **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=prompt, max_tokens=max_tokens, **kw)


def ids(*requests: GenerationRequest) -> list[str]:
    return [r.request_id for r in requests]


def sample(rt: Runtime, name: str) -> float:
    """A sample's value straight from the registry (0 when it has not been created)."""
    value = rt.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def exposition(rt: Runtime) -> dict[str, float]:
    """``metrics_text()`` parsed the way a Prometheus server parses it: sample name -> value
    (bucket samples keyed ``name{le}``)."""
    values = {}
    for family in text_string_to_metric_families(rt.metrics_text()):
        for s in family.samples:
            key = f"{s.name}{{{s.labels['le']}}}" if "le" in s.labels else s.name
            values[key] = s.value
    return values


@asynccontextmanager
async def runtime(engine: FakeEngine, **settings: Any) -> AsyncIterator[Runtime]:
    """``open_runtime`` with ``Settings(**settings)``; on a clean exit, check nothing is left over
    and that the body ran to its end (a Cancelled absorbed by the runtime would skip its rest)."""
    body_finished = False
    async with open_runtime(engine, Settings(**settings)) as rt:
        yield rt
        await settle()
        stats = rt.statistics()
        assert (stats.queue_depth, stats.in_flight) == (0, 0), rt
        body_finished = True
    assert body_finished, "the test body was cut short"
    assert engine.live == 0, "every sequence and prefix handle is freed"


async def run_request(rt: Runtime, request: GenerationRequest, outcomes: Outcomes, *, priority: int = 0,
                      slo_ms: float | None = None, stream: bool = False,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Submit ``request`` (as ``rt.submit`` does, or as a stream), report once admission has
    answered, and record the result or the TinyLoopError in ``outcomes``."""
    async with RequestStream(rt, request, priority, slo_ms, stream=stream) as s:
        try:
            await s.start()
        except TinyLoopError as exc:
            outcomes[request.request_id] = exc
            task_status.started()
            return
        task_status.started()
        try:
            async for _ in s:
                pass
        except TinyLoopError as exc:
            outcomes[request.request_id] = exc
            return
    assert s.result is not None
    outcomes[request.request_id] = s.result


async def until(predicate: Any, poll_s: float = 0.001) -> None:
    """Poll ``predicate`` on the virtual clock (the caller holds a fail_after ceiling)."""
    while not predicate():
        await trio.sleep(poll_s)


# -- ordering -----------------------------------------------------------------------------------
async def test_higher_priority_is_dispatched_first(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    blocker, low, high, mid = req(), req(), req(), req()
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt, trio.open_nursery() as n:
            await n.start(run_request, rt, blocker, out)
            await settle()
            assert rt.request_state(blocker.request_id) is RequestState.DECODING
            for r, priority in ((low, 0), (high, 9), (mid, 5)):  # submitted concurrently
                n.start_soon(partial(run_request, rt, r, out, priority=priority))
            await settle()
            assert rt.statistics().queue_depth == 3
    assert engine.started == ids(blocker, high, mid, low)
    assert all(isinstance(out[r.request_id], GenerationResult) for r in (blocker, low, high, mid))


async def test_fifo_within_a_priority(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    blocker = req()
    a, b, c, d, e = (req() for _ in range(5))
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt, trio.open_nursery() as n:
            await n.start(run_request, rt, blocker, out)
            for r, priority in ((a, 1), (b, 2), (c, 1), (d, 2), (e, 1)):  # admitted in this order
                await n.start(partial(run_request, rt, r, out, priority=priority))
    assert engine.started == ids(blocker, b, d, a, c, e)


# -- admission ----------------------------------------------------------------------------------
async def test_queue_full_rejects_exactly_the_overflow(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    blocker = req()
    burst = [req() for _ in range(5)]
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1, max_queue_depth=2) as rt:
            async with trio.open_nursery() as n:
                await n.start(run_request, rt, blocker, out)
                await settle()  # the blocker holds the only slot; the queue is empty
                for r in burst:
                    n.start_soon(run_request, rt, r, out)
                await settle()
                assert rt.statistics().queue_depth == 2
            await settle()
            assert sample(rt, "tinyloop_requests_rejected_total") == 3
            assert sample(rt, "tinyloop_requests_submitted_total") == 3
            assert sample(rt, "tinyloop_requests_completed_total") == 3
    refused = [r for r in burst if isinstance(out[r.request_id], QueueFullError)]
    served = [r for r in burst if isinstance(out[r.request_id], GenerationResult)]
    assert (len(refused), len(served)) == (3, 2)
    assert sorted(engine.started) == sorted(ids(blocker, *served))
    assert all(rt.request_state(r.request_id) is None for r in refused)  # never entered the machine


async def test_slo_rejection_needs_an_ema_and_reports_the_predicted_wait(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)  # every request holds the slot for 100 ms
    out: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            first, second = req(), req()
            async with trio.open_nursery() as n:
                await n.start(partial(run_request, rt, first, out, slo_ms=0.001))
                # No request has finished, so there is no EMA: a 1 µs SLO still admits, even
                # with the only slot taken.
                await n.start(partial(run_request, rt, second, out, slo_ms=0.001))
                await settle()
                assert rt.request_state(second.request_id) is RequestState.QUEUED
            assert isinstance(out[second.request_id], GenerationResult)

            blocker = req()
            async with trio.open_nursery() as n:
                await n.start(run_request, rt, blocker, out)
                await settle()
                # One request ahead and one slot: floor((0 + 1) / 1) * 100 ms.
                with pytest.raises(AdmissionRejected) as info:
                    await rt.submit(req(), slo_ms=50)
                assert info.value.predicted_wait_ms == pytest.approx(100)
                assert "SLO" in info.value.reason
                await n.start(partial(run_request, rt, req(), out, slo_ms=150))  # 100 <= 150: admits
            await settle()
            assert sample(rt, "tinyloop_requests_rejected_total") == 1
            assert sample(rt, "tinyloop_requests_completed_total") == 4


async def test_default_slo_applies_when_the_request_names_none(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1, default_slo_ms=50) as rt:
            await rt.submit(req())  # the first request admits (no EMA); now the EMA is 100 ms
            async with trio.open_nursery() as n:
                await n.start(run_request, rt, req(), out)  # free slot: predicted wait 0 <= 50
                await settle()
                with pytest.raises(AdmissionRejected) as info:
                    await rt.submit(req())  # 100 ms predicted > the default 50 ms
                assert info.value.predicted_wait_ms == pytest.approx(100)
                explicit = req()
                await n.start(partial(run_request, rt, explicit, out, slo_ms=500))  # an explicit SLO wins
            assert isinstance(out[explicit.request_id], GenerationResult)


# -- cancellation -------------------------------------------------------------------------------
async def test_cancel_while_queued_leaves_the_queue(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    blocker, victim = req(), req()
    scope = trio.CancelScope()

    async def caller(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await run_request(rt, victim, out, task_status=task_status)

    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            async with trio.open_nursery() as n:
                await n.start(run_request, rt, blocker, out)
                await n.start(caller)
                await settle()
                assert rt.request_state(victim.request_id) is RequestState.QUEUED
                assert rt.statistics().queue_depth == 1
                scope.cancel()
                await settle()
                assert rt.statistics().queue_depth == 0
                assert rt.request_state(victim.request_id) is RequestState.CANCELLED
                assert rt.request_state(blocker.request_id) is RequestState.DECODING
            await settle()
            assert sample(rt, "tinyloop_requests_cancelled_total") == 1
            assert sample(rt, "tinyloop_requests_completed_total") == 1
            assert sample(rt, "tinyloop_queue_wait_ms_count") == 1  # only the blocker reached the engine
    assert engine.started == ids(blocker)
    assert victim.request_id not in out
    assert isinstance(out[blocker.request_id], GenerationResult)


async def test_cancel_during_decode_frees_the_sequence_at_the_next_step(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=list(range(10)))
    out: Outcomes = {}
    victim, other = req(max_tokens=10), req(max_tokens=10)
    received: list[int] = []

    async def caller() -> None:
        with trio.CancelScope() as scope:
            async with rt.submit_stream(victim) as stream:
                async for chunk in stream:
                    received.append(chunk.token_id)
                    if len(received) == 3:
                        scope.cancel()

    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=2) as rt:
            async with trio.open_nursery() as n:
                n.start_soon(run_request, rt, other, out)
                n.start_soon(caller)
                await until(lambda: len(received) == 3)
                await settle()
                assert engine.live == 2  # the engine notices at its next step, not before
                await until(lambda: rt.request_state(victim.request_id) is RequestState.CANCELLED)
                assert engine.live == 1
                assert rt.request_state(other.request_id) is RequestState.DECODING
            await settle()
            assert sample(rt, "tinyloop_requests_cancelled_total") == 1
            assert sample(rt, "tinyloop_requests_completed_total") == 1
    assert received == [0, 1, 2]
    result = out[other.request_id]
    assert isinstance(result, GenerationResult) and result.tokens == list(range(10))
    assert engine.batches[-1] == 1 and engine.batches.count(2) <= 4  # the victim left the batch


# -- engine errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("error_type", [EngineError, RuntimeError], ids=["EngineError", "foreign"])
async def test_engine_error_fails_the_request_and_the_next_succeeds(
        autojump_clock: trio.abc.Clock, error_type: type[Exception]) -> None:
    engine = FakeEngine(latency_ms=10, fail_with=error_type("kernel failed"))
    bad, good = req(), req()
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            # A foreign exception from the engine is an EngineError at the runtime's boundary.
            with pytest.raises(EngineError, match="kernel failed"):
                await rt.submit(bad)
            assert rt.request_state(bad.request_id) is RequestState.ERROR
            engine.fail_with = None
            result = await rt.submit(good)
            assert result.tokens == [1, 2, 3]
            await settle()
            assert sample(rt, "tinyloop_requests_errored_total") == 1
            assert sample(rt, "tinyloop_requests_completed_total") == 1
            assert rt.healthy


async def test_engine_error_leaves_the_queued_request_served(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100, fail_with=EngineError("transient"))
    out: Outcomes = {}
    failing, queued = req(), req()
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt, trio.open_nursery() as n:
            await n.start(run_request, rt, failing, out)
            await n.start(run_request, rt, queued, out)
            await settle()
            assert rt.request_state(queued.request_id) is RequestState.QUEUED
            await trio.sleep(0.150)  # the failing step ended at 100 ms; the next one runs until 200
            assert isinstance(out[failing.request_id], EngineError)
            assert rt.request_state(queued.request_id) is RequestState.DECODING
            engine.fail_with = None
    result = out[queued.request_id]
    assert isinstance(result, GenerationResult) and result.tokens == [1, 2, 3]


async def test_a_request_the_engine_refuses_fails_alone(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10, max_loops=64)
    out: Outcomes = {}
    bad, good = req(loops=100), req()  # the engine refuses loops > max_loops
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=2) as rt:
            async with trio.open_nursery() as n:
                n.start_soon(run_request, rt, bad, out)
                n.start_soon(run_request, rt, good, out)
            await settle()
            # Validated before admission: it never enters the machine, so no terminal counter.
            assert sample(rt, "tinyloop_requests_errored_total") == 0
            assert sample(rt, "tinyloop_requests_submitted_total") == 1
            assert sample(rt, "tinyloop_requests_completed_total") == 1
            assert bad.request_id not in engine.started
    error = out[bad.request_id]
    assert isinstance(error, RequestError) and error.param == "loops"
    assert isinstance(out[good.request_id], GenerationResult)


async def test_engine_broken_turns_the_runtime_unhealthy(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10, fail_with=EngineBroken("device lost"))
    with trio.fail_after(CEILING_S):
        async with runtime(engine) as rt:
            with pytest.raises(EngineBroken):
                await rt.submit(req())
            assert not rt.healthy
            assert "device lost" in (rt.statistics().broken or "")
            with pytest.raises(SchedulerShutdown, match="broken"):
                await rt.submit(req())


# -- KV -----------------------------------------------------------------------------------------
async def test_requests_start_only_when_their_kv_fits_in_dispatch_order(autojump_clock: trio.abc.Clock) -> None:
    # one block per token: each request may hold 2 + 5 = 7 of 16, so two run at a time
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=[1, 2, 3, 4, 5], kv_blocks=16)
    out: Outcomes = {}
    a, b, c, d = (req(max_tokens=5) for _ in range(4))
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=4) as rt, trio.open_nursery() as n:
            for r in (a, b, c, d):
                await n.start(run_request, rt, r, out)
            await until(lambda: len(engine.started) == 2)
            await trio.sleep(0.025)  # a few steps: a and b run, c and d wait for blocks
            assert engine.started == ids(a, b)
            assert [rt.request_state(r.request_id) for r in (c, d)] == [RequestState.DISPATCHED] * 2
            assert (rt.statistics().waiting_for_kv, rt.statistics().in_flight) == (2, 4)
            assert exposition(rt)["tinyloop_requests_waiting_for_kv"] == 2
    assert engine.started == ids(a, b, c, d)
    assert all(out[r.request_id].tokens == [1, 2, 3, 4, 5] for r in (a, b, c, d))  # type: ignore[union-attr]
    assert max(engine.batches) == 2 and engine.peak_blocks <= 16


async def test_a_request_that_does_not_fit_lets_later_ones_that_fit_go_first(
        autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=list(range(1, 21)), kv_blocks=16)
    out: Outcomes = {}
    small, huge, after = req(max_tokens=5), req(max_tokens=20), req(max_tokens=5)
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=4) as rt, trio.open_nursery() as n:
            for r in (small, huge, after):
                await n.start(run_request, rt, r, out)
            await trio.sleep(0.025)
            assert engine.started == ids(small, after)  # no head-of-line blocking behind huge ...
            assert rt.request_state(huge.request_id) is RequestState.DISPATCHED
    assert engine.started == ids(small, after, huge)  # ... which runs alone once the pool is empty
    assert [len(out[r.request_id].tokens) for r in (small, huge, after)] == [5, 20, 5]  # type: ignore[union-attr]


async def test_a_request_waiting_for_kv_past_the_aging_time_is_not_passed_again(
        autojump_clock: trio.abc.Clock) -> None:
    # 16 blocks; each 5-token request holds 7. A 14-block request waits while short ones keep
    # arriving: for kv_aging_ms they go first, then nothing starts before it does.
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=list(range(1, 13)), kv_blocks=16)
    out: Outcomes = {}
    big = req(max_tokens=12)
    shorts = [req(max_tokens=5) for _ in range(12)]
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=4, kv_aging_ms=100) as rt, trio.open_nursery() as n:
            await n.start(run_request, rt, shorts[0], out)
            await n.start(run_request, rt, big, out)
            for r in shorts[1:]:  # a short one every 20 ms: without aging big would wait for all
                await trio.sleep(0.02)
                await n.start(run_request, rt, r, out)
    order = engine.started
    assert order.index(big.request_id) < order.index(shorts[-1].request_id)
    assert order.index(big.request_id) > order.index(shorts[1].request_id)  # some did pass it
    assert all(len(out[r.request_id].tokens) == 5 for r in shorts)  # type: ignore[union-attr]


async def test_cancel_while_waiting_for_kv_never_starts_it(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=[1, 2, 3, 4, 5], kv_blocks=8)
    out: Outcomes = {}
    running, victim, last = req(max_tokens=5), req(max_tokens=5), req(max_tokens=5)
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=4) as rt, trio.open_nursery() as n:
            await n.start(run_request, rt, running, out)
            async with trio.open_nursery() as inner:
                await inner.start(run_request, rt, victim, out)
                await n.start(run_request, rt, last, out)
                await trio.sleep(0.025)  # both reached the engine actor, and wait there
                assert rt.request_state(victim.request_id) is RequestState.DISPATCHED
                inner.cancel_scope.cancel()  # the caller goes away
            await trio.sleep(0.011)  # noticed at the end of the step under way
            assert rt.request_state(victim.request_id) is RequestState.CANCELLED
            assert rt.request_state(running.request_id) is RequestState.DECODING
    assert victim.request_id not in engine.started and victim.request_id not in out
    assert engine.started == ids(running, last)


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "no-drain"])
async def test_shutdown_settles_requests_waiting_for_kv(autojump_clock: trio.abc.Clock, drain: bool) -> None:
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=[1, 2, 3, 4, 5], kv_blocks=8)
    out: Outcomes = {}
    running, waiting = req(max_tokens=5), req(max_tokens=5)
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=2) as rt:
            async with trio.open_nursery() as n:
                for r in (running, waiting):
                    await n.start(run_request, rt, r, out)
                await trio.sleep(0.025)
                assert rt.request_state(waiting.request_id) is RequestState.DISPATCHED
                await rt.shutdown(drain=drain)
    if drain:
        assert engine.started == ids(running, waiting)
        assert all(out[r.request_id].tokens == [1, 2, 3, 4, 5] for r in (running, waiting))  # type: ignore[union-attr]
    else:
        assert engine.started == ids(running)
        assert isinstance(out[waiting.request_id], SchedulerShutdown)
        assert rt.request_state(waiting.request_id) is RequestState.CANCELLED


# -- streaming ----------------------------------------------------------------------------------
async def test_stream_yields_chunks_in_order_then_the_result(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=20, token_latency_ms=5, stream_tokens=[7, 8, 9])
    with trio.fail_after(CEILING_S):
        async with runtime(engine) as rt:
            async with rt.submit_stream(req(max_tokens=3)) as stream:
                chunks = [chunk async for chunk in stream]
            assert [c.token_id for c in chunks] == [7, 8, 9]
            assert [c.text for c in chunks] == ["<7>", "<8>", "<9>"]
            assert [c.index for c in chunks] == [0, 1, 2]
            result = stream.result
            assert result is not None
            assert (result.tokens, result.text, result.completion_tokens) == ([7, 8, 9], "<7><8><9>", 3)
            assert result.finish_reason == "length"
            assert stream.state is RequestState.DONE
            await settle()
            assert sample(rt, "tinyloop_first_token_ms_count") == 1
            assert sample(rt, "tinyloop_first_token_ms_sum") == pytest.approx(20)

            assert (await rt.submit(req())).tokens == [7, 8, 9]  # not a stream: no first-token sample
            await settle()
            assert sample(rt, "tinyloop_first_token_ms_count") == 1
            assert sample(rt, "tinyloop_requests_completed_total") == 2


async def test_next_burst_hands_over_every_chunk_that_piled_up(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=20, token_latency_ms=5, stream_tokens=[7, 8, 9, 10, 11])
    with trio.fail_after(CEILING_S):
        async with runtime(engine) as rt:
            async with rt.submit_stream(req(max_tokens=5)) as stream:
                await stream.start()
                await trio.sleep(1)  # a slow consumer: the engine finishes meanwhile
                burst = await stream.next_burst()
                assert [c.token_id for c in burst] == [7, 8, 9, 10, 11]
                assert stream.result is None  # the end is handed out by the next call
                assert await stream.next_burst() == []
            assert stream.result is not None and stream.result.tokens == [7, 8, 9, 10, 11]
            assert stream.state is RequestState.DONE

            engine.fail_with = None
            async with rt.submit_stream(req(max_tokens=5)) as stream:
                await stream.start()
                await trio.sleep(0.032)  # tokens at 20, 25, 30 ms; then every step fails
                engine.fail_with = EngineError("kernel failed")
                await trio.sleep(1)
                assert [c.token_id for c in await stream.next_burst()] == [7, 8, 9]
                with pytest.raises(EngineError, match="kernel failed"):
                    await stream.next_burst()
            assert stream.state is RequestState.ERROR


# -- shutdown -----------------------------------------------------------------------------------
async def test_shutdown_drains_queued_and_in_flight_requests(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    running, queued1, queued2 = req(), req(), req()
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            async with trio.open_nursery() as n:
                for r in (running, queued1, queued2):
                    await n.start(run_request, rt, r, out)
                await settle()
                n.start_soon(rt.shutdown)
                await settle()
                assert rt.statistics().shutting_down
                with pytest.raises(SchedulerShutdown):
                    await rt.submit(req())
                with pytest.raises(SchedulerShutdown):
                    await rt.register_prefix([1, 2])
            # The body goes on after shutdown: the runtime stopped its actors, not its caller.
            assert trio.current_time() == pytest.approx(0.3, abs=0.02)
            with pytest.raises(SchedulerShutdown):
                await rt.submit(req())  # also once the actors are gone
    assert engine.started == ids(running, queued1, queued2)
    assert all(isinstance(out[r.request_id], GenerationResult) for r in (running, queued1, queued2))


async def test_shutdown_drains_a_request_admitted_just_before_it(autojump_clock: trio.abc.Clock) -> None:
    # Right after admission answers, the ticket may still be in the channel to the queue actor
    # (Trio picks the order of runnable tasks at random): the drain must wait for it too.
    engine = FakeEngine(latency_ms=100)
    with trio.fail_after(CEILING_S):
        for _ in range(8):  # a few interleavings
            async with runtime(engine, max_batch_size=1) as rt:
                async with rt.submit_stream(req()) as stream:
                    await stream.start()
                    await rt.shutdown()
                    assert [c.token_id async for c in stream] == [1, 2, 3]
                assert stream.state is RequestState.DONE


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "no-drain"])
async def test_shutdown_answers_callers_still_waiting_for_admission(
        autojump_clock: trio.abc.Clock, drain: bool) -> None:
    engine = FakeEngine(latency_ms=100)
    with trio.fail_after(CEILING_S):
        for checkpoints in range(4):  # shut down at different points of the callers' admission
            out: Outcomes = {}
            async with runtime(engine, max_batch_size=2) as rt:
                async with trio.open_nursery() as n:
                    for _ in range(5):
                        n.start_soon(run_request, rt, req(), out)
                    for _ in range(checkpoints):
                        await trio.lowlevel.checkpoint()
                    await rt.shutdown(drain=drain)
            served = sum(isinstance(v, GenerationResult) for v in out.values())
            refused = sum(isinstance(v, SchedulerShutdown) for v in out.values())
            assert (len(out), served + refused) == (5, 5), out
            if not drain:
                assert served == 0


async def test_shutdown_without_drain_fails_queued_requests(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    running, queued1, queued2 = req(), req(), req()
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            async with trio.open_nursery() as n:
                for r in (running, queued1, queued2):
                    await n.start(run_request, rt, r, out)
                await settle()
                await rt.shutdown(drain=False)
            assert trio.current_time() <= 0.1 + 1e-9  # no request ran to completion
    assert engine.started == ids(running)
    for r in (running, queued1, queued2):
        assert isinstance(out[r.request_id], SchedulerShutdown), out[r.request_id]
        assert rt.request_state(r.request_id) is RequestState.CANCELLED


# -- metrics ------------------------------------------------------------------------------------
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


# -- aging, downgrade, batching -----------------------------------------------------------------
@pytest.mark.parametrize("aging_ms", [50.0, 0.0], ids=["aging", "no-aging"])
async def test_priority_aging_stops_starvation(autojump_clock: trio.abc.Clock, aging_ms: float) -> None:
    # One slot, 10 ms per request, a priority-1 request every 5 ms for 500 ms: the queue only
    # grows. A priority-0 request queued at 1 ms overtakes every high one that arrives more than
    # aging_ms after it, so with aging it runs after the 11 highs of the first 50 ms.
    engine = FakeEngine(latency_ms=10, stream_tokens=[1])
    out: Outcomes = {}
    highs = [req(max_tokens=1) for _ in range(100)]
    low = req(max_tokens=1)

    async def sustained_high_load() -> None:
        for r in highs:
            n.start_soon(partial(run_request, rt, r, out, priority=1))
            await trio.sleep(0.005)

    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1, priority_aging_ms=aging_ms) as rt:
            async with trio.open_nursery() as n:
                n.start_soon(sustained_high_load)
                await trio.sleep(0.001)
                await n.start(partial(run_request, rt, low, out, priority=0))
                await trio.sleep(0.499)  # the last high one arrives at 495 ms
                if aging_ms:
                    assert rt.request_state(low.request_id) is RequestState.DONE
                else:
                    assert rt.request_state(low.request_id) is RequestState.QUEUED
    position = engine.started.index(low.request_id)
    if aging_ms:
        assert 10 <= position <= 13
    else:
        assert position == len(highs)  # last: it starved for as long as highs kept coming
    assert all(isinstance(v, GenerationResult) for v in out.values()) and len(out) == 101


@pytest.mark.parametrize("downgrade", [True, False], ids=["downgrade", "no-downgrade"])
async def test_downgrade_on_admission(autojump_clock: trio.abc.Clock, downgrade: bool) -> None:
    # 3 tokens take 80 + 10 + 10 = 100 ms at any loops, so after the first request the predictor
    # holds 100 ms per request and 100 / (8 loops * 3 tokens) ms per loop-token: 12.5 ms per loop.
    engine = FakeEngine(latency_ms=80, token_latency_ms=10, default_loops=8)
    out: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1, downgrade_on_admission=downgrade) as rt:
            assert (await rt.submit(req())).loops_used == 8

            # Idle engine, SLO 55 ms: the wait (0) fits; 8 loops would take 100 ms, 4 take 50.
            result = await rt.submit(req(), slo_ms=55)
            assert result.loops_used == (4 if downgrade else 8)

            # An SLO not even 1 loop can meet: only the downgrade rule (wait + service) refuses.
            if downgrade:
                with pytest.raises(AdmissionRejected) as info:
                    await rt.submit(req(), slo_ms=10)
                assert info.value.predicted_wait_ms == 0
            else:
                assert (await rt.submit(req(), slo_ms=10)).loops_used == 8

            # A wait longer than the SLO is refused either way: fewer loops do not shorten it.
            async with trio.open_nursery() as n:
                await n.start(run_request, rt, req(), out)
                await settle()
                with pytest.raises(AdmissionRejected) as info:
                    await rt.submit(req(), slo_ms=55)
                assert info.value.predicted_wait_ms == pytest.approx(100)


async def test_downgrade_respects_the_min_loops_floor(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=80, token_latency_ms=10, default_loops=8)
    with trio.fail_after(CEILING_S):
        async with runtime(engine, downgrade_on_admission=True, downgrade_min_loops=6) as rt:
            await rt.submit(req())
            assert (await rt.submit(req(), slo_ms=80)).loops_used == 6  # 6 * 12.5 = 75 <= 80
            with pytest.raises(AdmissionRejected):
                await rt.submit(req(), slo_ms=55)  # 4 loops would fit, but 6 is the floor


@pytest.mark.parametrize("needs", [
    {"mode": "speculative", "draft_loops": 6},
    {"mode": "tree", "draft_loops": 6, "cache_window": 8},
    {"exit": ExitRule("latent_diff", 0.1, min_loops=6)},
], ids=["speculative", "tree-full-window", "exit-min-loops"])
async def test_downgrade_stays_at_or_above_what_the_request_needs(
        autojump_clock: trio.abc.Clock, needs: dict[str, Any]) -> None:
    # Settings floor 1; 12.5 ms per loop as above. The request cannot run below 6 loops.
    engine = FakeEngine(latency_ms=80, token_latency_ms=10, default_loops=8)
    with trio.fail_after(CEILING_S):
        async with runtime(engine, downgrade_on_admission=True) as rt:
            await rt.submit(req())
            assert (await rt.submit(req(**needs), slo_ms=80)).loops_used == 6  # 75 ms <= 80
            with pytest.raises(AdmissionRejected):
                await rt.submit(req(**needs), slo_ms=55)  # 4 loops would fit, the request needs 6
            assert (await rt.submit(req(), slo_ms=55)).loops_used == 4  # a plain one goes lower


@pytest.mark.parametrize("slots", [4, 1])
async def test_continuous_batching(autojump_clock: trio.abc.Clock, slots: int) -> None:
    engine = FakeEngine(latency_ms=50, token_latency_ms=10)
    out: Outcomes = {}
    requests = [req() for _ in range(4)]
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=slots) as rt:
            async with trio.open_nursery() as n:
                for r in requests:
                    n.start_soon(run_request, rt, r, out)
            await settle()
            assert sample(rt, "tinyloop_batch_size_count") == len(engine.batches)
    assert [getattr(out[r.request_id], "tokens", None) for r in requests] == [[1, 2, 3]] * 4
    if slots == 4:
        assert max(engine.batches) == 4
        assert trio.current_time() < 4 * 0.070  # faster than one at a time
    else:
        assert engine.batches == [1] * 12  # 4 requests x 3 steps, never two at once
        assert trio.current_time() == pytest.approx(4 * 0.070)


# -- lifecycle ----------------------------------------------------------------------------------
async def test_request_state_follows_the_lifecycle(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100, token_latency_ms=10)
    out: Outcomes = {}
    a, b, c = req(), req(), req()
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=2) as rt:
            assert rt.request_state("no-such-request") is None
            async with trio.open_nursery() as n:
                await n.start(run_request, rt, a, out)
                await settle()
                assert rt.request_state(a.request_id) is RequestState.DECODING  # its first step runs
                await trio.sleep(0.010)
                await n.start(run_request, rt, b, out)  # gets the second slot...
                await n.start(run_request, rt, c, out)  # ...and c waits for one
                await settle()
                # b is dispatched but joins the batch only when a's running step ends (t=100).
                assert rt.request_state(b.request_id) is RequestState.DISPATCHED
                assert rt.request_state(c.request_id) is RequestState.QUEUED
                assert (rt.statistics().in_flight, rt.statistics().queue_depth) == (2, 1)
                await trio.sleep(0.100)  # t=110: b prefills with a in one step
                assert rt.request_state(b.request_id) is RequestState.DECODING
                assert rt.request_state(c.request_id) is RequestState.QUEUED
                await until(lambda: rt.request_state(a.request_id) is RequestState.DONE)
                assert rt.request_state(c.request_id) in (RequestState.DISPATCHED, RequestState.DECODING)
            assert [rt.request_state(r.request_id) for r in (a, b, c)] == [RequestState.DONE] * 3
            assert "queued=0 in_flight=0/2 healthy" in repr(rt)


# -- fairness and what the metrics count -------------------------------------------------------
async def test_a_beam_search_takes_one_slot_per_beam(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=[1, 2, 3, 4, 5])
    out: Outcomes = {}
    wide = req(max_tokens=5, mode="beam", num_beams=3)
    others = [req(max_tokens=5) for _ in range(3)]
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=4) as rt, trio.open_nursery() as n:
            await n.start(run_request, rt, wide, out)
            for r in others:
                await n.start(run_request, rt, r, out)
            await trio.sleep(0.025)
            assert engine.started == ids(wide, others[0])  # 3 + 1 slots of 4
            assert [rt.request_state(r.request_id) for r in others[1:]] == [RequestState.QUEUED] * 2
    assert all(len(out[r.request_id].tokens) == 5 for r in [wide, *others])  # type: ignore[union-attr]


async def test_a_request_cancelled_before_the_engine_records_no_queue_wait_or_dispatch_time(
        autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=10, token_latency_ms=10, stream_tokens=[1, 2, 3, 4, 5], kv_blocks=8)
    out: Outcomes = {}
    running, victim = req(max_tokens=5), req(max_tokens=5)
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=4) as rt, trio.open_nursery() as n:
            await n.start(run_request, rt, running, out)
            async with rt.submit_stream(victim) as stream:
                await stream.start()
                await until(lambda: rt.request_state(victim.request_id) is RequestState.DISPATCHED)
            await until(lambda: rt.request_state(victim.request_id) is RequestState.CANCELLED)
            await settle()
            counts = exposition(rt)
            assert counts["tinyloop_queue_wait_ms_count"] == 1  # the running one only
            assert counts["tinyloop_dispatch_ms_count"] == 0  # the running one has not ended
            assert counts["tinyloop_requests_cancelled_total"] == 1


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
