"""The graceful-shutdown deadline as the SSE writers see it.

hypercorn cancels every connection ``graceful_timeout`` seconds after shutdown begins: a stream
still running then would end with a bare TCP close. ``Drain.begin`` records a cut-off shortly
before that deadline; each SSE writer waits for its next chunk inside ``Drain.watch``, whose
cancel scope expires at the cut-off, and then ends the stream in-band (error event, ``[DONE]``)
while the connection can still carry it. ``Drain.force`` (a second signal) moves the cut-off to
now: every open stream ends that way at once.
"""

from __future__ import annotations

import math
from types import TracebackType

import trio

__all__ = ["Drain", "DRAIN_KEY"]

DRAIN_KEY = "tinyloop.drain"  # the app's extensions key


class Drain:
    """Created with the app (no trio object at construction); ``begin`` when shutdown starts."""

    def __init__(self) -> None:
        self.cut_at = math.inf  # trio clock
        self.reason = "the server's graceful timeout ends this stream"  # told in the error event
        self._scopes: set[trio.CancelScope] = set()

    @staticmethod
    def margin(graceful_timeout: float) -> float:
        """Time left for the last events before hypercorn's own deadline."""
        return min(1.0, graceful_timeout / 4)

    def begin(self, graceful_timeout: float) -> None:
        self._cut(trio.current_time() + graceful_timeout - self.margin(graceful_timeout))

    def force(self) -> None:
        """Cut every stream now: the shutdown was forced."""
        self.reason = "the shutdown was forced, which ends this stream"
        self._cut(trio.current_time())

    def _cut(self, at: float) -> None:
        self.cut_at = min(self.cut_at, at)
        for scope in self._scopes:
            scope.deadline = min(scope.deadline, self.cut_at)

    def watch(self) -> _Watch:
        """A cancel scope that expires at the cut-off (``cancelled_caught`` tells it did). Wrap
        only awaits in it, never a ``yield`` of an async generator. (A plain class, not a
        ``contextmanager``: an SSE writer enters one per write.)"""
        return _Watch(self)


class _Watch:
    __slots__ = ("_drain", "_scope")

    def __init__(self, drain: Drain) -> None:
        self._drain = drain
        self._scope = trio.CancelScope(deadline=drain.cut_at)

    def __enter__(self) -> trio.CancelScope:
        scope = self._scope.__enter__()
        self._drain._scopes.add(scope)
        return scope

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        self._drain._scopes.discard(self._scope)
        return self._scope.__exit__(exc_type, exc, tb)
