"""A stream still running when the graceful timeout ends is told so (fault 10 of issue 11).

hypercorn cancels every connection ``graceful_timeout`` seconds after shutdown begins; the
stream used to end there with a bare TCP close. Shortly before that deadline the SSE writer now
sends an error event (``shutting down``, the object ``sse_guard`` sends for any failure) and
``[DONE]``, and cancels the request.
"""

from __future__ import annotations

import json

import trio

from tests.http.test_ops import fake_model
from tests.reliability.rawhttp import connect, host_of, read_until_closed, request, stoppable_server
from tinyloop.settings import Settings
from tinyloop.testing import FakeEngine

GRACE_S = 2.0


async def test_a_stream_cut_by_the_graceful_timeout_gets_an_error_event_and_done() -> None:
    # 2000 tokens at 20 ms each outlast the graceful timeout many times over.
    engine = FakeEngine(latency_ms=10, token_latency_ms=20, stream_tokens=list(range(1, 2001)),
                        max_seq_len=4096)
    settings = Settings(port=0, graceful_timeout=GRACE_S)
    body = json.dumps({"prompt": "hi", "max_tokens": 2000, "stream": True}).encode()
    with trio.fail_after(60):
        async with stoppable_server(settings, engine, fake_model()) as srv, connect(srv.url) as sock:
            await sock.send_all(request("POST", "/v1/completions", host_of(srv.url), body))
            first = await sock.receive_some(65536)
            assert b" 200 " in first.split(b"\r\n", 1)[0], first
            srv.stop.set()
            rest, closed = await read_until_closed(sock, 10 * GRACE_S)
            with trio.fail_after(20):
                await srv.stopped.wait()
    assert closed
    events = [line.removeprefix(b"data: ") for line in (first + rest).split(b"\n")
              if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"], error
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert len(events) > 10  # tokens flowed until the cut
    assert engine.live == 0  # the request was cancelled, not left running
