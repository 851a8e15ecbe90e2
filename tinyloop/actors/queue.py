"""The queue actor: a priority heap (FIFO within a priority, with aging) in front of the engine.

It hands the best ticket to the dispatcher for each ``Pull`` (one per free engine slot), so a
request is chosen at the moment a slot frees up, never earlier. ``Cancel`` removes a queued
ticket; the queue then retires it as cancelled.

Cancellation: cancelled with its nursery; tickets still queued are failed by the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from tinyloop.actors.ticket import Failure, Ticket
from tinyloop.messages import Cancel, Enqueue, Event, Finished, Pull, Ready
from tinyloop.policy.queue import PriorityQueue
from tinyloop.requests import RequestState

__all__ = ["run", "Backlog"]


@dataclass(slots=True)
class Backlog:
    """Tickets admitted but not yet pushed: admission counts them as queued (no overshoot of
    ``max_queue_depth`` under a burst of submissions)."""

    in_transit: int = 0


def _now_ms() -> float:
    return trio.current_time() * 1000


async def run(*, inbox: trio.MemoryReceiveChannel[Enqueue | Cancel | Pull],
              outbox: trio.MemorySendChannel[Ready], events: trio.MemorySendChannel[Event],
              queue: PriorityQueue[Ticket], backlog: Backlog,
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    pulls = 0  # free engine slots the dispatcher asked to fill
    async with inbox, outbox, events:
        task_status.started()
        async for msg in inbox:
            match msg:
                case Enqueue(ticket=ticket):
                    backlog.in_transit -= 1
                    if ticket.cancelled:  # the caller left while admission forwarded it
                        _retire_cancelled(ticket, events)
                    else:
                        queue.push(ticket, ticket.priority, _now_ms())
                case Cancel(ticket=ticket, error=error):
                    if queue.remove(ticket):
                        _retire_cancelled(ticket, events, error)
                case Pull():
                    pulls += 1
            while pulls and len(queue):
                pulls -= 1
                await outbox.send(Ready(queue.pop(_now_ms())))


def _retire_cancelled(ticket: Ticket, events: trio.MemorySendChannel[Event],
                      error: BaseException | None = None) -> None:
    ticket.terminate(RequestState.CANCELLED, None if error is None else Failure(error))
    wall = ticket.ms_since(ticket.submitted_at) or 0.0
    events.send_nowait(Finished(RequestState.CANCELLED, wall, None, None))
