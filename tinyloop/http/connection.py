"""Connection handling the stack gets wrong, fixed at the ASGI boundary and in hypercorn's errors.

* **Closing after a response.** hypercorn's trio worker does a connection's end-of-response work
  (close for ``Connection: close`` and HTTP/1.0, restart the keep-alive idle timer, which also
  closes idle connections on shutdown) inside the app's ``send`` of the last body message. That
  work queues ``http.disconnect`` for the app, and quart-trio cancels the request's nursery as
  soon as it receives it, so the same ``send`` is cancelled half way: the socket is never
  closed and the idle timer never runs (hypercorn 0.17-0.18, quart-trio 0.11-0.12; a bare
  QuartTrio app does the same). ``ConnectionGuard`` sends the last body message shielded.
* **Request smuggling.** h11 frames a request that has both ``Content-Length`` and
  ``Transfer-Encoding`` by the chunked coding and keeps the connection open, so bytes after the
  chunked body become a second request. ``ConnectionGuard`` answers it 400 and closes
  (RFC 9112 section 6.1).
* **Protocol errors.** hypercorn answers what h11 cannot parse (400, 431, 501) with an empty
  body; ``install_protocol_errors`` makes that body the error object the routes send.
* **Clients that stop reading.** hypercorn's trio worker writes every byte under a shielded
  cancel scope with no deadline: once a client's receive window is full, the write waits
  forever, holding the connection, the request and everything the engine makes for it (its
  result channel and KV grow to ``max_tokens``), and no shutdown deadline can end it.
  ``install_protocol_errors`` bounds each write by its config's ``Writes`` (nginx's
  ``send_timeout``): a client that takes nothing for ``send_timeout`` seconds has its
  connection reset, which cancels its request.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from abc import ABC, abstractmethod
from http import HTTPStatus
from typing import Any

import h11
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer

from tinyloop.http.errors import error_body

__all__ = ["ConnectionGuard", "HttpMiddleware", "ServerConfig", "Writes", "install_protocol_errors", "json_error_parts"]

DEFAULT_SEND_TIMEOUT = 60.0  # Settings.send_timeout's default: for a plain hypercorn Config
# Over TLS (no socket to ask), each piece of a write gets its own send_timeout, so a client that
# keeps reading, however slowly, is not cut; there a client is cut once it took less than this in
# send_timeout seconds. Over plain TCP any byte the kernel takes counts.
WRITE_PIECE = 16 * 1024

Scope = dict[str, Any]
Message = dict[str, Any]

_PROTOCOL_MESSAGES = {
    400: "The request is not valid HTTP/1.1.",
    431: "The request's headers are larger than the server accepts.",
    501: "Unsupported Transfer-Encoding: only 'chunked' is supported.",
    505: "Unsupported HTTP version.",
}


def json_error_parts(status: int, message: str, code: str | None = None
                     ) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers (closing the connection) and body of an error object response."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    return headers, body


class HttpMiddleware(ABC):
    """An ASGI middleware that handles each HTTP request in ``http`` (each subclass's own) and
    passes every other scope (the lifespan) straight to the app."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    @abstractmethod
    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        """Handle one HTTP request, calling ``self.app`` as the middleware sees fit."""


class ConnectionGuard(HttpMiddleware):
    """ASGI middleware around the app: refuses ambiguous framing, and lets hypercorn finish the
    end of every response (see the module docstring)."""

    async def http(self, scope: Scope, receive: Any, send: Any) -> None:
        names = {name.lower() for name, _ in scope["headers"]}
        if b"transfer-encoding" in names and b"content-length" in names:
            await _refuse(receive, send, 400, "The request has both Content-Length and "
                          "Transfer-Encoding; send one of them.", "ambiguous_framing")
            return

        async def send_end_shielded(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):  # hypercorn closes or recycles in here
                    await send(message)
            else:
                await send(message)

        await self.app(scope, receive, send_end_shielded)


async def _refuse(receive: Any, send: Any, status: int, message: str, code: str) -> None:
    """Read and drop the body, then answer and close. Answering earlier races hypercorn's reader:
    once a response says ``Connection: close``, h11 takes any byte after the request (the
    smuggled one) as an error and hypercorn closes the socket under the response."""
    with trio.move_on_after(10):
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                return
            if not event.get("more_body", False):
                break
    for _ in range(2):  # let the reader, which queued the end of the body, park (h11 PAUSED)
        await trio.sleep(0)
    headers, body = json_error_parts(status, message, code)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json_error_response(self: H11Protocol, status_code: int) -> None:
    headers, body = json_error_parts(status_code, _PROTOCOL_MESSAGES.get(
        status_code, "The request could not be parsed."), "invalid_http")
    await self._send_h11_event(h11.Response(
        status_code=status_code, headers=headers + list(self.config.response_headers("h11"))))
    await self._send_h11_event(h11.Data(data=body))
    await self._send_h11_event(h11.EndOfMessage())


_SEND_H11_EVENT = H11Protocol._send_h11_event


async def _send_with_reason(self: H11Protocol, event: Any) -> None:
    """hypercorn's ``_send_h11_event``, with the status line's reason phrase filled in
    (``HTTP/1.1 400 Bad Request``, not ``HTTP/1.1 400 ``: some clients show or log it)."""
    if isinstance(event, (h11.Response, h11.InformationalResponse)) and not event.reason:
        try:
            phrase = HTTPStatus(event.status_code).phrase.encode()
        except ValueError:
            phrase = b""
        if phrase:
            event = type(event)(status_code=event.status_code, headers=event.headers,
                                http_version=event.http_version, reason=phrase)
    await _SEND_H11_EVENT(self, event)


class Writes:
    """The bound on every write of one server to its clients: ``send_timeout`` seconds without
    progress (nginx's ``send_timeout``: the time between two successful writes, not for the
    whole response), and none past ``close_at`` (shutdown's deadline). No
    trio object at construction; the cancel scopes of the writes in progress are kept so that
    ``close_by`` reaches them too."""

    def __init__(self, send_timeout: float) -> None:
        self.send_timeout = send_timeout
        self.close_at = math.inf  # trio clock
        self._scopes: set[trio.CancelScope] = set()

    def __repr__(self) -> str:
        return (f"<Writes send_timeout={self.send_timeout:g}s close_at={self.close_at:g} "
                f"{len(self._scopes)} in progress>")

    def close_by(self, deadline: float) -> None:
        """No write, in progress or later, may last past ``deadline`` (trio clock)."""
        self.close_at = min(self.close_at, deadline)
        for scope in self._scopes:
            scope.deadline = min(scope.deadline, self.close_at)

    async def send_all(self, stream: trio.abc.SendStream, data: bytes) -> bool:
        """Write ``data`` as hypercorn does, shielded (a write cut half way would leave the
        response corrupt), but with a deadline that every byte the client takes moves on;
        False once it ran out (the stream is then in an unknown state: the caller resets the
        connection). On a plain TCP stream each ``send`` the kernel accepts counts as progress
        (nginx's rule: the time between two successful writes); on another stream (TLS), each
        ``WRITE_PIECE`` bytes written."""
        view = memoryview(data)
        sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        sent = 0
        while True:
            deadline = min(trio.current_time() + self.send_timeout, self.close_at)
            scope = trio.CancelScope(shield=True, deadline=deadline)
            self._scopes.add(scope)
            try:
                with scope:
                    if sock is None:
                        await stream.send_all(view[sent:sent + WRITE_PIECE])
                        sent += min(WRITE_PIECE, len(view) - sent)
                    elif len(view) == 0:
                        await trio.lowlevel.checkpoint()
                    else:
                        sent += await _socket_send(sock, view[sent:])
            finally:
                self._scopes.discard(scope)
            if scope.cancelled_caught:
                return False
            if sent >= len(view):
                return True


async def _socket_send(sock: trio.socket.SocketType, data: memoryview) -> int:
    """What one ``send`` wrote, its errors as ``SocketStream.send_all`` reports them."""
    try:
        return await sock.send(data)
    except OSError as exc:
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


class ServerConfig(Config):
    """hypercorn's config plus the server's ``Writes`` (read by the patched ``TCPServer``)."""

    def __init__(self, send_timeout: float = DEFAULT_SEND_TIMEOUT) -> None:
        super().__init__()
        self.writes = Writes(send_timeout)


async def _protocol_send(self: TCPServer, event: Event) -> None:
    """hypercorn's ``TCPServer.protocol_send`` with each write bounded (``Writes``). A write
    that ran out resets the connection (an abortive close, as nginx's
    ``reset_timedout_connection``: the kernel drops the unsent bytes at once instead of
    offering them to a client that reads nothing) and tells the protocol it closed, which
    sends the app ``http.disconnect``: the request is cancelled."""
    if not isinstance(event, RawData):
        await _PROTOCOL_SEND(self, event)
        return
    writes = self.config.writes if isinstance(self.config, ServerConfig) else Writes(DEFAULT_SEND_TIMEOUT)
    async with self.send_lock:
        try:
            if await writes.send_all(self.stream, event.data):
                return
            why = ("shutdown's deadline passed" if trio.current_time() >= writes.close_at
                   else f"it took no more of the response for {writes.send_timeout:g} s")
            with trio.CancelScope(shield=True):
                peer = await _reset(self.stream)
                await self.config.log.info(f"reset the connection from {peer}: {why}")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await self.protocol.handle(Closed())


async def _reset(stream: Any) -> str:
    """Close the TCP connection under ``stream`` (a socket stream, or the one under TLS) with
    a reset; the peer's address, for the log."""
    transport: trio.SocketStream = getattr(stream, "transport_stream", stream)
    try:
        host, port = transport.socket.getpeername()[:2]
        peer = f"{host}:{port}"
    except (OSError, ValueError):
        peer = "a client"
    try:
        transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:  # already closed: nothing left to reset
        pass
    await transport.aclose()
    return peer


_PROTOCOL_SEND = TCPServer.protocol_send


def install_protocol_errors() -> None:
    """Make hypercorn's HTTP/1.1 protocol errors carry the error object, every response a
    reason phrase, and every write a deadline (idempotent).

    hypercorn has no hook for these, so its ``H11Protocol._send_error_response`` is replaced
    (same signature, same status and ``Connection: close``; only the body differs), its
    ``_send_h11_event`` wrapped, and its trio ``TCPServer.protocol_send`` replaced (the same
    but for the deadline: ``Writes``; a plain ``Config``, as ``hypercorn 'tinyloop.http:app'``
    makes, gets the default ``send_timeout``). Checked by tests/reliability/test_smuggling.py,
    tests/http/test_compat.py and tests/reliability/test_send_timeout.py for the pinned
    hypercorn versions.
    """
    if getattr(H11Protocol, "_send_error_response", None) is not _send_json_error_response:
        H11Protocol._send_error_response = _send_json_error_response  # type: ignore[method-assign]
    if H11Protocol._send_h11_event is not _send_with_reason:
        H11Protocol._send_h11_event = _send_with_reason  # type: ignore[method-assign]
    if TCPServer.protocol_send is not _protocol_send:
        TCPServer.protocol_send = _protocol_send  # type: ignore[method-assign]
