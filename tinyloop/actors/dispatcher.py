"""The dispatcher actor: fills free engine slots from the queue and decides how each request runs.

It starts with ``max_batch_size`` free slots, asks the queue for one ticket per free slot
(``Pull``), and gets a request's slots back with its ``SlotFreed`` from the engine. A beam search
takes one slot per beam (``weight``), so one wide search cannot crowd a full batch of others
into the engine beside it. Every request dispatched
while the prefix pool has entries goes through the pool, whatever its mode; the
``tinyloop_prefix_pool_hits_total`` counter keeps the seeds' rule and counts only the ``generate``
ones (whether or not a prefix then matches).

Cancellation: cancelled with its nursery. A ticket cancelled by its caller before it reached
the engine is retired here and its slot pulled again.
"""

from __future__ import annotations

from collections.abc import Callable
from collections import deque
from dataclasses import dataclass

import trio

from tinyloop.actors.ticket import Ticket
from tinyloop.messages import Dispatch, Event, Finished, PoolDispatched, Pull, Ready, SlotFreed
from tinyloop.requests import RequestState

__all__ = ["run", "DispatcherState"]


@dataclass(slots=True)
class DispatcherState:
    """Slots and in-flight count (in slots: a beam search takes one per beam), shared read-only
    with the runtime's statistics."""

    slots: int
    in_flight: int = 0
    dispatched: int = 0
    via_pool: int = 0


def weight(ticket: Ticket) -> int:
    """Engine slots a request takes: one per beam of a beam search (its beams decode as that
    many rows of every step), one otherwise. Speculation's extra rows are capped per step by
    the engine (``max_draft_nodes``) instead."""
    beam = ticket.request.beam
    return beam[0] if beam is not None else 1


async def run(*, inbox: trio.MemoryReceiveChannel[Ready | SlotFreed],
              outbox: trio.MemorySendChannel[Dispatch], pulls: trio.MemorySendChannel[Pull],
              events: trio.MemorySendChannel[Event], state: DispatcherState,
              pool_size: Callable[[], int],
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    asked = 0  # Pulls sent and not answered yet
    held: deque[Ticket] = deque()  # pulled, waiting for their slots (a wide beam search)

    def top_up() -> None:
        nonlocal asked
        while not held and state.in_flight + asked < state.slots:
            pulls.send_nowait(Pull())
            asked += 1

    async def dispatch_held() -> None:
        # A beam search wider than the free slots waits for them (runs alone if wider than
        # all of them), and what was pulled after it waits behind it.
        while held and (state.in_flight == 0 or state.in_flight + weight(held[0]) <= state.slots):
            ticket = held.popleft()
            if ticket.cancelled:
                ticket.terminate(RequestState.CANCELLED)
                events.send_nowait(Finished(RequestState.CANCELLED,
                                            ticket.ms_since(ticket.submitted_at) or 0.0, None, None))
                continue
            via_pool = pool_size() > 0
            if via_pool and ticket.request.mode == "generate":
                state.via_pool += 1
                events.send_nowait(PoolDispatched())
            ticket.state = RequestState.DISPATCHED
            state.in_flight += weight(ticket)
            state.dispatched += 1
            await outbox.send(Dispatch(ticket, via_pool))

    async with inbox, outbox, pulls, events:
        top_up()
        task_status.started()
        async for msg in inbox:
            match msg:
                case SlotFreed(ticket=ticket):
                    state.in_flight -= weight(ticket)
                case Ready(ticket=ticket):
                    asked -= 1
                    held.append(ticket)
            await dispatch_held()
            top_up()
