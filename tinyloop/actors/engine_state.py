"""The engine actor's state (``engine.py`` runs it): the requests and prefix registrations it
holds, from their dispatch (waiting for KV) through their start and steps to their retirement.

Planning the KV, preempting, starting, stepping and retiring are described in ``engine.py``'s
docstring; what the state publishes and sends is in ``engine_reports.py``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from tinyloop.actors.engine_reports import EngineStatistics, Health, Reports
from tinyloop.actors.port import EnginePort, engine_errors
from tinyloop.actors.ticket import Failure, Ticket
from tinyloop.errors import EngineBroken, EngineError, SchedulerShutdown, TinyLoopError
from tinyloop.messages import Dispatch, Finished, FirstToken, Preempted, RegisterPrefix, Started, StepDone
from tinyloop.policy.kvplan import KVPlanner, Running, Waiting
from tinyloop.policy.prefix_pool import PrefixPool
from tinyloop.requests import GenerationResult, RequestState

__all__ = ["EngineState"]


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
    dispatched_at: float | None = None  # when the engine started it (trio time)
    first_token_at: float | None = None


@dataclass(eq=False)
class EngineState:
    """The actor's state: waiting and active entries, and what it reports (``Reports``)."""

    engine: EnginePort
    pool: PrefixPool[Any]
    health: Health
    reports: Reports
    planner: KVPlanner
    active: dict[int, _Entry] = field(default_factory=dict)  # id(seq) -> entry
    waiting: deque[_Entry] = field(default_factory=deque)  # dispatched, not running
    counter: itertools.count[int] = field(default_factory=itertools.count)
    retired: int = 0
    slots_freed: int = 0  # as ``retired``, in slots: published at once, the SlotFreed message lags
    decoding: int = 0  # requests whose sequence exists (running or preempted): counted as they start and retire

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(self.retired, self.slots_freed, self.decoding, self.pool.size(),
                                self.engine.kv_statistics(), self.health.broken)

    def pool_size(self) -> int:
        """``statistics().prefix_pool_size`` without the rest of the snapshot (the dispatcher
        reads it for every dispatch)."""
        return self.pool.size()

    def prefix_covers(self, prompt: Sequence[int], loops: int, window: int) -> int:
        """Prompt tokens the longest prefix-pool entry covers (the dispatcher's placement reads it)."""
        return self.pool.peek(prompt, loops, window)

    def free_blocks(self) -> int | None:
        return self.engine.kv_available()

    def broken(self) -> str | None:
        return self.health.broken

    def __repr__(self) -> str:
        return f"<EngineActor active={len(self.active)} waiting={len(self.waiting)} retired={self.retired}>"


    # -- messages ------------------------------------------------------------------------------
    def handle(self, msg: Dispatch | RegisterPrefix) -> None:
        match msg:
            case Dispatch(tickets=tickets, via_pool=via_pool):
                now = trio.current_time()
                self.waiting.extend(_Entry(ticket, via_pool, order=next(self.counter), since=now)
                                    for ticket in tickets)
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
            return self.engine.kv_start_blocks(entry.ticket.request, entry.ticket.resolved) or 0
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

    def plan(self) -> bool:
        """Preempt what the next step cannot hold, then start what fits (module docstring);
        True when something started."""
        available = self.engine.kv_available()
        if available is None or self.health.broken is not None:
            started = bool(self.waiting)
            for entry in list(self.waiting):
                self._start(entry)
            self.waiting.clear()
            return started
        while (victim := self.planner.preempt(self._running(), available)) is not None:
            self._preempt(self.active.pop(victim))
            available = self.engine.kv_available() or 0
        if not self.waiting:
            return False
        now = trio.current_time()
        candidates = [Waiting(i, self._start_blocks(e), e.since) for i, e in enumerate(self.waiting)]
        chosen = set(self.planner.admit(candidates, self._running(), available, now))
        if chosen:
            entries = list(self.waiting)
            self.waiting = deque(e for i, e in enumerate(entries) if i not in chosen)
            for i in sorted(chosen):
                self._start(entries[i])
        return bool(chosen)

    def _preempt(self, entry: _Entry) -> None:
        self.engine.preempt(entry.seq)
        self.reports.pending.append(Preempted())
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
            if ticket.gone or self.health.broken is not None:
                self.active[id(entry.seq)] = entry  # reap() retires it
                return
            self.engine.resume(entry.seq)
            self.active[id(entry.seq)] = entry
            return
        if ticket.gone:
            self.retire(None, ticket, RequestState.CANCELLED)
            return
        if self.health.broken is not None:
            self.retire(None, ticket, RequestState.ERROR,
                        EngineBroken(f"the engine is broken: {self.health.broken}"))
            return
        now = trio.current_time()
        entry.dispatched_at = now
        req = ticket.request
        queue_ms, prompt = (now - ticket.submitted_at) * 1000, len(req.prompt_tokens)
        try:
            resolved = ticket.resolved or self.engine.check(req)  # (set at admission)
            prefix = None
            if entry.via_pool:
                found = self.pool.find(req.prompt_tokens, resolved.loops, resolved.window)
                prefix = None if found is None else found[1]
            with engine_errors():
                seq = self.engine.start(req, prefix, resolved)
        except TinyLoopError as exc:
            self.reports.pending.append(Started(queue_ms, prompt))
            self.retire(None, ticket, RequestState.ERROR, exc, entry)
            return
        self.reports.pending.append(Started(queue_ms, prompt, seq.cached_tokens))
        ticket.state = RequestState.DECODING
        entry.seq = seq
        self.decoding += 1
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
    async def step(self) -> bool:
        """One iteration; True when it ran the engine (which awaited: the others ran)."""
        try:
            return await self._step()
        finally:
            self.report()

    def report(self) -> None:
        """Send what was gathered since the last report (``Reports.send``)."""
        self.reports.send(idle=not (self.active or self.waiting))

    async def _step(self) -> bool:
        self.reap()
        if self.plan():
            self.reap()  # prefixes that needed no prefill, entries started cancelled
        if not self.active:
            return False
        seqs = [e.seq for e in self.active.values()]
        self.report()  # what happened before the model work is not held up by it
        try:
            with engine_errors():  # a foreign exception fails this step's requests, not the runtime
                events = await self.engine.step(seqs)
        except TinyLoopError as exc:
            if isinstance(exc, EngineBroken):
                self.health.broken = str(exc)
            for entry in list(self.active.values()):
                self._retire_entry(entry, RequestState.ERROR, exc)
            return True
        self.reports.steps.append(StepDone(len(seqs), len(events)))
        now = trio.current_time()
        for ev in events:
            entry = self.active[id(ev.sequence)]
            ticket = entry.ticket
            assert ticket is not None
            if entry.first_token_at is None:
                entry.first_token_at = now
                if ticket.stream:
                    self.reports.pending.append(FirstToken((now - ticket.submitted_at) * 1000))
            ticket.deliver(ev.chunk())
        self.reap()
        return True

    def reap(self) -> None:
        """Retire finished sequences and those whose caller left (waiting or running)."""
        if self.waiting:
            for entry in [e for e in self.waiting if e.ticket is not None and e.ticket.gone]:
                self.waiting.remove(entry)
                self._retire_entry(entry, RequestState.CANCELLED)
        for entry in list(self.active.values()):
            seq, ticket = entry.seq, entry.ticket
            if ticket is None:
                if seq.finished or not seq.prefilling:
                    self._finish_prefix(entry)
            elif ticket.gone:
                self.retire(seq, ticket, RequestState.CANCELLED, None, entry)
            elif seq.finished:
                if seq.error is not None:
                    err = seq.error if isinstance(seq.error, TinyLoopError) else EngineError(str(seq.error))
                    self.retire(seq, ticket, RequestState.ERROR, err, entry)
                else:
                    self.retire(seq, ticket, RequestState.DONE, None, entry)

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
        self.retire(entry.seq, entry.ticket, state, error, entry)

    def retire(self, seq: Any, ticket: Ticket, state: RequestState,
               error: BaseException | None = None, entry: _Entry | None = None) -> None:
        now = trio.current_time()
        wall_ms = (now - ticket.submitted_at) * 1000
        result: GenerationResult | None = None
        if seq is not None:
            self.active.pop(id(seq), None)
            self.decoding -= 1
            if state is RequestState.DONE:
                assert entry is not None
                first = entry.first_token_at
                result = self.engine.result(seq, wall_ms, None if first is None else
                                            (first - ticket.submitted_at) * 1000)
            self.engine.free(seq)
        self.retired += 1
        dispatched_at = None if entry is None else entry.dispatched_at
        dispatch_ms = None if dispatched_at is None else (now - dispatched_at) * 1000
        finished = Finished(state, wall_ms, dispatch_ms, result)
        if result is not None:
            ticket.terminate(state, result)
            self.reports.observed.append(finished)
        else:
            if error is None and state is RequestState.CANCELLED and not ticket.cancelled:
                error = SchedulerShutdown("the runtime stopped while this request ran")  # close()
            ticket.terminate(state, Failure(error) if error is not None else None)
        self.reports.pending.append(finished)
        self.reports.freed_pending.append(ticket)
        self.slots_freed += ticket.slots

    def close(self) -> None:
        """Retire everything still held (the actor is stopping): sequences are freed."""
        for entry in list(self.waiting) + list(self.active.values()):
            self._retire_entry(entry, RequestState.CANCELLED)
        self.waiting.clear()
        self.report()


def _reply(msg: RegisterPrefix, error: BaseException | None) -> None:
    try:
        msg.reply.send_nowait(error)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass  # the caller went away: the prefix stays registered (or the error is dropped)
