"""Clients that stop reading (finding 6 of issue 29).

hypercorn's trio worker waited forever on a write to a client whose receive window was full:
32 streams whose clients never read kept their connections, their requests and the KV the
engine kept filling for them as long as the server ran, and a shutdown waited for them past
its graceful timeout. Each write now has ``send_timeout`` seconds (nginx's ``send_timeout``):
a client that takes nothing for that long has its connection reset and its request cancelled,
one that reads slowly keeps its stream, and shutdown's deadline binds every write.
"""

from __future__ import annotations

import array
import fcntl
import json
import socket
import termios
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import httpx
import trio

from tests.http.conftest import running_server, tiny_engine
from tests.reliability.conftest import assert_drained, counter, wait_for
from tests.reliability.rawhttp import host_of, request, stoppable_server
from tinyloop.settings import Settings

SEND_TIMEOUT_S = 1.0
STALLED = 4
# Completions with 20 logprobs per token make events of about 900 bytes: a client's socket
# buffers (a 4 KiB receive buffer, the server's send buffer) fill within a second.
BODY = json.dumps({"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "stream": True,
                   "logprobs": 20}).encode()


@asynccontextmanager
async def stalled_clients(url: str, n: int) -> AsyncIterator[list[trio.SocketStream]]:
    """``n`` connections that sent a streaming request and read nothing (a small receive
    buffer), closed on the way out: a server that never gives up on them cannot then hold the
    test's teardown too."""
    parts = urlsplit(url)
    streams: list[trio.SocketStream] = []
    try:
        for _ in range(n):
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stream = trio.SocketStream(sock)
            streams.append(stream)
            await sock.connect((parts.hostname, parts.port))
            await stream.send_all(request("POST", "/v1/completions", host_of(url), BODY))
        yield streams
    finally:
        for stream in streams:
            stream.socket.close()


def unread_bytes(stream: trio.SocketStream) -> int:
    """What the kernel holds for the client, unread (FIONREAD: asks without reading)."""
    out = array.array("i", [0])
    fcntl.ioctl(stream.socket.fileno(), termios.FIONREAD, out)
    return out[0]


async def wait_full(stream: trio.SocketStream) -> None:
    """Until the client's receive buffer stops growing: the server's writes to it now block."""
    last, still = -1, 0
    while still < 5:
        await trio.sleep(0.05)
        now = unread_bytes(stream)
        last, still = now, still + 1 if now == last and now > 0 else 0


async def closed_by_server(stream: trio.SocketStream, limit_s: float = 5) -> bool:
    """Read what is left: True if the server closed or reset the connection."""
    with trio.move_on_after(limit_s):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:  # the reset
            pass
        return True
    return False


async def test_clients_that_stop_reading_are_reset_and_their_requests_cancelled() -> None:
    settings = Settings(port=0, max_batch_size=8, send_timeout=SEND_TIMEOUT_S)
    with trio.fail_after(30):
        async with (running_server(settings, tiny_engine(max_seq_len=4096)) as srv,
                    stalled_clients(srv.url, STALLED + 1) as clients):
            *stalled, slow = clients
            slow_read = 0

            async def read_slowly(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                # slower than the engine makes its events, but 2 KiB every 0.1 s
                nonlocal slow_read
                task_status.started()
                while True:
                    await trio.sleep(0.1)
                    slow_read += len(await slow.receive_some(2048))

            async with trio.open_nursery() as nursery:
                await nursery.start(read_slowly)
                # Before the fix the stalled requests ran on for nobody: this never came.
                await wait_for(lambda: counter(srv, "cancelled") == STALLED, poll_s=0.05)
                assert srv.runtime.statistics().in_flight == 1  # the slow reader's, still running
                for stream in stalled:
                    assert await closed_by_server(stream), "a client that read nothing kept its connection"
                before = slow_read
                await trio.sleep(1.5 * SEND_TIMEOUT_S)
                assert slow_read > before, "the slow reader's stream was cut"
                nursery.cancel_scope.cancel()
            await slow.aclose()  # the slow reader leaves: its request is cancelled too
            await wait_for(lambda: srv.runtime.statistics().in_flight == 0, poll_s=0.05)
            assert_drained(srv)  # no request queued or running, no KV block held
            async with httpx.AsyncClient(base_url=srv.url) as client:
                metrics = (await client.get("/metrics")).text
            for gauge in ("tinyloop_requests_in_flight", "tinyloop_queue_depth", "tinyloop_kv_blocks_used"):
                assert f"\n{gauge} 0.0\n" in metrics, gauge
            assert counter(srv, "cancelled") == STALLED + 1


async def test_a_client_that_stops_reading_does_not_hold_the_shutdown() -> None:
    # The send timeout is far away: only the graceful timeout may end the stalled write.
    settings = Settings(port=0, graceful_timeout=1.0, send_timeout=120)
    with trio.fail_after(30):
        async with (stoppable_server(settings, tiny_engine(max_seq_len=4096)) as srv,
                    stalled_clients(srv.url, 1) as (stream,)):
            await wait_full(stream)
            srv.stop.set()
            with trio.fail_after(settings.graceful_timeout + 5):
                await srv.stopped.wait()  # before the fix: never
            assert await closed_by_server(stream)
