"""Ambiguous framing and protocol errors (fault 6 of issue 11), through a raw socket.

A request with both ``Content-Length`` and ``Transfer-Encoding`` was framed by the chunked
coding and the connection kept open, so the bytes after the chunked body were served as a
second request. It is now a 400 error object and a close (RFC 9112 section 6.1). What h11
cannot parse (400, 431, 501) carries the same error object instead of an empty body.
"""

from __future__ import annotations

import trio

from tests.http.conftest import running_server
from tests.reliability.rawhttp import connect, error_of, host_of, read_until_closed, status_of

CLOSE_S = 10


async def exchange(raw: bytes) -> tuple[bytes, bool]:
    with trio.fail_after(60):
        async with running_server() as srv, connect(srv.url) as sock:
            await sock.send_all(raw.replace(b"HOST", host_of(srv.url).encode()))
            return await read_until_closed(sock, CLOSE_S)


async def test_content_length_with_transfer_encoding_is_refused_and_closed() -> None:
    body = b'{"prompt": "hi", "max_tokens": 1}'
    smuggled = b"GET /metrics HTTP/1.1\r\nHost: HOST\r\n\r\n"
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: HOST\r\nContent-Type: application/json\r\n"
           b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n" + smuggled)
    data, closed = await exchange(raw)
    assert status_of(data) == 400, data
    assert data.count(b"HTTP/1.1 ") == 1 and b"tinyloop_" not in data, "a smuggled request was served"
    assert error_of(data)["code"] == "ambiguous_framing"
    assert closed


async def test_protocol_errors_carry_the_error_object() -> None:
    cases = {
        400: b"NOT HTTP AT ALL\r\n\r\n",
        431: b"GET /healthz HTTP/1.1\r\nHost: HOST\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
        501: b"POST /v1/completions HTTP/1.1\r\nHost: HOST\r\nTransfer-Encoding: gzip\r\n\r\n",
    }
    for status, raw in cases.items():
        data, closed = await exchange(raw)
        assert status_of(data) == status, data[:200]
        assert error_of(data)["type"] and closed, data
