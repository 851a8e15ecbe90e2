"""A client that goes away cancels its request: running ones leave the batch and free their KV,
queued ones leave the queue (peers have regressed on this: work kept running for nobody).

Each request asks for 2000 tokens with ``ignore_eos`` on a 4096-token context, so it cannot
finish by itself within the test.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from tests.http.conftest import LiveServer, running_server, tiny_engine
from tinyloop.actors.stream import RequestStream
from tinyloop.requests import RequestState
from tinyloop.settings import Settings

LONG = {"max_tokens": 2000, "ignore_eos": True}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], **LONG},
    "/v1/completions": {"prompt": "hi", **LONG},
    "/api/v0/chat/completions": {"messages": [{"role": "user", "content": "hi"}], **LONG},
    "/generate": {"prompt": "hi", **LONG},
}


def record_streams(srv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[RequestStream]:
    """Every RequestStream the server submits from now on (to ask the runtime about its id)."""
    streams: list[RequestStream] = []
    submit = srv.runtime.submit_stream

    def spy(*args: Any, **kwargs: Any) -> RequestStream:
        stream = submit(*args, **kwargs)
        streams.append(stream)
        return stream

    monkeypatch.setattr(srv.runtime, "submit_stream", spy)
    return streams


async def wait_for(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await trio.sleep(0.01)


async def read_events(resp: httpx.Response, n: int) -> list[str]:
    """Read ``n`` SSE events, then stop by cancelling the read: httpcore then drops the
    connection, and no half-iterated httpx generator is left for the GC."""
    events: list[str] = []
    with trio.CancelScope() as scope:
        async for line in resp.aiter_lines():  # (lines already read come out after the cancel: a burst's)
            if line.startswith("data: ") and len(events) < n:
                events.append(line.removeprefix("data: "))
                if len(events) == n:
                    scope.cancel()
    return events


def cancelled_total(srv: LiveServer) -> float | None:
    return srv.runtime.metrics.registry.get_sample_value("tinyloop_requests_cancelled_total")


def assert_all_freed(srv: LiveServer) -> None:
    stats = srv.runtime.statistics()
    assert (stats.in_flight, stats.queue_depth) == (0, 0)
    assert srv.engine.kv_statistics().blocks_used == 0


@pytest.mark.parametrize("path", list(BODIES))
async def test_disconnect_mid_stream_cancels_the_request_and_frees_its_kv(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(30):
        async with (running_server(Settings(port=0), tiny_engine(max_seq_len=4096)) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=30) as client):
            streams = record_streams(srv, monkeypatch)
            async with client.stream("POST", path, json={**BODIES[path], "stream": True}) as resp:
                assert resp.status_code == 200
                events = await read_events(resp, 3)
                assert len(events) == 3 and "[DONE]" not in events
                assert srv.engine.kv_statistics().blocks_used > 0
            with trio.fail_after(10):
                await wait_for(lambda: srv.runtime.statistics().in_flight == 0)
                await wait_for(lambda: cancelled_total(srv) == 1)
            [stream] = streams
            assert srv.runtime.request_state(stream.request_id) is RequestState.CANCELLED
            assert_all_freed(srv)
            # The server is fine afterwards.
            ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


async def test_disconnect_while_queued_removes_the_request_from_the_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(port=0, max_batch_size=1)
    with trio.fail_after(30):
        async with (running_server(settings, tiny_engine(max_seq_len=4096)) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=30) as client):
            streams = record_streams(srv, monkeypatch)
            body = {**BODIES["/v1/completions"], "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as running:
                await wait_for(lambda: srv.runtime.statistics().in_flight == 1)
                async with client.stream("POST", "/v1/completions", json=body) as waiting:
                    assert waiting.status_code == 200  # admitted: headers go out before it runs
                    await wait_for(lambda: srv.runtime.statistics().queue_depth == 1)
                    assert srv.runtime.request_state(streams[1].request_id) is RequestState.QUEUED
                await wait_for(lambda: srv.runtime.statistics().queue_depth == 0)
                assert srv.runtime.request_state(streams[1].request_id) is RequestState.CANCELLED
                assert srv.runtime.statistics().dispatched == 1  # it never ran
                assert srv.runtime.request_state(streams[0].request_id) is RequestState.DECODING
                await read_events(running, 1)
            await wait_for(lambda: srv.runtime.statistics().in_flight == 0)
            await wait_for(lambda: cancelled_total(srv) == 2)
            assert srv.runtime.request_state(streams[0].request_id) is RequestState.CANCELLED
            assert_all_freed(srv)


async def test_client_giving_up_on_a_non_streamed_request_cancels_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(30):
        async with (running_server(Settings(port=0), tiny_engine(max_seq_len=4096)) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=30) as client):
            streams = record_streams(srv, monkeypatch)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(client.post, "/v1/completions", json=BODIES["/v1/completions"]))
                await wait_for(lambda: srv.runtime.statistics().in_flight == 1)
                nursery.cancel_scope.cancel()  # the client stops waiting and drops the connection
            await wait_for(lambda: srv.runtime.statistics().in_flight == 0)
            await wait_for(lambda: cancelled_total(srv) == 1)
            assert srv.runtime.request_state(streams[0].request_id) is RequestState.CANCELLED
            assert_all_freed(srv)
