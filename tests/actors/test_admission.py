"""Admission: the queue cap, the SLO and its EMA predictor, downgrade on admission.

On FakeEngine and the ``autojump_clock`` (``tests/actors/support.py`` says why)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio

from tests.actors.support import CEILING_S, Outcomes, ids, req, run_request, runtime, sample, settle
from tinyloop import AdmissionRejected, GenerationResult, QueueFullError, RequestState
from tinyloop.testing import FakeEngine
from tinyloop.vocabulary import ExitRule


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
