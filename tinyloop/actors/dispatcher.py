"""The dispatcher actor: fills free engine slots from the queue and decides how each request runs.

It starts with ``max_batch_size`` free slots, asks the queue for one ticket per free slot
(``Pull``), and gets a slot back for each ``SlotFreed`` from the engine. Every request dispatched
while the prefix pool has entries goes through the pool, whatever its mode; the
``tinyloop_prefix_pool_hits_total`` counter keeps the seeds' rule and counts only the ``generate``
ones (whether or not a prefix then matches).

Cancellation: cancelled with its nursery. A ticket cancelled by its caller before it reached
the engine is retired here and its slot pulled again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from tinyloop.messages import Dispatch, Event, Finished, PoolDispatched, Pull, Ready, SlotFreed
from tinyloop.requests import RequestState

__all__ = ["run", "DispatcherState"]


@dataclass(slots=True)
class DispatcherState:
    """Slots and in-flight count, shared read-only with the runtime's statistics."""

    slots: int
    in_flight: int = 0
    dispatched: int = 0
    via_pool: int = 0


async def run(*, inbox: trio.MemoryReceiveChannel[Ready | SlotFreed],
              outbox: trio.MemorySendChannel[Dispatch], pulls: trio.MemorySendChannel[Pull],
              events: trio.MemorySendChannel[Event], state: DispatcherState,
              pool_size: Callable[[], int],
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with inbox, outbox, pulls, events:
        for _ in range(state.slots):
            pulls.send_nowait(Pull())
        task_status.started()
        async for msg in inbox:
            match msg:
                case SlotFreed():
                    state.in_flight -= 1
                    pulls.send_nowait(Pull())
                case Ready(ticket=ticket):
                    if ticket.cancelled:
                        ticket.terminate(RequestState.CANCELLED)
                        events.send_nowait(Finished(RequestState.CANCELLED,
                                                    ticket.ms_since(ticket.submitted_at) or 0.0, None, None))
                        pulls.send_nowait(Pull())
                        continue
                    via_pool = pool_size() > 0
                    if via_pool and ticket.request.mode == "generate":
                        state.via_pool += 1
                        events.send_nowait(PoolDispatched())
                    ticket.state = RequestState.DISPATCHED
                    state.in_flight += 1
                    state.dispatched += 1
                    await outbox.send(Dispatch(ticket, via_pool))
