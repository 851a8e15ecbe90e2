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
