"""The dispatcher actor: fills free engine slots from the queue and decides how each request runs.

It starts with ``max_batch_size`` free slots, asks the queue for one ticket per free slot
(``Pull``), and gets a request's slots back with its ``SlotFreed`` from the engine. A beam search
takes one slot per beam (``Ticket.slots``), so one wide search cannot crowd a full batch of others
into the engine beside it. Every request dispatched while the prefix pool has entries (the
engine's ``EngineStatistics.prefix_pool_size``) goes through the pool, whatever its mode; the
``tinyloop_prefix_pool_hits_total`` counter keeps the seeds' rule and counts only the ``generate``
ones (whether or not a prefix then matches).

Each wake-up handles every message waiting and sends what it can dispatch in one ``Dispatch``:
``take_held`` decides which tickets run now, ``place`` where (one engine today: the place to
choose among several).

It owns the slot count and publishes ``DispatcherStatistics``; ``dispatched`` (ever) is half of
the runtime's one in-flight count (the engine's ``retired`` is the other half).

Shutdown: when the queue closes the Ready inbox and nothing waits for slots, the dispatcher
closes its outbox to the engine. Cancellation: cancelled with its nursery. A ticket cancelled by
its caller before it reached the engine is retired here and its slot pulled again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from tinyloop.actors.mailbox import UpstreamClosed, receive_all
from tinyloop.actors.ticket import Ticket
from tinyloop.messages import Dispatch, Event, Finished, PoolDispatched, Pull, Ready, SlotFreed
from tinyloop.requests import RequestState
from tinyloop.settings import Settings

__all__ = ["run", "DispatcherStatistics", "DispatcherState"]


@dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    slots: int
    slots_used: int  # by requests dispatched whose SlotFreed has not come back (beams weigh more)
    dispatched: int  # requests sent to the engine, ever
    slots_taken: int  # the slots those requests took, ever (less the engine's ``slots_freed``: in use now)
    via_pool: int


class DispatcherState:
    """The dispatcher's state (written by the actor only; read through ``statistics()``)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.slots_used = 0
        self.dispatched = 0
        self.slots_taken = 0
        self.via_pool = 0
        self.asked = 0  # Pulls sent and not answered yet
        self.held: deque[Ticket] = deque()  # pulled, waiting for their slots (a wide beam search)

    def statistics(self) -> DispatcherStatistics:
        return DispatcherStatistics(self.slots, self.slots_used, self.dispatched, self.slots_taken,
                                    self.via_pool)

    def __repr__(self) -> str:
        return f"<DispatcherState {self.slots_used}/{self.slots} held={len(self.held)}>"


async def run(*, inbox: trio.MemoryReceiveChannel[Ready | SlotFreed | UpstreamClosed],
              outbox: trio.MemorySendChannel[Dispatch], settings: Settings,
              pulls: trio.MemorySendChannel[Pull], events: trio.MemorySendChannel[Event],
              pool_size: Callable[[], int],
              task_status: trio.TaskStatus[DispatcherState] = trio.TASK_STATUS_IGNORED) -> None:
    """``pool_size`` reads the engine actor's published prefix pool size."""
    state = DispatcherState(settings.max_batch_size)
    held = state.held

    def top_up() -> None:
        free = state.slots - state.slots_used - state.asked
        if held or free <= 0:
            return
        try:
            pulls.send_nowait(Pull(free))  # one message for every free slot
        except trio.BrokenResourceError:
            return  # the queue has finished: nothing more to pull
        state.asked += free

    def take_held() -> list[Ticket]:
        """The held tickets that fit in the free slots now, in order, their slots taken. A beam
        search wider than the free slots waits for them (runs alone if wider than all of them),
        and what was pulled after it waits behind it."""
        batch = []
        while held and (state.slots_used == 0 or state.slots_used + held[0].slots <= state.slots):
            ticket = held.popleft()
            if ticket.gone:
                ticket.terminate(RequestState.CANCELLED)
                events.send_nowait(Finished(RequestState.CANCELLED,
                                            ticket.ms_since(ticket.submitted_at) or 0.0, None, None))
                continue
            ticket.state = RequestState.DISPATCHED
            state.slots_used += ticket.slots
            state.slots_taken += ticket.slots
            batch.append(ticket)
        return batch

    async def place(batch: list[Ticket]) -> None:
        """Send what was taken to the engine: the one place that decides where tickets run."""
        via_pool = pool_size() > 0
        if via_pool:
            hits = sum(t.request.mode == "generate" for t in batch)
            if hits:
                state.via_pool += hits
                events.send_nowait(PoolDispatched(hits))
        state.dispatched += len(batch)
        await outbox.send(Dispatch(batch, via_pool))  # one message per wake-up

    upstream_open = True
    async with outbox, pulls, events, inbox:
        top_up()
        task_status.started(state)
        while upstream_open or held:
            try:
                batch = await receive_all(inbox)
            except trio.EndOfChannel:
                break
            for msg in batch:
                match msg:
                    case SlotFreed(tickets=tickets):
                        state.slots_used -= sum(t.slots for t in tickets)
                    case Ready(tickets=tickets):
                        state.asked -= len(tickets)
                        held.extend(tickets)
                    case UpstreamClosed():
                        upstream_open = False
            if dispatch := take_held():
                await place(dispatch)
            if not upstream_open and not held:
                break
            top_up()
