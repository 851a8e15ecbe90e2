"""Engine errors: a failed step, a refused request, a broken engine.

On FakeEngine and the ``autojump_clock`` (``tests/actors/support.py`` says why)."""

from __future__ import annotations

import pytest
import trio

from tests.actors.support import CEILING_S, Outcomes, req, run_request, runtime, sample, settle
from tinyloop import EngineBroken, EngineError, GenerationResult, RequestError, RequestState, SchedulerShutdown
from tinyloop.testing import FakeEngine


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
