"""The graceful-shutdown deadline as the SSE writers see it.

hypercorn cancels every connection ``graceful_timeout`` seconds after shutdown begins: a stream
still running then would end with a bare TCP close. ``Drain.begin`` records a cut-off shortly
before that deadline; each SSE writer waits for its next chunk inside ``Drain.watch``, whose
cancel scope expires at the cut-off, and then ends the stream in-band (error event, ``[DONE]``)
while the connection can still carry it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["Drain", "DRAIN_KEY"]

DRAIN_KEY = "tinyloop.drain"  # the app's extensions key


class Drain:
    """Created with the app (no trio object at construction); ``begin`` when shutdown starts."""

    def __init__(self) -> None:
        self.cut_at = math.inf  # trio clock
        self._scopes: set[trio.CancelScope] = set()

    @staticmethod
    def margin(graceful_timeout: float) -> float:
        """Time left for the last events before hypercorn's own deadline."""
        return min(1.0, graceful_timeout / 4)

    def begin(self, graceful_timeout: float) -> None:
        self.cut_at = trio.current_time() + graceful_timeout - self.margin(graceful_timeout)
        for scope in self._scopes:
            scope.deadline = min(scope.deadline, self.cut_at)

    @contextmanager
    def watch(self) -> Iterator[trio.CancelScope]:
        """A cancel scope that expires at the cut-off (``cancelled_caught`` tells it did). Wrap
        only awaits in it, never a ``yield`` of an async generator."""
        with trio.CancelScope(deadline=self.cut_at) as scope:
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)
