"""KV planning in the engine actor: requests wait (state dispatched) until their KV fits.

On FakeEngine and the ``autojump_clock`` (``tests/actors/support.py`` says why)."""

from __future__ import annotations

import pytest
import trio

from tests.actors.support import CEILING_S, Outcomes, exposition, ids, req, run_request, runtime, until
from tinyloop import RequestState, SchedulerShutdown
from tinyloop.testing import FakeEngine


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
