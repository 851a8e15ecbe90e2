"""A request's record while the runtime holds it: priority, SLO, state, and its result channel.

Who writes what. A ticket travels admission (in its caller's task) -> queue -> dispatcher ->
engine inside messages, and only the one that holds it at the moment writes it (ownership moves
with the message):

=====================  ==================================================================
field                  writer
=====================  ==================================================================
``request``            admission, on a downgrade, before it sends the ticket on
``state`` QUEUED       set at creation (the caller's task)
DISPATCHED             the dispatcher, as it sends ``Dispatch``
DECODING               the engine actor, once the engine started the sequence
terminal               the holder: the runtime (refused at admission, or before it), the
                       queue (cancelled while queued), the dispatcher (cancelled before
                       dispatch), the engine actor (whatever it held); once every actor has
                       stopped, the runtime retires what is left (``Runtime._orphans``)
``cancelled``,         the caller side only (``RequestStream.cancel``, ``Runtime.shutdown``),
``cancel_error``,      through ``cancel()`` and ``close_receiver()``, once; the holder reads
``receiver_closed``,   them at its next step
``gone``
=====================  ==================================================================

Caller-side cancellation is a flag, not a message, because it must be synchronous (it runs in
``finally`` and under cancellation, where nothing can be awaited): the caller writes the flag,
the holder only reads it. A ``Cancel`` message to the queue is only a nudge, so a queued ticket
leaves the queue at once instead of when it would be popped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from tinyloop.actors.chute import Chute
from tinyloop.limits import Resolved
from tinyloop.requests import GenerationChunk, GenerationRequest, GenerationResult, RequestState

__all__ = ["Ticket", "Failure", "Item"]


@dataclass(frozen=True, slots=True)
class Failure:
    """The last item on a request's channel when it failed."""

    error: BaseException


Item = GenerationChunk | GenerationResult | Failure  # the result (or a Failure) comes last


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted (or being admitted) request (the module docstring says who writes what).

    The holder writes chunks and then the ``GenerationResult`` or a ``Failure`` into ``items``
    (``deliver``, ``terminate``); the caller reads it. A ``Chute`` never blocks its writer, so
    no actor waits on a slow reader.
    """

    request: GenerationRequest
    priority: int
    slo_ms: float | None
    stream: bool
    submitted_at: float  # trio.current_time()
    resolved: Resolved | None = None  # the request checked against the model, at admission
    state: RequestState = RequestState.QUEUED
    cancelled: bool = False
    cancel_error: BaseException | None = None  # told to the caller when the runtime cancels it
    receiver_closed: bool = False  # written by the caller's side only (close_receiver)
    gone: bool = False  # cancelled or receiver_closed: nobody would read what comes next
    items: Chute[Item] = field(init=False, repr=False)
    # Engine slots the request takes: one per beam of a beam search (its beams decode as that
    # many rows of every step), one otherwise. Speculation's extra rows are capped per step by
    # the engine (``max_draft_nodes``) instead. A downgrade changes loops only, never this.
    slots: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.items = Chute()
        beam = self.request.beam
        self.slots = beam[0] if beam is not None else 1

    @property
    def loops(self) -> int:
        """The loops the request runs at, as the model's limits resolved them at admission."""
        if self.resolved is None:
            raise RuntimeError(f"{self!r} was not checked against the model (RequestStream.start)")
        return self.resolved.loops

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __repr__(self) -> str:
        return (f"<Ticket {self.request_id[:8]} {self.state.value} priority={self.priority}"
                f"{' cancelled' if self.cancelled else ''}>")

    # -- the caller side -----------------------------------------------------------------------
    def cancel(self, error: BaseException | None = None) -> bool:
        """Mark the ticket cancelled (the caller side only; synchronous). False when it already
        was, or had already ended: the first reason wins."""
        if self.state.terminal or self.cancelled:
            return False
        self.cancelled, self.cancel_error, self.gone = True, error, True
        return True

    # -- the holder ----------------------------------------------------------------------------
    def close_receiver(self) -> None:
        """The caller's side: stop reading (what the engine side delivers next is dropped)."""
        self.receiver_closed = self.gone = True
        self.items.close_receiver()

    def deliver(self, item: Item) -> bool:
        """Hand an item to the caller; False when the caller is gone."""
        try:
            self.items.send_nowait(item)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def terminate(self, state: RequestState, item: GenerationResult | Failure | None = None) -> None:
        """Enter a terminal state, deliver the last item, close the holder's end."""
        self.state = state
        if item is None and state is RequestState.CANCELLED and self.cancel_error is not None:
            item = Failure(self.cancel_error)
        if item is not None:
            self.deliver(item)
        self.items.close()

    def ms_since(self, t: float | None) -> float | None:
        return None if t is None else (trio.current_time() - t) * 1000
