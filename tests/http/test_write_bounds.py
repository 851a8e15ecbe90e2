"""The bound on each write to a client (``Writes``, the ``--send-timeout`` setting) and the
forced cut of every stream (``Drain.force``), on Trio's in-memory streams and the autojump clock
(and, for the socket path, a real socket pair).

hypercorn's trio worker waited forever on a write that the client never took (finding 6 of
issue 29); a forced shutdown had no way to end the streams at once (finding 7).
"""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from tinyloop.cli import build_parser
from tinyloop.errors import ConfigError
from tinyloop.http.connection import WRITE_PIECE, Writes
from tinyloop.http.drain import Drain
from tinyloop.http.serve import hypercorn_config
from tinyloop.settings import Settings


async def test_a_write_nobody_takes_gives_up_after_the_send_timeout(autojump_clock: trio.abc.Clock) -> None:
    writes = Writes(send_timeout=5)
    send, _receive = trio.testing.lockstep_stream_pair()  # a write waits for the reader
    with trio.fail_after(60):
        start = trio.current_time()
        assert await writes.send_all(send, b"data: x\n\n") is False
    assert trio.current_time() - start == pytest.approx(5)
    assert "0 in progress" in repr(writes)


async def test_a_slow_reader_that_keeps_reading_is_not_cut(autojump_clock: trio.abc.Clock) -> None:
    # Three pieces, each taken 4 s after the last: 12 s in all, more than the 5 s send timeout.
    writes = Writes(send_timeout=5)
    send, receive = trio.testing.lockstep_stream_pair()
    got = bytearray()

    async def slow_reader() -> None:
        while len(got) < 3 * WRITE_PIECE:
            await trio.sleep(4)
            got.extend(await receive.receive_some(WRITE_PIECE))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_reader)
            assert await writes.send_all(send, b"x" * (3 * WRITE_PIECE)) is True
    assert len(got) == 3 * WRITE_PIECE


async def test_close_by_ends_a_write_in_progress_and_bounds_later_ones(autojump_clock: trio.abc.Clock) -> None:
    writes = Writes(send_timeout=60)
    send, _receive = trio.testing.lockstep_stream_pair()
    results: list[bool] = []

    async def write() -> None:
        results.append(await writes.send_all(send, b"data: x\n\n"))

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.sleep(1)
            assert "1 in progress" in repr(writes)
            writes.close_by(trio.current_time() + 2)
        assert trio.current_time() == pytest.approx(3) and results == [False]
        other, _ = trio.testing.lockstep_stream_pair()
        assert await writes.send_all(other, b"late") is False  # the deadline has passed: at once
        assert trio.current_time() == pytest.approx(3)


async def test_drain_force_cuts_every_watched_wait_now_and_says_why(autojump_clock: trio.abc.Clock) -> None:
    drain = Drain()
    drain.begin(graceful_timeout=100)
    cut: list[bool] = []

    async def writer() -> None:
        with drain.watch() as scope:
            await trio.sleep_forever()
        cut.append(scope.cancelled_caught)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(writer)
            await trio.sleep(1)
            assert "graceful timeout" in drain.reason
            drain.force()
    assert cut == [True] * 3 and trio.current_time() == pytest.approx(1)
    assert drain.cut_at == pytest.approx(1) and "forced" in drain.reason


def test_send_timeout_is_a_setting_a_variable_and_a_flag() -> None:
    assert Settings().send_timeout == 60
    assert Settings.from_env({"TINYLOOP_SEND_TIMEOUT": "2.5"}).send_timeout == 2.5
    args = build_parser().parse_args(["serve", "--send-timeout", "7"])
    assert args.send_timeout == 7
    assert hypercorn_config(Settings(send_timeout=7)).writes.send_timeout == 7
    for bad in (0, -1, float("nan")):
        with pytest.raises(ConfigError, match="send_timeout"):
            Settings(send_timeout=bad)


async def test_on_a_socket_any_byte_the_client_takes_moves_the_deadline_on() -> None:
    # 20 KiB/s against a 0.3 s send timeout: one WRITE_PIECE per timeout would need 53 KiB/s.
    writes = Writes(send_timeout=0.3)
    with socket.create_server(("127.0.0.1", 0)) as server:
        b = socket.create_connection(server.getsockname())
        a, _ = server.accept()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.setblocking(False)
    b.setblocking(False)
    send = trio.SocketStream(trio.socket.from_stdlib_socket(a))
    receive = trio.SocketStream(trio.socket.from_stdlib_socket(b))
    got = bytearray()
    data = b"x" * (4 * WRITE_PIECE)

    async def slow_reader() -> None:
        while len(got) < len(data):
            await trio.sleep(0.1)
            got.extend(await receive.receive_some(2048))

    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow_reader)
                assert await writes.send_all(send, data) is True
        assert bytes(got) == data
    finally:
        await send.aclose()
        await receive.aclose()
