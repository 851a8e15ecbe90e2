"""The dispatcher actor: fills free engine slots from the queue, and places each request on an engine.

Each engine has ``max_batch_size`` slots. The dispatcher asks the queue for one ticket per free
slot (``Pull``) and gets a request's slots back with its ``SlotFreed`` from the engine that ran
it. A beam search takes one slot per beam (``Ticket.slots``), so one wide search cannot crowd a
full batch of others into an engine beside it. Every request dispatched to an engine whose
prefix pool has entries (``EngineView.pool_size``) goes through that pool, whatever its mode;
the ``tinyloop_prefix_pool_hits_total`` counter keeps the seeds' rule and counts only the
``generate`` ones (whether or not a prefix then matches).

Placement (several engines): ``place`` picks the engine for each ticket, by
``policy/placement.py``: the engine that holds the longest cached prefix of its prompt (prompts
sent there before, prefixes registered in its pool) when it has room, else the least loaded
(free slots, then free KV blocks). An engine that breaks (``EngineView.broken``) leaves the pool:
nothing more is placed on it, its slots stop counting, and only the requests it held fail. Once
every engine is broken, requests still go to one, which fails them at once (admission refuses new
ones). With one engine there is nothing to choose and no prompt is hashed.

Each wake-up handles every message waiting and sends what it can dispatch in one ``Dispatch`` per
engine: ``take_held`` decides which tickets run now and where.

It owns the slot counts and publishes ``DispatcherStatistics``; ``dispatched`` (ever) is half of
the runtime's one in-flight count (the engines' ``retired`` is the other half).

Shutdown: when the queue closes the Ready inbox and nothing waits for slots, the dispatcher
closes its outboxes to the engines. Cancellation: cancelled with its nursery. A ticket cancelled
by its caller before it reached an engine is retired here and its slot pulled again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from tinyloop.actors.mailbox import UpstreamClosed, receive_all
from tinyloop.actors.ticket import Ticket
from tinyloop.messages import Dispatch, Event, Finished, PoolDispatched, Pull, Ready, SlotFreed
from tinyloop.policy.placement import Placement, Room
from tinyloop.requests import RequestState
from tinyloop.settings import Settings

__all__ = ["run", "DispatcherStatistics", "DispatcherState", "EngineView"]


class EngineView(Protocol):
    """What the dispatcher reads of an engine actor's published state (``EngineState``)."""

    def pool_size(self) -> int:
        """Entries in its prefix pool."""
        ...

    def prefix_covers(self, prompt: Sequence[int], loops: int, window: int) -> int:
        """Prompt tokens the longest entry of its prefix pool covers (0: none)."""
        ...

    def free_blocks(self) -> int | None:
        """KV blocks its pool can hand out now (None: not counted)."""
        ...

    def broken(self) -> str | None:
        """Why it is broken, or None while it is fine."""
        ...


@dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    slots: int  # of the engines in the pool (a broken engine's leave it)
    slots_used: int  # by requests dispatched whose SlotFreed has not come back (beams weigh more)
    dispatched: int  # requests sent to the engines, ever
    slots_taken: int  # the slots those requests took, ever (less the engines' ``slots_freed``: in use now)
    via_pool: int
    engine_slots_used: tuple[int, ...] = ()  # slots_used per engine


