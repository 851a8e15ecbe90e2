"""The SSE guard ends a stream in-band at the drain's cut-off on both of its paths: waiting for
the engine (inside the drain's cancel scope) and with chunks ready (checked by the clock)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest
import trio
from quart_trio import QuartTrio

from tinyloop.http.drain import DRAIN_KEY, Drain
from tinyloop.http.service import DONE, sse_guard


class FakeStream:
    def __init__(self, ready: bool) -> None:
        self.ready = ready
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("ready", [True, False])
async def test_cut_off_ends_the_stream_in_band(ready: bool) -> None:
    app = QuartTrio("drain-paths")
    drain = Drain()
    app.extensions[DRAIN_KEY] = drain
    stream = FakeStream(ready)

    async def events() -> AsyncGenerator[bytes, None]:
        for i in range(5):
            await trio.lowlevel.checkpoint()
            yield f"e{i}".encode()

    async with app.app_context():
        body = sse_guard(events(), [stream])  # type: ignore[list-item]
    out: list[bytes] = []
    with trio.fail_after(5):
        async for chunk in body:
            out.append(chunk)
            if len(out) == 2:
                drain.cut_at = trio.current_time() - 1  # the cut-off has passed
    assert out[:2] == [b"e0", b"e1"]
    assert b"shutting down" in out[2] and out[3] == DONE and len(out) == 4
    assert stream.cancelled
