"""The access log (``--access-log``, ``TINYLOOP_ACCESS_LOG=1``): one line per HTTP request.

``AccessLog`` wraps the ASGI app and logs at INFO on the ``tinyloop.access`` logger once the
request is over, whatever ended it::

    127.0.0.1:50412 "POST /v1/chat/completions HTTP/1.1" 200 84.1 ms
    127.0.0.1:50420 "POST /v1/chat/completions HTTP/1.1" 200 1503.2 ms incomplete

``incomplete``: the response started but never ended (the client went away mid-stream, or a
shutdown cut it); ``-`` for the status: none was sent. The duration runs from the request's
arrival to its end (for a stream, to its last event). The path is the one the client sent,
still percent-encoded, so no byte it chose can break a line of the log.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tinyloop.http.connection import HttpMiddleware, Message, Scope

__all__ = ["AccessLog", "access_line"]

log = logging.getLogger("tinyloop.access")


class AccessLog(HttpMiddleware):
    """ASGI middleware: logs each HTTP request (``access_line``) once the app is done with it."""

    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        start = time.perf_counter()
        status: int | None = None
        ended = False

        async def observed_send(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True

        try:
            await self.app(scope, receive, observed_send)
        finally:  # also when cancelled: the line still says how far the response got
            log.info("%s", access_line(scope, status, (time.perf_counter() - start) * 1000, ended))


def access_line(scope: Scope, status: int | None, duration_ms: float, ended: bool) -> str:
    """``client "METHOD path HTTP/version" status duration ms`` (+ ``incomplete``)."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    raw = scope.get("raw_path") or scope["path"].encode()
    target = raw.decode("ascii", "backslashreplace")
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("ascii", "backslashreplace")
    line = (f'{who} "{scope["method"]} {target} HTTP/{scope.get("http_version", "1.1")}" '
            f'{status if status is not None else "-"} {duration_ms:.1f} ms')
    return line if ended else line + " incomplete"
