"""Each engine's model work on its own stream (``engine/device_stream.py``), checked on the CPU.

The CPU has no streams, so these tests stand recording streams in for CUDA's: they check that
every forward of an engine (prefill, decode, a speculative draft and its verify, beam, a prefix
entry, the decode graphs' warm-up) runs while the engine's stream is current, that the engine's
stream waits for the caller before and the caller for it after, and that replicas get streams of
their own. The real streams run in ``tests/cuda/test_cuda_gpu.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.engine.test_engine import make_engine, req
from tinyloop.engine import device_stream
from tinyloop.engine import engine as engine_module
from tinyloop.engine.device_stream import new_stream, on_stream
from tinyloop.engine.graphs import DecodeGraphs
from tinyloop.requests import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FakeStream:
    """A stream that records what it was asked to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[str] = []

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other.name)


class FakeCuda:
    """``torch.cuda.current_stream`` and ``torch.cuda.stream`` over FakeStreams."""

    def __init__(self) -> None:
        self.current = FakeStream("caller")

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(device_stream.torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(device_stream.torch.cuda, "stream", fake.stream)
    return fake


def recorded(obj: Any, method: str, cuda: FakeCuda) -> list[str]:
    """The current stream's name at each call of ``obj.method`` from now on."""
    seen: list[str] = []
    inner = getattr(obj, method)

    def call(*args: Any, **kwargs: Any) -> Any:
        seen.append(cuda.current.name)
        return inner(*args, **kwargs)

    setattr(obj, method, call)
    return seen


def test_every_forward_of_every_mode_runs_on_the_engines_stream(cuda: FakeCuda) -> None:
    engine = make_engine(max_seq_len=128, block_size=8)
    engine.stream = FakeStream("engine")
    seen = recorded(engine.model, "forward", cuda)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    requests = [req([5, 6, 7, 8], sampling=greedy, max_tokens=4),
                req([5, 6, 7], sampling=SamplingParams(temperature=0.8, seed=1, ignore_eos=True), max_tokens=4),
                req([9, 10, 11], sampling=greedy, max_tokens=4, mode="speculative", draft_ahead=2),
                req([9, 10, 11], sampling=greedy, max_tokens=4, mode="tree", draft_ahead=2, k_branches=2),
                req([9, 10], sampling=greedy, max_tokens=4, mode="beam", num_beams=2)]
    results = engine.generate_many(requests)
    assert all(len(r.tokens) == 4 for r in results)
    entry = engine.prefill_prefix([1, 2, 3, 4, 5])
    engine.free(entry)
    assert len(seen) > 10 and set(seen) == {"engine"}  # prefill, decode, drafts, verify, beam, prefix
    assert cuda.current.name == "caller"  # the caller's stream is current again after each call
    assert engine.stream.waited and set(engine.stream.waited) == {"caller"}
    assert len(cuda.current.waited) == len(engine.stream.waited)  # one wait each way per outer call


def test_the_same_tokens_with_and_without_a_stream(cuda: FakeCuda) -> None:
    """The stream changes where the work queues, nothing it computes."""
    requests = [req([5, 6, 7, 8], sampling=SamplingParams(temperature=0.7, seed=4, ignore_eos=True), max_tokens=6),
                req([9, 10, 11], sampling=SamplingParams(temperature=0, ignore_eos=True), max_tokens=6,
                    mode="speculative", draft_ahead=3)]
    plain = make_engine(max_seq_len=128, block_size=8)
    streamed = make_engine(max_seq_len=128, block_size=8)
    streamed.stream = FakeStream("engine")
    assert [r.tokens for r in streamed.generate_many(requests)] == [r.tokens for r in plain.generate_many(requests)]


def test_a_nested_call_stays_on_the_stream_without_waiting(cuda: FakeCuda) -> None:
    class Worker:
        device = torch.device("cpu")

        def __init__(self) -> None:
            self.stream = FakeStream("engine")

        @on_stream
        def outer(self) -> str:
            return self.inner() + cuda.current.name

        @on_stream
        def inner(self) -> str:
            return cuda.current.name + "/"

    worker = Worker()
    assert worker.outer() == "engine/engine"
    assert worker.stream.waited == ["caller"] and cuda.current.waited == ["engine"]
    worker.stream = None  # the CPU: the method runs as it is
    assert worker.outer() == "caller/caller"
    assert cuda.current.waited == ["engine"]


def test_replicas_and_their_graphs_get_streams_of_their_own(cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[FakeStream] = []

    def fake_new_stream(device: torch.device) -> FakeStream:
        made.append(FakeStream(f"engine{len(made)}"))
        return made[-1]

    monkeypatch.setattr(engine_module, "new_stream", fake_new_stream)
    engine = make_engine(max_seq_len=64, block_size=8)
    twin = engine.replica()
    assert [engine.stream, twin.stream] == made and made[0] is not made[1]
    graphs = DecodeGraphs.of(twin, capture=False, max_rows=2)
    assert graphs.stream is twin.stream
    seen = recorded(twin.model, "embed_prelude", cuda)
    assert graphs.capture_ahead(2, rows=2) == 2  # buckets 1 and 2, their warm-up on the twin's stream
    assert seen == ["engine1", "engine1"]


def test_no_stream_off_cuda() -> None:
    assert new_stream(torch.device("cpu")) is None
    assert make_engine(max_seq_len=64, block_size=8).stream is None
