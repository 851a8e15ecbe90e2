"""One request as its caller sees it: admission, then chunks, then the result.

Leaving the stream early (``break``, an exception, cancellation, a client disconnect) cancels
the request: a queued one leaves the queue, a running one leaves the batch at the engine's next
step and its KV is freed. Nothing else is affected.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import trio

from tinyloop.actors.ticket import Failure, Item, Ticket
from tinyloop.requests import GenerationChunk, GenerationRequest, GenerationResult, RequestState

if TYPE_CHECKING:
    from tinyloop.limits import Resolved

__all__ = ["RequestStream", "Gate"]


class Gate(Protocol):
    """What a stream needs from its runtime (``Runtime`` is one): the model's check, admission
    (raises the refusal), and withdrawal of a ticket its caller left."""

    def check(self, request: GenerationRequest) -> Resolved: ...

    def _admit(self, ticket: Ticket) -> None: ...

    def _cancel(self, ticket: Ticket, error: BaseException | None = None) -> None: ...


class RequestStream:
    """An async iterator of ``GenerationChunk`` and an async context manager."""

    def __init__(self, runtime: Gate, request: GenerationRequest, priority: int,
                 slo_ms: float | None, stream: bool) -> None:
        self._runtime = runtime
        self.ticket = Ticket(request, priority, slo_ms, stream, trio.current_time())
        self._started = False
        self._terminal: Item | None = None  # met by next_burst, handed out next
        self.result: GenerationResult | None = None

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    @property
    def state(self) -> RequestState:
        return self.ticket.state

    def __repr__(self) -> str:
        return f"<RequestStream {self.ticket!r}>"

    async def start(self) -> None:
        """A checkpoint, then the check against the model (RequestError) and admission (raises
        its refusal: QueueFullError, AdmissionRejected, SchedulerShutdown), both synchronous.
        Idempotent; iteration calls it if needed."""
        if self._started:
            return
        await trio.lowlevel.checkpoint()  # a cancelled caller is admitted nowhere
        self._begin()

    def _begin(self) -> None:
        """Check the request and pass admission, in this task (the refusal is raised here)."""
        self.ticket.resolved = self._runtime.check(self.ticket.request)  # the one check
        self._started = True
        try:
            self._runtime._admit(self.ticket)
        except BaseException:
            self.ticket.close_receiver()
            raise

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        try:
            if not self._started:
                self._begin()
            item, self._terminal = self._terminal or await self.ticket.items.receive(), None
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        except BaseException:
            self.cancel()
            raise
        match item:
            case GenerationChunk():
                return item
            case GenerationResult():
                self.result = item
                raise StopAsyncIteration
            case Failure(error=error):
                raise error
        raise AssertionError(f"unexpected {item!r}")  # pragma: no cover

    async def next_burst(self) -> list[GenerationChunk]:
        """Every chunk delivered so far (waiting for at least one); ``[]`` once the stream ends.

        A consumer slower than the engine (a busy HTTP connection) gets the chunks that piled
        up in one list, to write them in one go rather than one write per token.
        """
        try:
            burst = [await self.__anext__()]
        except StopAsyncIteration:
            return []
        while self._terminal is None:
            try:
                item = self.ticket.items.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if isinstance(item, GenerationChunk):
                burst.append(item)
            else:  # the result or a Failure
                self._terminal = item
        return burst

    @property
    def ready(self) -> bool:
        """The next iteration would not wait for the engine: a chunk or the end is already
        here (an SSE writer then needs no drain watch around it)."""
        return self._started and (self._terminal is not None or self.ticket.items.ready)

    def cancel(self) -> None:
        """Abandon the request (synchronous: safe in ``finally`` and under cancellation)."""
        if self._started:
            self._runtime._cancel(self.ticket)
        self.ticket.close_receiver()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if not self.ticket.state.terminal or self.result is None:
            self.cancel()
