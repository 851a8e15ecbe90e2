"""Raw sockets for connection-level tests, and a server whose shutdown the test triggers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import trio

from tests.http.conftest import tiny_engine
from tinyloop.actors.runtime import open_runtime
from tinyloop.http.serve import serve_http
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings


@asynccontextmanager
async def connect(url: str) -> AsyncIterator[trio.SocketStream]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        yield stream


def host_of(url: str) -> str:
    return urlsplit(url).netloc


async def read_until_closed(stream: trio.SocketStream, limit_s: float) -> tuple[bytes, bool]:
    """Everything the server sends within ``limit_s``, and whether it closed the connection."""
    data = bytearray()
    with trio.move_on_after(limit_s):
        while chunk := await stream.receive_some(65536):
            data += chunk
        return bytes(data), True
    return bytes(data), False


async def read_one_response(stream: trio.SocketStream, limit_s: float = 10) -> bytes:
    """One response with a ``Content-Length`` body (the connection may stay open)."""
    data = bytearray()
    with trio.fail_after(limit_s):
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = bytes(data).partition(b"\r\n\r\n")
        length = int(headers_of(head)["content-length"])
        while len(body) < length:
            body += await stream.receive_some(65536)
    return head + b"\r\n\r\n" + body


def headers_of(head: bytes) -> dict[str, str]:
    lines = head.decode("latin1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines) if k}


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def error_of(response: bytes) -> dict[str, Any]:
    """The error object of a JSON error response (asserting its shape)."""
    head, _, body = response.partition(b"\r\n\r\n")
    assert headers_of(head)["content-type"] == "application/json", head
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def request(method: str, path: str, host: str, body: bytes = b"", version: str = "1.1",
            **headers: str) -> bytes:
    """A request with a JSON ``Content-Length`` body; ``headers`` with ``_`` for ``-``."""
    lines = [f"{method} {path} HTTP/{version}", f"Host: {host}"]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class StoppableServer:
    url: str
    stop: trio.Event  # set it to begin the graceful shutdown
    stopped: trio.Event  # set once serve_http returned


@asynccontextmanager
async def stoppable_server(settings: Settings, engine: Any = None,
                           model: ServedModel | None = None) -> AsyncIterator[StoppableServer]:
    """A real hypercorn over the runtime whose shutdown the test triggers, as a signal would."""
    engine = engine if engine is not None else tiny_engine()
    model = model if model is not None else ServedModel.from_engine(engine, settings)
    stop, stopped = trio.Event(), trio.Event()

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_http(rt, model, settings, shutdown_trigger=stop.wait, task_status=task_status)
        stopped.set()

    async with trio.open_nursery() as nursery, open_runtime(engine, settings) as rt:
        binds = await nursery.start(run)
        yield StoppableServer(binds[0], stop, stopped)
        stop.set()
