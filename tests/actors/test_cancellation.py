"""Cancellation by the caller: queued, decoding, before the engine; streams and their bursts.

On FakeEngine and the ``autojump_clock`` (``tests/actors/support.py`` says why)."""

from __future__ import annotations

import pytest
import trio

from tests.actors.support import CEILING_S, Outcomes, exposition, ids, req, run_request, runtime, sample, settle, until
from tinyloop import EngineError, GenerationResult, RequestState
from tinyloop.testing import FakeEngine


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
