"""Connections end when HTTP says they do (fault 4 of issue 11).

hypercorn's trio worker closes or recycles a connection inside the app's last ``send``, and
quart-trio used to cancel that ``send`` half way: ``Connection: close`` and HTTP/1.0 responses
left the socket open, the keep-alive idle timer never ran, and shutdown waited the whole
graceful timeout for one idle client. Each case here is a raw socket on a real hypercorn.
"""

from __future__ import annotations

import json

import trio

from tests.http.conftest import running_server
from tests.reliability.rawhttp import (
    connect,
    host_of,
    read_one_response,
    read_until_closed,
    request,
    status_of,
    stoppable_server,
)
from tinyloop.settings import Settings

CLOSE_S = 10  # generous: a closing server does it in milliseconds; the old one never did
STREAM = json.dumps({"prompt": "hi", "max_tokens": 5, "ignore_eos": True, "stream": True}).encode()


async def test_connection_close_is_honoured() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, connect(srv.url) as sock:
            await sock.send_all(request("GET", "/healthz", host_of(srv.url), Connection="close"))
            data, closed = await read_until_closed(sock, CLOSE_S)
    assert status_of(data) == 200 and data.endswith(b"ok\n"), data
    assert closed, "the server kept a 'Connection: close' connection open"


async def test_an_http_1_0_request_is_closed_after_its_response() -> None:
    with trio.fail_after(60):
        async with running_server() as srv, connect(srv.url) as sock:
            await sock.send_all(request("GET", "/v1/models", host_of(srv.url), version="1.0"))
            data, closed = await read_until_closed(sock, CLOSE_S)
    assert status_of(data) == 200 and b'"object":"list"' in data.replace(b" ", b""), data
    assert closed, "the server kept an HTTP/1.0 connection open"


async def test_an_http_1_0_stream_ends_with_done_and_a_close() -> None:
    # HTTP/1.0 has no chunked coding: the close is what ends the body.
    with trio.fail_after(60):
        async with running_server() as srv, connect(srv.url) as sock:
            await sock.send_all(request("POST", "/v1/completions", host_of(srv.url), STREAM, version="1.0"))
            data, closed = await read_until_closed(sock, CLOSE_S)
    assert status_of(data) == 200, data
    assert closed, "an HTTP/1.0 SSE stream never ended"
    assert data.rstrip().endswith(b"data: [DONE]"), data[-200:]


async def test_an_idle_keep_alive_connection_is_closed_after_the_timeout() -> None:
    settings = Settings(port=0, keep_alive_timeout=1.0)
    with trio.fail_after(60):
        async with running_server(settings) as srv, connect(srv.url) as sock:
            for _ in range(2):  # kept alive between requests
                await sock.send_all(request("GET", "/healthz", host_of(srv.url)))
                assert status_of(await read_one_response(sock)) == 200
            rest, closed = await read_until_closed(sock, 20 * settings.keep_alive_timeout)
    assert closed and rest == b"", "an idle keep-alive connection outlived its timeout"


async def test_shutdown_does_not_wait_the_graceful_timeout_for_an_idle_client() -> None:
    # Neither timeout may end it: only the shutdown closing the idle connection at once can.
    settings = Settings(port=0, keep_alive_timeout=120, graceful_timeout=120)
    with trio.fail_after(60):
        async with stoppable_server(settings) as srv, connect(srv.url) as sock:
            await sock.send_all(request("GET", "/healthz", host_of(srv.url)))
            assert status_of(await read_one_response(sock)) == 200
            srv.stop.set()
            with trio.fail_after(20):
                await srv.stopped.wait()
            _, closed = await read_until_closed(sock, CLOSE_S)
    assert closed