class DispatcherState:
    """The dispatcher's state (written by the actor only; read through ``statistics()``)."""

    def __init__(self, engine_slots: int, engines: int = 1, block_size: int = 16) -> None:
        self.engine_slots = engine_slots
        self.used = [0] * engines  # slots held per engine
        self.left: set[int] = set()  # broken engines, out of the pool
        self.dispatched = 0
        self.slots_taken = 0
        self.via_pool = 0
        self.asked = 0  # Pulls sent and not answered yet
        self.held: deque[Ticket] = deque()  # pulled, waiting for their slots (a wide beam search)
        self.placement = Placement(engines, block_size)
        self.usable = list(range(engines))  # the engines requests go to (``leave_broken``)

    @property
    def slots(self) -> int:
        return self.engine_slots * len(self.usable)

    @property
    def slots_used(self) -> int:
        return sum(self.used[i] for i in self.usable)

    def statistics(self) -> DispatcherStatistics:
        return DispatcherStatistics(self.slots, self.slots_used, self.dispatched, self.slots_taken,
                                    self.via_pool, tuple(self.used))

    def __repr__(self) -> str:
        return (f"<DispatcherState {self.slots_used}/{self.slots} held={len(self.held)} "
                f"per_engine={self.used} left={sorted(self.left)}>")

    def fits(self, engine: int, ticket: Ticket) -> bool:
        """A request fits an engine with slots for it; one wider than an engine runs alone there."""
        used = self.used[engine]
        return used == 0 or used + ticket.slots <= self.engine_slots

    def place(self, ticket: Ticket, engines: Sequence[EngineView]) -> int | None:
        """The engine ``ticket`` runs on now (its slots taken there), or None: no room yet."""
        if len(self.used) == 1:  # one engine: nothing to choose
            engine: int | None = 0 if self.fits(0, ticket) else None
        else:
            engine = self._choose(ticket, engines)
        if engine is not None:
            self.used[engine] += ticket.slots
        return engine

    def _choose(self, ticket: Ticket, engines: Sequence[EngineView]) -> int | None:
        """Among the engines the ticket fits: the placement policy's pick."""
        fits = [i for i in self.usable if self.fits(i, ticket)]
        if len(fits) <= 1:
            return fits[0] if fits else None
        req = ticket.request
        loops, window = ((ticket.resolved.loops, ticket.resolved.window) if ticket.resolved is not None
                         else (req.loops or 0, req.cache_window or 0))
        rooms = [Room(i, self.engine_slots - self.used[i], engines[i].free_blocks()) for i in fits]
        registered = {i: engines[i].prefix_covers(req.prompt_tokens, loops, window)
                      for i in fits if engines[i].pool_size()}
        return self.placement.choose(req.prompt_tokens, (loops, window), rooms, ticket.slots, registered)

    def leave_broken(self, engines: Sequence[EngineView]) -> None:
        """Engines that broke since the last look leave the pool; once every one has broken,
        requests go to all of them (each fails them at once)."""
        for i in self.usable:
            if i not in self.left and engines[i].broken() is not None:
                self.left.add(i)
                self.placement.forget_engine(i)
        everyone = range(len(self.used))
        self.usable = [i for i in everyone if i not in self.left] or list(everyone)


async def run(*, inbox: trio.MemoryReceiveChannel[Ready | SlotFreed | UpstreamClosed],
              outboxes: Sequence[trio.MemorySendChannel[Dispatch]], settings: Settings,
              pulls: trio.MemorySendChannel[Pull], events: trio.MemorySendChannel[Event],
              engines: Sequence[EngineView],
              task_status: trio.TaskStatus[DispatcherState] = trio.TASK_STATUS_IGNORED) -> None:
    """``outboxes[i]`` and ``engines[i]``: engine i's inbox and published state."""
    state = DispatcherState(settings.max_batch_size, len(outboxes), settings.kv_block_size)
    held = state.held

    def top_up() -> None:
        free = sum(max(0, state.engine_slots - state.used[i]) for i in state.usable) - state.asked
        if held or free <= 0:
            return
        try:
            pulls.send_nowait(Pull(free))  # one message for every free slot
        except trio.BrokenResourceError:
            return  # the queue has finished: nothing more to pull
        state.asked += free

    def take_held() -> dict[int, list[Ticket]]:
        """The held tickets that fit in the free slots now, in order, each placed on an engine
        (its slots taken there). A beam search wider than the free slots waits for them (runs
        alone if wider than an engine), and what was pulled after it waits behind it."""
        batches: dict[int, list[Ticket]] = {}
        while held:
            ticket = held[0]
            if ticket.gone:
                held.popleft()
                ticket.terminate(RequestState.CANCELLED)
                events.send_nowait(Finished(RequestState.CANCELLED,
                                            ticket.ms_since(ticket.submitted_at) or 0.0, None, None))
                continue
            engine = state.place(ticket, engines)
            if engine is None:
                break
            held.popleft()
            ticket.state = RequestState.DISPATCHED
            state.slots_taken += ticket.slots
            batches.setdefault(engine, []).append(ticket)
        return batches

    async def send(engine: int, batch: list[Ticket]) -> None:
        """One Dispatch to the engine, through its prefix pool when that has entries."""
        via_pool = engines[engine].pool_size() > 0
        if via_pool:
            hits = sum(t.request.mode == "generate" for t in batch)
            if hits:
                state.via_pool += hits
                events.send_nowait(PoolDispatched(hits))
        state.dispatched += len(batch)
        await outboxes[engine].send(Dispatch(batch, via_pool))

    upstream_open = True
    try:
        async with pulls, events, inbox:
            top_up()
            task_status.started(state)
            while upstream_open or held:
                try:
                    batch = await receive_all(inbox)
                except trio.EndOfChannel:
                    break
                for msg in batch:
                    match msg:
                        case SlotFreed(tickets=tickets, engine=engine):
                            state.used[engine] -= sum(t.slots for t in tickets)
                        case Ready(tickets=tickets):
                            state.asked -= len(tickets)
                            held.extend(tickets)
                        case UpstreamClosed():
                            upstream_open = False
                if len(engines) > 1:
                    state.leave_broken(engines)
                for engine, tickets in take_held().items():
                    await send(engine, tickets)
                if not upstream_open and not held:
                    break
                top_up()
    finally:
        for outbox in outboxes:
            outbox.close()
