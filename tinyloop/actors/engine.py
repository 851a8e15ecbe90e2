"""The engine actor: owns the engine and runs the continuous-batching iteration loop.

Each iteration: drop sequences whose caller went away, plan the KV (``policy/kvplan.py``:
preempt the youngest growing sequence while the batch's next step does not fit, then start
waiting entries that fit), run one ``step`` over all active sequences (a prefill chunk for new
ones, one batched decode for the rest, in a worker thread), deliver each new token to its
ticket, retire finished sequences and free their KV.

KV: a sequence takes blocks as it grows. A dispatched request starts once its prompt fits beside
what the running ones need next; until then it waits (state ``dispatched``), and one that fits
may start before an earlier one that does not, until that one has waited ``kv_aging_ms``.
When the pool runs short, the youngest growing sequence is preempted: its KV is freed (its full
blocks go to the prefix cache) and it waits at the front to be recomputed, then decodes on with
the tokens it would have produced anyway. Warm-start, adaptive-exit and beam requests, whose KV a
recompute would not reproduce, set their worst case aside when they start and are never
preempted. A request that could not fit in the whole pool was refused at admission
(``Engine.validate``). A prefix registration (``RegisterPrefix``) waits and prefills the same way,
a chunk per step beside the other sequences, then joins the prefix pool.

Errors: a sequence that fails on its own (no KV blocks, a NaN row, its sampler or stop check)
fails its request only: the engine isolates it (``Engine.step``). A step that raises
``EngineError`` fails the requests of that step; ``EngineBroken`` also marks the runtime
unhealthy, and every later dispatch fails at once.

Cancellation: cancelled with its nursery; a step already running in the worker thread finishes
first (threads are not interruptible). Sequences still active are freed on the way out.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from tinyloop.actors.ticket import Failure, Final, Ticket
from tinyloop.actors.port import EnginePort, engine_errors
from tinyloop.policy.prefix_pool import PrefixPool
from tinyloop.errors import EngineBroken, EngineError, SchedulerShutdown, TinyLoopError
from tinyloop.messages import (
    Dispatch, Event, Finished, FirstToken, Observe, Preempted, PrefixLookup, RegisterPrefix, SlotFreed,
    Started, StepDone,
)
from tinyloop.policy.kvplan import KVPlanner, Running, Waiting
from tinyloop.requests import GenerationResult, RequestState

__all__ = ["run", "Health"]


@dataclass(slots=True)
class Health:
    """Why the engine is unusable, or None while it is fine."""

    broken: str | None = None


@dataclass(eq=False, slots=True)
class _Entry:
    """A request (or a prefix registration) the actor holds, waiting or running.

    ``seq`` is None until the request first starts; a preempted entry keeps its sequence.
    """

    ticket: Ticket | None
    via_pool: bool = False
    prefix: RegisterPrefix | None = None
    seq: Any = None
    order: int = 0  # dispatch order: a higher one is younger (preempted first)
    since: float = 0.0  # when it began waiting (trio time)
    started: bool = False  # has run before (a Started event was sent)


@dataclass(eq=False)
class _Loop:
    """The actor's state: waiting and active entries, and the channels it reports on."""

    engine: EnginePort
    pool: PrefixPool[Any]
    health: Health
    freed: trio.MemorySendChannel[SlotFreed]
    observe: trio.MemorySendChannel[Observe]
    events: trio.MemorySendChannel[Event]
    planner: KVPlanner
    active: dict[int, _Entry] = field(default_factory=dict)  # id(seq) -> entry
    waiting: deque[_Entry] = field(default_factory=deque)  # dispatched, not running
    counter: itertools.count[int] = field(default_factory=itertools.count)
    outgoing: list[SlotFreed | Observe] = field(default_factory=list)  # sent by flush()

    async def flush(self) -> None:
        """Send what retiring produced (the dispatcher's slots, the predictor's samples)."""
        while self.outgoing:
            msg = self.outgoing.pop(0)
            if isinstance(msg, SlotFreed):
                await self.freed.send(msg)
            else:
                await self.observe.send(msg)

    # -- messages ------------------------------------------------------------------------------
    def handle(self, msg: Dispatch | RegisterPrefix) -> None:
        match msg:
            case Dispatch(ticket=ticket, via_pool=via_pool):
                self.waiting.append(_Entry(ticket, via_pool, order=next(self.counter),
                                           since=trio.current_time()))
            case RegisterPrefix():
                self.waiting.append(_Entry(None, prefix=msg, order=next(self.counter),
                                           since=trio.current_time()))

    # -- planning the KV -----------------------------------------------------------------------
    def _start_blocks(self, entry: _Entry) -> int:
        try:
            if entry.seq is not None:
                demand = self.engine.kv_demand(entry.seq)
                return 0 if demand is None else demand.next_blocks
            if entry.prefix is not None:
                return self.engine.kv_prefix_blocks(entry.prefix.tokens, entry.prefix.loops,
                                                    entry.prefix.cache_window) or 0
            assert entry.ticket is not None
            return self.engine.kv_start_blocks(entry.ticket.request) or 0
        except TinyLoopError:
            return 0  # starting raises the same error for the caller

    def _running(self) -> list[Running]:
        out = []
        for key, entry in self.active.items():
            d = self.engine.kv_demand(entry.seq)
            if d is not None:
                out.append(Running(key, entry.order, d.next_blocks, d.outstanding, d.preemptible,
                                   d.headroom))
        return out

    def plan(self) -> None:
        """Preempt what the next step cannot hold, then start what fits (module docstring)."""
        available = self.engine.kv_available()
        if available is None or self.health.broken is not None:
            for entry in list(self.waiting):
                self._start(entry)
            self.waiting.clear()
            return
        while (victim := self.planner.preempt(self._running(), available)) is not None:
            self._preempt(self.active.pop(victim))
            available = self.engine.kv_available() or 0
        now = trio.current_time()
        candidates = [Waiting(i, self._start_blocks(e), e.since) for i, e in enumerate(self.waiting)]
        chosen = set(self.planner.admit(candidates, self._running(), available, now))
        if chosen:
            entries = list(self.waiting)
            self.waiting = deque(e for i, e in enumerate(entries) if i not in chosen)
            for i in sorted(chosen):
                self._start(entries[i])

    def _preempt(self, entry: _Entry) -> None:
        self.engine.preempt(entry.seq)
        self.events.send_nowait(Preempted())
        entry.since = trio.current_time()
        self.waiting.appendleft(entry)  # first in line to run again

    # -- starting ------------------------------------------------------------------------------
    def _start(self, entry: _Entry) -> None:
        if entry.prefix is not None:
            self._start_prefix(entry, entry.prefix)
            return
        ticket = entry.ticket
        assert ticket is not None
        if entry.seq is not None:  # a preempted sequence runs again
            if ticket.cancelled or self.health.broken is not None:
                self.active[id(entry.seq)] = entry  # reap() retires it
                return
            self.engine.resume(entry.seq)
            self.active[id(entry.seq)] = entry
            return
        if ticket.cancelled:
            self.retire(None, ticket, RequestState.CANCELLED)
            return
        if self.health.broken is not None:
            self.retire(None, ticket, RequestState.ERROR,
                        EngineBroken(f"the engine is broken: {self.health.broken}"))
            return
        now = trio.current_time()
        ticket.dispatched_at = now
        req = ticket.request
        self.events.send_nowait(Started((now - ticket.submitted_at) * 1000, len(req.prompt_tokens)))
        try:
            prefix = None
            if entry.via_pool:
                loops = req.loops or self.engine.default_loops
                window = min(req.cache_window or loops, loops)
                found = self.pool.find(req.prompt_tokens, loops, window)
                prefix = None if found is None else found[1]
            with engine_errors():
                seq = self.engine.start(req, prefix)
        except TinyLoopError as exc:
            self.retire(None, ticket, RequestState.ERROR, exc)
            return
        self.events.send_nowait(PrefixLookup(len(req.prompt_tokens), seq.cached_tokens))
        ticket.state = RequestState.DECODING
        entry.seq = seq
        self.active[id(seq)] = entry

    def _start_prefix(self, entry: _Entry, msg: RegisterPrefix) -> None:
        try:
            with engine_errors():
                entry.seq = self.engine.start_prefix(msg.tokens, msg.loops, msg.cache_window)
        except TinyLoopError as exc:
            _reply(msg, exc)
            return
        self.active[id(entry.seq)] = entry

    # -- one iteration -------------------------------------------------------------------------
    async def step(self) -> None:
        self.reap()
        self.plan()
        self.reap()  # prefixes that needed no prefill, entries started cancelled
        await self.flush()
        if not self.active:
            return
        seqs = [e.seq for e in self.active.values()]
        try:
            with engine_errors():  # a foreign exception fails this step's requests, not the runtime
                events = await self.engine.step(seqs)
        except TinyLoopError as exc:
            if isinstance(exc, EngineBroken):
                self.health.broken = str(exc)
            for entry in list(self.active.values()):
                self._retire_entry(entry, RequestState.ERROR, exc)
            await self.flush()
            return
        self.events.send_nowait(StepDone(len(seqs), len(events)))
        for ev in events:
            ticket = self.active[id(ev.sequence)].ticket
            assert ticket is not None
            if ticket.first_token_at is None:
                ticket.first_token_at = trio.current_time()
                if ticket.stream:
                    self.events.send_nowait(FirstToken(ticket.ms_since(ticket.submitted_at) or 0.0))
            ticket.deliver(ev.chunk())
        self.reap()
        await self.flush()

    def reap(self) -> None:
        """Retire finished sequences and those whose caller left (waiting or running)."""
        for entry in [e for e in self.waiting if e.ticket is not None and e.ticket.cancelled]:
            self.waiting.remove(entry)
            self._retire_entry(entry, RequestState.CANCELLED)
        for entry in list(self.active.values()):
            seq, ticket = entry.seq, entry.ticket
            if ticket is None:
                if seq.finished or not seq.prefilling:
                    self._finish_prefix(entry)
            elif ticket.cancelled:
                self.retire(seq, ticket, RequestState.CANCELLED)
            elif seq.finished:
                if seq.error is not None:
                    err = seq.error if isinstance(seq.error, TinyLoopError) else EngineError(str(seq.error))
                    self.retire(seq, ticket, RequestState.ERROR, err)
                else:
                    self.retire(seq, ticket, RequestState.DONE)

    def _finish_prefix(self, entry: _Entry) -> None:
        seq, msg = entry.seq, entry.prefix
        assert msg is not None
        self.active.pop(id(seq), None)
        if seq.error is not None:
            self.engine.free(seq)
            _reply(msg, seq.error if isinstance(seq.error, TinyLoopError) else EngineError(str(seq.error)))
            return
        for old in self.pool.add(msg.tokens, seq.loops, seq.window, seq):
            self.engine.free(old)
        _reply(msg, None)

    def _retire_entry(self, entry: _Entry, state: RequestState, error: BaseException | None = None) -> None:
        if entry.prefix is not None:
            if entry.seq is not None:
                self.active.pop(id(entry.seq), None)
                self.engine.free(entry.seq)
            _reply(entry.prefix, error or SchedulerShutdown("the runtime stopped"))
            return
        assert entry.ticket is not None
        self.retire(entry.seq, entry.ticket, state, error)

    def retire(self, seq: Any, ticket: Ticket, state: RequestState,
               error: BaseException | None = None) -> None:
        result: GenerationResult | None = None
        if seq is not None:
            self.active.pop(id(seq), None)
            if state is RequestState.DONE:
                result = seq.result()
            self.engine.free(seq)
        dispatch_ms = ticket.ms_since(ticket.dispatched_at)
        if result is not None:
            ticket.terminate(state, Final(result))
            self.outgoing.append(Observe(dispatch_ms or 0.0, result.loops_used or 1,
                                         max(result.completion_tokens, 1)))
        else:
            ticket.terminate(state, Failure(error) if error is not None else None)
        self.events.send_nowait(Finished(state, ticket.ms_since(ticket.submitted_at) or 0.0,
                                         dispatch_ms, result))
        self.outgoing.append(SlotFreed(ticket))

    async def close(self) -> None:
        for entry in list(self.waiting) + list(self.active.values()):
            ticket = entry.ticket
            if ticket is None:
                continue
            ticket.cancelled = True
            if ticket.cancel_error is None:  # the runtime stopped under a caller still reading
                ticket.cancel_error = SchedulerShutdown("the runtime stopped while this request ran")
        self.reap()
        for entry in list(self.waiting) + list(self.active.values()):  # prefix registrations
            self._retire_entry(entry, RequestState.CANCELLED)
        self.waiting.clear()
        try:
            await self.flush()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the dispatcher or admission stopped first: nobody counts slots any more


def _reply(msg: RegisterPrefix, error: BaseException | None) -> None:
    try:
        msg.reply.send_nowait(error)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass  # the caller went away: the prefix stays registered (or the error is dropped)


async def run(*, inbox: trio.MemoryReceiveChannel[Dispatch | RegisterPrefix],
              freed: trio.MemorySendChannel[SlotFreed], observe: trio.MemorySendChannel[Observe],
              events: trio.MemorySendChannel[Event], engine: EnginePort, pool: PrefixPool[Any],
              health: Health, kv_aging_ms: float = 2000.0,
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    loop = _Loop(engine, pool, health, freed, observe, events, KVPlanner(kv_aging_ms / 1000))
    async with inbox, freed, observe, events:
        task_status.started()
        try:
            closed = False
            while not (closed and not loop.active and not loop.waiting):
                if not loop.active and not loop.waiting and not closed:
                    try:
                        loop.handle(await inbox.receive())
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
                    loop.handle(msg)
                await loop.step()
                await trio.lowlevel.checkpoint()
        finally:
            with trio.CancelScope(shield=True):
                await loop.close()
            for handle in pool.clear():
                engine.free(handle)
