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
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import h11
import trio
from hypercorn.protocol.h11 import H11Protocol

from tinyloop.http.errors import error_body

__all__ = ["ConnectionGuard", "install_protocol_errors", "json_error_parts"]

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


class ConnectionGuard:
    """ASGI middleware around the app: refuses ambiguous framing, and lets hypercorn finish the
    end of every response (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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


def install_protocol_errors() -> None:
    """Make hypercorn's HTTP/1.1 protocol errors carry the error object, and every response a
    reason phrase (idempotent).

    hypercorn has no hook for these responses, so its ``H11Protocol._send_error_response`` is
    replaced (same signature, same status and ``Connection: close``; only the body differs), and
    its ``_send_h11_event`` wrapped. Checked by tests/reliability/test_smuggling.py and
    tests/http/test_compat.py for the pinned hypercorn versions.
    """
    if getattr(H11Protocol, "_send_error_response", None) is not _send_json_error_response:
        H11Protocol._send_error_response = _send_json_error_response  # type: ignore[method-assign]
    if H11Protocol._send_h11_event is not _send_with_reason:
        H11Protocol._send_h11_event = _send_with_reason  # type: ignore[method-assign]
