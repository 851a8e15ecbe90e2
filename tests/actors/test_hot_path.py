"""Work per request and per token on the runtime's hot path, counted (never timed)."""

from __future__ import annotations

from collections import Counter

import pytest
import trio

import tinyloop.actors.runtime as runtime_module
from tinyloop.actors import metrics as metrics_actor
from tinyloop.actors.chute import Chute
from tinyloop.actors.runtime import open_runtime
from tinyloop.messages import Admitted, Finished, Started, StepDone
from tinyloop.metrics import Metrics
from tinyloop.requests import GenerationRequest, GenerationResult, RequestState
from tinyloop.settings import Settings
from tinyloop.testing import FakeEngine


async def test_no_channel_is_opened_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission answers on the ticket's own Chute: once the runtime runs, submitting requests
    (plain and streamed) opens no trio memory channel at all."""
    opened = Counter[str]()
    real = trio.open_memory_channel

    class Counting:
        def __getitem__(self, _: object) -> Counting:
            return self

        def __call__(self, size: float) -> object:
            opened["channels"] += 1
            return real(size)

    engine = FakeEngine(latency_ms=0, stream_tokens=[1, 2, 3])
    with trio.fail_after(10):
        async with open_runtime(engine, Settings(max_batch_size=4)) as rt:
            monkeypatch.setattr(trio, "open_memory_channel", Counting())
            monkeypatch.setattr(runtime_module.trio, "open_memory_channel", Counting())

            async def one() -> None:
                await rt.submit(GenerationRequest(prompt_tokens=(1,), max_tokens=3))
                async with rt.submit_stream(GenerationRequest(prompt_tokens=(1,), max_tokens=3)) as s:
                    await s.start()
                    assert [c.token_id async for c in s] == [1, 2, 3]

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
    assert opened["channels"] == 0


class _Steps(trio.abc.Instrument):
    """Counts each task's steps (a step: the task ran from one wake-up to its next wait)."""

    def __init__(self) -> None:
        self.by_task = Counter[str]()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.by_task[task.name] += 1


async def test_a_request_wakes_its_caller_once_and_the_actors_once_per_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """16 callers submitting one-token requests back to back (bench/overhead.py's in-process
    row): admission decides in the caller's task, and the actors pass a wake-up's worth of
    tickets per message, so the engine runs full batches, each caller takes about one step per
    request, and the actors' steps and channel messages are spread over a batch. Before: 2
    caller steps, 3.4 actor steps and 5.6 messages per request, batches of 3.4."""
    callers, each, batch = 16, 20, 16
    engine = FakeEngine(latency_ms=0, stream_tokens=[1])
    steps = _Steps()
    sent = Counter[str]()
    real_send_nowait = trio.MemorySendChannel.send_nowait

    def counting_send_nowait(self: trio.MemorySendChannel[object], value: object) -> None:
        sent[type(value).__name__] += 1  # trio's send() goes through send_nowait: counted once
        real_send_nowait(self, value)

    async def caller(n: int) -> None:
        for _ in range(n):
            await rt.submit(GenerationRequest(prompt_tokens=(1,), max_tokens=1))

    async def run(n: int) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(callers):
                nursery.start_soon(caller, n)

    with trio.fail_after(30):
        async with open_runtime(engine, Settings(max_batch_size=batch)) as rt:
            await run(2)  # warm up
            engine.batches.clear()
            monkeypatch.setattr(trio.MemorySendChannel, "send_nowait", counting_send_nowait)
            trio.lowlevel.add_instrument(steps)
            try:
                await run(each)
            finally:
                trio.lowlevel.remove_instrument(steps)
                monkeypatch.undo()
    requests = callers * each
    caller_steps = sum(n for name, n in steps.by_task.items() if name.endswith(".caller"))
    actor_steps = sum(n for name, n in steps.by_task.items() if name.startswith("tinyloop.actors."))
    assert sum(engine.batches) == requests
    assert requests / len(engine.batches) >= batch / 2, engine.batches  # now 16
    assert caller_steps / requests <= 1.5, steps.by_task  # now 1.05
    assert actor_steps / requests <= 1.0, steps.by_task  # now 0.66
    assert sum(sent.values()) / requests <= 2.0, sent  # now 1.4: an Enqueue each, the rest per batch
    assert "Admit" not in sent and sent["Dispatch"] < requests / 4, sent


