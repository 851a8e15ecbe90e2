"""Shutdown: drained or not, callers still waiting for admission, the cascade through the actors.

On FakeEngine and the ``autojump_clock`` (``tests/actors/support.py`` says why)."""

from __future__ import annotations

import pytest
import trio

from tests.actors.support import CEILING_S, Outcomes, ids, req, run_request, runtime, settle
from tinyloop import GenerationRequest, GenerationResult, RequestState, Runtime, SchedulerShutdown
from tinyloop.testing import FakeEngine


async def one_running_two_queued(rt: Runtime, n: trio.Nursery, out: Outcomes) -> tuple[GenerationRequest, ...]:
    """Three requests on ``max_batch_size`` 1: the first runs, two wait in the queue."""
    reqs = req(), req(), req()
    for r in reqs:
        await n.start(run_request, rt, r, out)
    await settle()
    return reqs


async def test_shutdown_drains_queued_and_in_flight_requests(autojump_clock: trio.abc.Clock) -> None:
    engine = FakeEngine(latency_ms=100)
    out: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            async with trio.open_nursery() as n:
                running, queued1, queued2 = await one_running_two_queued(rt, n, out)
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
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            async with trio.open_nursery() as n:
                running, queued1, queued2 = await one_running_two_queued(rt, n, out)
                await rt.shutdown(drain=False)
            assert trio.current_time() <= 0.1 + 1e-9  # no request ran to completion
    assert engine.started == ids(running)
    for r in (running, queued1, queued2):
        assert isinstance(out[r.request_id], SchedulerShutdown), out[r.request_id]
        assert rt.request_state(r.request_id) is RequestState.CANCELLED


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "no-drain"])
async def test_shutdown_cascades_through_the_actors_without_polling(
        autojump_clock: trio.abc.Clock, drain: bool) -> None:
    """Each actor ends when its inbox ends: shutdown returns the moment the last request settles
    (no polling interval on the clock), every actor returned on its own (none was cancelled),
    and a late submission is refused."""
    engine = FakeEngine(latency_ms=7, stream_tokens=[1])
    out: Outcomes = {}
    with trio.fail_after(CEILING_S):
        async with runtime(engine, max_batch_size=1) as rt:
            async with trio.open_nursery() as n:
                for r in (req(1), req(1)):
                    await n.start(run_request, rt, r, out)
                await rt.shutdown(drain=drain)
                stopped = trio.current_time()
            assert stopped == pytest.approx(0.014 if drain else 0.007)
            assert not rt._actors.cancel_called
            with pytest.raises(SchedulerShutdown):
                await rt.submit(req())
    assert [type(o).__name__ for o in out.values()] == (
        ["GenerationResult"] * 2 if drain else ["SchedulerShutdown"] * 2)
