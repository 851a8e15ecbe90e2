"""Dispatch order: priority, FIFO within a priority, aging, continuous batching, beam slots, and a request's states.

On FakeEngine and the ``autojump_clock`` (``tests/actors/support.py`` says why)."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from tests.actors.support import CEILING_S, Outcomes, ids, req, run_request, runtime, sample, settle, until
from tinyloop import GenerationResult, RequestState
from tinyloop.testing import FakeEngine


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
