"""What the engine actor (``engine.py``) tells the rest of the runtime.

It publishes a snapshot (``EngineStatistics``, ``Health``) that the runtime and the dispatcher
read, and sends three kinds of message, each gathered during a step and sent once per step
(``Reports.send``): the slots its retired requests freed (``SlotFreed``, to the dispatcher), the
requests it completed (to admission's predictor) and the events for the metrics actor. Every
send is non-blocking: the feedback channels are unbounded, and a reader that has stopped needs
to know nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import trio

from tinyloop.actors.chute import Chute
from tinyloop.actors.ticket import Ticket
from tinyloop.messages import Event, EventBatch, Finished, SlotFreed, StepDone

if TYPE_CHECKING:
    from tinyloop.model.kvcache import KVPoolStats

__all__ = ["Health", "EngineStatistics", "Reports"]

T = TypeVar("T")

# A long stream's steps (nothing else to report) go to the metrics actor in batches of this many,
# so it is not woken for every token; they go at once with any other event and when the engine
# falls idle, so a count read after the requests finished is exact.
_STEPS_PER_REPORT = 16


@dataclass(slots=True)
class Health:
    """Why the engine is unusable, or None while it is fine. Written by the engine actor (a
    step raised ``EngineBroken``); ``Runtime.health`` hands it out for tests and operators."""

    broken: str | None = None


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    retired: int  # requests retired after their dispatch, ever
    slots_freed: int  # the dispatcher's slots those requests held (``Ticket.slots``), ever
    decoding: int  # requests whose sequence exists (running or preempted)
    prefix_pool_size: int
    kv: KVPoolStats | None
    broken: str | None


@dataclass(eq=False)
class Reports:
    """The engine actor's outgoing messages, gathered until ``send``."""

    freed: trio.MemorySendChannel[SlotFreed]
    observe: Chute[list[Finished]]
    events: trio.MemorySendChannel[Event | EventBatch]
    index: int = 0  # which of the runtime's engines (in its SlotFreed)
    label: int | None = None  # the same, on its events, when the runtime drives several
    pending: list[Event] = field(default_factory=list)  # events for the metrics actor, sent once per step
    steps: list[StepDone] = field(default_factory=list)  # steps not reported yet
    freed_pending: list[Ticket] = field(default_factory=list)  # retired: their slots, for the dispatcher
    observed: list[Finished] = field(default_factory=list)  # completed requests, for admission's predictor

    def feed_back(self) -> None:
        """Tell the dispatcher (the slots freed) and admission (its predictor) what this step
        retired, one message each; both read these beside their pipeline inbox, unbounded, so
        this never blocks. Once they have stopped nobody needs to know."""
        if self.freed_pending:
            _send_feedback(self.freed, SlotFreed(self.freed_pending, self.index))
            self.freed_pending = []
        if self.observed:
            _send_feedback(self.observe, self.observed)
            self.observed = []

    def send(self, idle: bool) -> None:
        """Send what was gathered since the last call: the slots freed, the observations and
        the events for the metrics actor, one message each. The steps wait for another event,
        a full batch, or the engine falling ``idle``."""
        self.feed_back()
        if self.steps and (self.pending or len(self.steps) >= _STEPS_PER_REPORT or idle):
            self.pending.extend(self.steps)
            self.steps = []
        if self.pending:
            self.events.send_nowait(EventBatch(self.pending, self.label))
            self.pending = []


def _send_feedback(channel: trio.MemorySendChannel[T] | Chute[T], msg: T) -> None:
    try:
        channel.send_nowait(msg)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the reader has stopped: nobody needs to know
