"""The queue actor: a priority heap (FIFO within a priority, with aging) in front of the engine.

It hands the best tickets to the dispatcher, one for each slot a ``Pull`` asks to fill (free
engine slots), so a request is chosen at the moment a slot frees up, never earlier; what one
wake-up hands out goes in one ``Ready``. It reports the tickets it takes in to the metrics actor
(``Admitted``, one event per wake-up: admission, in callers' tasks, sends none). ``Cancel`` (a
caller's nudge, ``Ticket.cancel``) takes a queued ticket out; the queue then retires it as
cancelled.

It owns the heap and publishes ``QueueStatistics``: the queued count, and how many tickets it
has taken in (admission counts the ones it sent and the queue has not taken in yet as queued).

Shutdown: when admission closes its Enqueue pipe, the queue goes on answering ``Pull`` until
the heap is empty, then closes its outbox to the dispatcher. Cancellation: cancelled with its
nursery; the tickets still queued are retired by the runtime once every actor has stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from tinyloop.actors.mailbox import Pipe, UpstreamClosed, receive_all
from tinyloop.actors.ticket import Ticket
from tinyloop.messages import Admitted, Cancel, Enqueue, Event, Finished, Pull, QueueFeedback, Ready
from tinyloop.policy.queue import PriorityQueue
from tinyloop.requests import RequestState
from tinyloop.settings import Settings

__all__ = ["run", "QueueStatistics", "QueueState"]


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    queued: int  # in the heap
    taken_in: int  # Enqueue messages received, ever


class QueueState:
    """The queue actor's state (written by the actor only; read through ``statistics()``)."""

    def __init__(self, aging_ms: float) -> None:
        self.heap: PriorityQueue[Ticket] = PriorityQueue(aging_ms)
        self.taken_in = 0
        self.pulls = 0  # free engine slots the dispatcher asked to fill

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(len(self.heap), self.taken_in)

    def __repr__(self) -> str:
        return f"<QueueState queued={len(self.heap)} pulls={self.pulls}>"


def _now_ms() -> float:
    return trio.current_time() * 1000


async def run(*, inbox: trio.MemoryReceiveChannel[Enqueue | QueueFeedback | UpstreamClosed],
              outbox: Pipe[Ready], settings: Settings, events: trio.MemorySendChannel[Event],
              task_status: trio.TaskStatus[QueueState] = trio.TASK_STATUS_IGNORED) -> None:
    state = QueueState(settings.priority_aging_ms)
    heap = state.heap
    upstream_open = True
    async with outbox, events, inbox:
        task_status.started(state)
        while upstream_open or len(heap):
            try:
                batch = await receive_all(inbox)
            except trio.EndOfChannel:
                break
            taken_in = state.taken_in
            for msg in batch:
                upstream_open = _take(msg, state, events) and upstream_open
            if state.taken_in != taken_in:
                events.send_nowait(Admitted(state.taken_in - taken_in))
            if state.pulls and len(heap):
                now = _now_ms()
                ready = [heap.pop(now) for _ in range(min(state.pulls, len(heap)))]
                state.pulls -= len(ready)
                outbox.send_nowait(Ready(ready))


def _take(msg: Enqueue | QueueFeedback | UpstreamClosed, state: QueueState,
          events: trio.MemorySendChannel[Event]) -> bool:
    """Apply one message to the queue's state; False once upstream closed."""
    heap = state.heap
    match msg:
        case Enqueue(ticket=ticket):
            state.taken_in += 1
            if ticket.gone:  # the caller left while admission forwarded it
                _retire_cancelled(ticket, events)
            else:
                heap.push(ticket, ticket.priority, _now_ms())
        case Cancel(ticket=ticket):
            if heap.remove(ticket):
                _retire_cancelled(ticket, events)
        case Pull(slots=n):
            state.pulls += n
        case UpstreamClosed():
            return False
    return True


def _retire_cancelled(ticket: Ticket, events: trio.MemorySendChannel[Event]) -> None:
    ticket.terminate(RequestState.CANCELLED)
    wall = ticket.ms_since(ticket.submitted_at) or 0.0
    events.send_nowait(Finished(RequestState.CANCELLED, wall, None, None))
