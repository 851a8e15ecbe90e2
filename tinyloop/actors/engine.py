"""The engine actor: owns the engine and runs the continuous-batching iteration loop.

Each iteration: take newly dispatched tickets (start their sequences, through the prefix pool
when the dispatcher said so, and report how much of each prompt's KV came from the pool or the
engine's prefix cache as ``PrefixLookup``), drop sequences whose caller went away, run one ``step`` over all
active sequences (a prefill chunk for new ones, one batched decode for the rest, in a worker
thread), deliver each new token to its ticket, retire finished sequences and free their KV.

KV: a request starts only when the KV blocks it can come to hold (``kv_blocks_needed``: its
prompt plus ``max_tokens`` in every slot) fit beside what the running ones can come to hold, so
running sequences never run out of blocks half way. One that does not fit waits here, in
dispatch order, until enough finish; one larger than the whole pool starts when nothing else
runs. Idle prefix-cache blocks count as free (they are evicted on demand); blocks that
registered prefixes pin do not (a request sharing them counts them twice: it may wait longer
than it must, never run short).

Errors: a sequence that fails on its own (no KV blocks) fails its request only. A step that
raises ``EngineError`` fails the requests of that step; ``EngineBroken`` also marks the runtime
unhealthy, and every later dispatch fails at once.

Cancellation: cancelled with its nursery; a step already running in the worker thread finishes
first (threads are not interruptible). Sequences still active are freed on the way out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import trio

from tinyloop.actors.ticket import Failure, Final, Ticket
from tinyloop.engine.port import EnginePort, engine_errors
from tinyloop.engine.prefix_pool import PrefixPool
from tinyloop.errors import EngineBroken, EngineError, SchedulerShutdown, TinyLoopError
from tinyloop.messages import (
    Dispatch, Event, Finished, FirstToken, Observe, PrefixLookup, RegisterPrefix, SlotFreed, Started,
    StepDone,
)
from tinyloop.requests import GenerationResult, RequestState

__all__ = ["run", "Health"]


@dataclass(slots=True)
class Health:
    """Why the engine is unusable, or None while it is fine."""

    broken: str | None = None


class _Loop:
    """The actor's state: active sequences and the channels it reports on."""

    def __init__(self, engine: EnginePort, pool: PrefixPool[Any], health: Health,
                 freed: trio.MemorySendChannel[SlotFreed], observe: trio.MemorySendChannel[Observe],
                 events: trio.MemorySendChannel[Event]) -> None:
        self.engine, self.pool, self.health = engine, pool, health
        self.freed, self.observe, self.events = freed, observe, events
        self.active: dict[int, tuple[Any, Ticket]] = {}
        self.waiting: deque[tuple[Ticket, bool]] = deque()  # dispatched, waiting for KV
        self.reserved: dict[int, int] = {}  # id(seq) -> the KV blocks it may come to hold
        self.committed = 0  # sum of reserved

    # -- messages ------------------------------------------------------------------------------
    async def handle(self, msg: Dispatch | RegisterPrefix) -> None:
        match msg:
            case Dispatch(ticket=ticket, via_pool=via_pool):
                await self.admit(ticket, via_pool)
            case RegisterPrefix(tokens=tokens, loops=loops, cache_window=window, reply=reply):
                try:
                    with engine_errors():
                        handle = await self.engine.prefill_prefix(tokens, loops, window)
                except TinyLoopError as exc:
                    reply.send_nowait(exc)
                    return
                for old in self.pool.add(tokens, handle.loops, handle.window, handle):
                    self.engine.free(old)
                reply.send_nowait(None)

    async def admit(self, ticket: Ticket, via_pool: bool) -> None:
        """Start a dispatched ticket, or line it up behind those waiting for KV."""
        self.waiting.append((ticket, via_pool))
        await self.start_waiting()

    def _blocks(self, ticket: Ticket) -> int:
        try:
            return self.engine.kv_blocks_needed(ticket.request) or 0
        except TinyLoopError:
            return 0  # start() raises the same error for the caller

    def _fits(self, blocks: int) -> bool:
        if not blocks or not self.active:
            return True
        stats = self.engine.kv_statistics()
        if stats is None:
            return True
        pinned = sum(self.engine.kv_blocks_held(h) or 0 for h in self.pool.handles())
        return self.committed + blocks <= stats.blocks_total - pinned

    async def start_waiting(self) -> None:
        """Start waiting tickets in dispatch order while their KV fits (cancelled ones leave)."""
        while self.waiting:
            ticket, via_pool = self.waiting[0]
            blocks = 0 if ticket.cancelled or self.health.broken else self._blocks(ticket)
            if not self._fits(blocks):
                return
            self.waiting.popleft()
            await self._start(ticket, via_pool, blocks)

    async def _start(self, ticket: Ticket, via_pool: bool, blocks: int) -> None:
        now = trio.current_time()
        ticket.dispatched_at = now
        self.events.send_nowait(Started((now - ticket.submitted_at) * 1000))
        if ticket.cancelled:
            await self.retire(None, ticket, RequestState.CANCELLED)
            return
        if self.health.broken is not None:
            await self.retire(None, ticket, RequestState.ERROR,
                              EngineBroken(f"the engine is broken: {self.health.broken}"))
            return
        req = ticket.request
        try:
            prefix = None
            if via_pool:
                loops = req.loops or self.engine.default_loops
                window = min(req.cache_window or loops, loops)
                found = self.pool.find(req.prompt_tokens, loops, window)
                prefix = None if found is None else found[1]
            with engine_errors():
                seq = self.engine.start(req, prefix)
        except TinyLoopError as exc:
            await self.retire(None, ticket, RequestState.ERROR, exc)
            return
        self.events.send_nowait(PrefixLookup(len(req.prompt_tokens), seq.cached_tokens))
        ticket.state = RequestState.DECODING
        self.active[id(seq)] = (seq, ticket)
        self.reserved[id(seq)] = blocks
        self.committed += blocks

    # -- one iteration -------------------------------------------------------------------------
    async def step(self) -> None:
        await self.reap()
        await self.start_waiting()
        if not self.active:
            return
        seqs = [seq for seq, _ in self.active.values()]
        try:
            with engine_errors():  # a foreign exception fails this step's requests, not the runtime
                events = await self.engine.step(seqs)
        except TinyLoopError as exc:
            if isinstance(exc, EngineBroken):
                self.health.broken = str(exc)
            for seq, ticket in list(self.active.values()):
                await self.retire(seq, ticket, RequestState.ERROR, exc)
            return
        self.events.send_nowait(StepDone(len(seqs)))
        for ev in events:
            seq, ticket = self.active[id(ev.sequence)]
            if ticket.first_token_at is None:
                ticket.first_token_at = trio.current_time()
                if ticket.stream:
                    self.events.send_nowait(FirstToken(ticket.ms_since(ticket.submitted_at) or 0.0))
            ticket.deliver(ev.chunk())
        await self.reap()

    async def reap(self) -> None:
        """Retire finished sequences and those whose caller left (waiting for KV or running)."""
        for entry in [e for e in self.waiting if e[0].cancelled]:
            self.waiting.remove(entry)
            await self._start(*entry, 0)  # retires it, cancelled
        for seq, ticket in list(self.active.values()):
            if ticket.cancelled:
                await self.retire(seq, ticket, RequestState.CANCELLED)
            elif seq.finished:
                if seq.error is not None:
                    err = seq.error if isinstance(seq.error, TinyLoopError) else EngineError(str(seq.error))
                    await self.retire(seq, ticket, RequestState.ERROR, err)
                else:
                    await self.retire(seq, ticket, RequestState.DONE)

    async def retire(self, seq: Any, ticket: Ticket, state: RequestState,
                     error: BaseException | None = None) -> None:
        result: GenerationResult | None = None
        if seq is not None:
            self.active.pop(id(seq), None)
            self.committed -= self.reserved.pop(id(seq), 0)
            if state is RequestState.DONE:
                result = seq.result()
            self.engine.free(seq)
        dispatch_ms = ticket.ms_since(ticket.dispatched_at)
        if result is not None:
            ticket.terminate(state, Final(result))
            await self.observe.send(Observe(dispatch_ms or 0.0, result.loops_used or 1,
                                            max(result.completion_tokens, 1)))
        else:
            ticket.terminate(state, Failure(error) if error is not None else None)
        self.events.send_nowait(Finished(state, ticket.ms_since(ticket.submitted_at) or 0.0,
                                         dispatch_ms, result))
        await self.freed.send(SlotFreed(ticket))

    async def close(self) -> None:
        for ticket in [t for t, _ in self.waiting] + [t for _, t in self.active.values()]:
            ticket.cancelled = True
            if ticket.cancel_error is None:  # the runtime stopped under a caller still reading
                ticket.cancel_error = SchedulerShutdown("the runtime stopped while this request ran")
        with trio.CancelScope(shield=True):
            await self.reap()


async def run(*, inbox: trio.MemoryReceiveChannel[Dispatch | RegisterPrefix],
              freed: trio.MemorySendChannel[SlotFreed], observe: trio.MemorySendChannel[Observe],
              events: trio.MemorySendChannel[Event], engine: EnginePort, pool: PrefixPool[Any],
              health: Health, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    loop = _Loop(engine, pool, health, freed, observe, events)
    async with inbox, freed, observe, events:
        task_status.started()
        try:
            closed = False
            while not (closed and not loop.active and not loop.waiting):
                if not loop.active and not loop.waiting and not closed:
                    try:
                        await loop.handle(await inbox.receive())
                    except trio.EndOfChannel:
                        closed = True
                while not closed:
                    try:
                        msg = inbox.receive_nowait()
                    except trio.WouldBlock:
                        break
                    except trio.EndOfChannel:
                        closed = True
                        break
                    await loop.handle(msg)
                await loop.step()
                await trio.lowlevel.checkpoint()
        finally:
            await loop.close()
            for handle in pool.clear():
                engine.free(handle)