def _events(n: int) -> list[object]:
    result = GenerationResult(tokens=[1], text="<1>", finish_reason="length", prompt_tokens=1,
                              completion_tokens=1, wall_ms=3.0, loops_used=8, mean_loops=8.0)
    out: list[object] = [Admitted(n)]
    for i in range(n):
        out += [Started(0.5 * i, 2, i % 2), StepDone(1 + i % 5, 1),
                Finished(RequestState.DONE, 3.0 + 40 * i, 2.0 + i, result)]
    return out


def test_a_batch_moves_each_series_once_and_renders_as_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    one_by_one, batched = Metrics(), Metrics()
    for event in _events(50):
        metrics_actor.record(one_by_one, event)  # type: ignore[arg-type]

    calls = Counter[str]()
    from prometheus_client import values
    real_inc = values.MutexValue.inc

    def counting_inc(self: values.MutexValue, amount: float) -> None:
        calls["inc"] += 1
        real_inc(self, amount)

    monkeypatch.setattr(values.MutexValue, "inc", counting_inc)
    tally = metrics_actor.Tally()
    for event in _events(50):
        tally.add(event)  # type: ignore[arg-type]
    tally.flush(batched)
    assert batched.render() == one_by_one.render()
    # 50 requests, 50 steps: one inc per counter and per histogram bucket touched and sum, far
    # below one call per event (200 events moved ~450 values one by one)
    assert calls["inc"] <= 60, calls


async def test_chute_contract() -> None:
    chute: Chute[int] = Chute()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            got: list[int] = []

            async def read() -> None:
                while True:
                    try:
                        got.append(await chute.receive())
                    except trio.EndOfChannel:
                        return

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            chute.send_nowait(1)  # straight to the waiting reader
            chute.send_nowait(2)
            chute.close()
            chute.close()  # idempotent
        assert got == [1, 2]
    with pytest.raises(trio.ClosedResourceError):
        chute.send_nowait(3)
    with pytest.raises(trio.EndOfChannel):
        chute.receive_nowait()

    # a cancelled reader leaves no waiter behind; a closed reader refuses later items
    chute = Chute()
    with trio.move_on_after(0.01):
        await chute.receive()
    chute.send_nowait(4)
    assert chute.receive_nowait() == 4
    with pytest.raises(trio.WouldBlock):
        chute.receive_nowait()
    chute.close_receiver()
    with pytest.raises(trio.BrokenResourceError):
        chute.send_nowait(5)


async def test_request_state_remembers_live_requests_and_the_last_ended_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry keeps live tickets and only the state of ended ones (the last
    ``_KEEP_STATES``): a request still running is never forgotten, however many pass it."""
    monkeypatch.setattr(runtime_module, "_KEEP_STATES", 50)
    engine = FakeEngine(latency_ms=0, stream_tokens=[1] * 10_000, max_seq_len=20_000)
    with trio.fail_after(10):
        async with open_runtime(engine, Settings(max_batch_size=4)) as rt:
            slow = rt.submit_stream(GenerationRequest(prompt_tokens=(1,), max_tokens=10_000))
            await slow.start()  # a token per step: it outlives the 300 below (a few steps each)
            done = [GenerationRequest(prompt_tokens=(1,), max_tokens=1) for _ in range(300)]
            for r in done:
                await rt.submit(r)
            assert rt.request_state(slow.request_id) is RequestState.DECODING
            states = [rt.request_state(r.request_id) for r in done]
            assert states[-50:] == [RequestState.DONE] * 50
            assert states[0] is None  # forgotten
            assert len(rt._live) + len(rt._ended) <= 2 * 50 + 300 // 2
            await slow.aclose()
