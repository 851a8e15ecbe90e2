"""A request's record while the runtime holds it: priority, SLO, state, and its result channel."""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from tinyloop.requests import GenerationChunk, GenerationRequest, GenerationResult, RequestState

__all__ = ["Ticket", "Final", "Failure", "Item"]


@dataclass(frozen=True, slots=True)
class Final:
    """The last item on a request's channel when it completed."""

    result: GenerationResult


@dataclass(frozen=True, slots=True)
class Failure:
    """The last item on a request's channel when it failed."""

    error: BaseException


Item = GenerationChunk | Final | Failure


@dataclass(eq=False)
class Ticket:
    """One admitted (or being admitted) request.

    The engine side writes chunks and one ``Final``/``Failure`` into ``send``; the caller reads
    ``receive``. The buffer holds every item a request can produce (``max_tokens + 1``), so the
    engine never blocks on a slow reader. ``cancelled`` is set by the caller when it goes away;
    whoever holds the ticket then retires it at its next step.
    """

    request: GenerationRequest
    priority: int
    slo_ms: float | None
    stream: bool
    submitted_at: float  # trio.current_time()
    state: RequestState = RequestState.QUEUED
    cancelled: bool = False
    cancel_error: BaseException | None = None  # told to the caller when the runtime cancels it
    dispatched_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    send: trio.MemorySendChannel[Item] = field(init=False)
    receive: trio.MemoryReceiveChannel[Item] = field(init=False)

    def __post_init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[Item](self.request.max_tokens + 1)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __repr__(self) -> str:
        return (f"<Ticket {self.request_id[:8]} {self.state.value} priority={self.priority}"
                f"{' cancelled' if self.cancelled else ''}>")

    def deliver(self, item: Item) -> bool:
        """Hand an item to the caller; False when the caller is gone (it counts as cancelled)."""
        try:
            self.send.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.cancelled = True
            return False
        return True

    def terminate(self, state: RequestState, item: Final | Failure | None = None) -> None:
        """Enter a terminal state, deliver the last item, close the engine's end."""
        self.state = state
        self.finished_at = trio.current_time()
        if item is None and state is RequestState.CANCELLED and self.cancel_error is not None:
            item = Failure(self.cancel_error)
        if item is not None:
            self.deliver(item)
        self.send.close()

    def ms_since(self, t: float | None) -> float | None:
        return None if t is None else (trio.current_time() - t) * 1000
