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
``EngineError`` fails the requests of that step; ``EngineBroken`` also marks this engine
broken (``Health``), and every later dispatch to it fails at once. With several engines the
dispatcher then takes it out of the pool; with one, the runtime is unhealthy.

State. The actor owns its waiting and running entries, the prefix pool and ``Health``, and
publishes ``EngineStatistics``: ``retired`` (requests it retired, ever: with the dispatcher's
``dispatched`` it gives the runtime's one in-flight count), ``decoding`` (requests whose sequence
exists, running or preempted), the pool's size, the KV pool and ``broken``. A request's
``dispatched_at`` and ``first_token_at`` live in its entry here; the ``GenerationResult`` it
delivers is stamped with the runtime's clock (trio's): ``wall_ms`` from submission to the end,
``time_to_first_token_ms`` from submission to the first token, the same figures the metrics
observe. It reads a ticket's caller-side ``cancelled`` flag and writes only what the ticket
module gives the holder (``state`` DECODING and terminal, the chunks).

Shutdown: when its inbox ends (the dispatcher and the runtime closed their ends) the actor runs
what it holds to the end, then returns, closing its event and feedback channels (which ends the
metrics actor). Cancellation: cancelled with its nursery; a step already running in the worker
thread finishes first (threads are not interruptible). Whatever it still holds is retired (its
caller told ``SchedulerShutdown`` unless it gave a reason) and freed on the way out.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from tinyloop.actors.chute import Chute
from tinyloop.actors.port import EnginePort, engine_errors
from tinyloop.actors.ticket import Failure, Ticket
from tinyloop.errors import EngineBroken, EngineError, SchedulerShutdown, TinyLoopError
from tinyloop.messages import (
    Dispatch,
    EngineInbox,
    Event,
    EventBatch,
    Finished,
    FirstToken,
    Preempted,
    RegisterPrefix,
    SlotFreed,
    Started,
    StepDone,
)
from tinyloop.policy.kvplan import KVPlanner, Running, Waiting
from tinyloop.policy.prefix_pool import PrefixPool
from tinyloop.requests import GenerationResult, RequestState
from tinyloop.settings import Settings

if TYPE_CHECKING:
    from tinyloop.model.kvcache import KVPoolStats

__all__ = ["run", "Health", "EngineState", "EngineStatistics"]

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
    """The actor's state: waiting and active entries, and the channels it reports on."""

    engine: EnginePort
    pool: PrefixPool[Any]
    health: Health
    freed: trio.MemorySendChannel[SlotFreed]
    observe: Chute[list[Finished]]
    events: trio.MemorySendChannel[Event | EventBatch]
    planner: KVPlanner
    active: dict[int, _Entry] = field(default_factory=dict)  # id(seq) -> entry
    waiting: deque[_Entry] = field(default_factory=deque)  # dispatched, not running
    counter: itertools.count[int] = field(default_factory=itertools.count)
    retired: int = 0
    slots_freed: int = 0  # as ``retired``, in slots: published at once, the SlotFreed message lags
    pending: list[Event] = field(default_factory=list)  # events for the metrics actor, sent once per step
    steps: list[StepDone] = field(default_factory=list)  # steps not reported yet (report())
    freed_pending: list[Ticket] = field(default_factory=list)  # retired: their slots, for the dispatcher
    observed: list[Finished] = field(default_factory=list)  # completed requests, for admission's predictor
    decoding: int = 0  # requests whose sequence exists (running or preempted): counted as they start and retire
    index: int = 0  # which of the runtime's engines (in its SlotFreed)
    label: int | None = None  # the same, on its events, when the runtime drives several

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
        self.pending.append(Preempted())
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
            self.pending.append(Started(queue_ms, prompt))
            self.retire(None, ticket, RequestState.ERROR, exc, entry)
            return
        self.pending.append(Started(queue_ms, prompt, seq.cached_tokens))
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
        """Send what was gathered since the last report: the slots freed, the observations
        and the events for the metrics actor, one message each."""
        self.feed_back()
        if self.steps and (self.pending or len(self.steps) >= _STEPS_PER_REPORT
                           or not (self.active or self.waiting)):
            self.pending.extend(self.steps)
            self.steps = []
        if self.pending:
            self.events.send_nowait(EventBatch(self.pending, self.label))
            self.pending = []

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
        self.steps.append(StepDone(len(seqs), len(events)))
        now = trio.current_time()
        for ev in events:
            entry = self.active[id(ev.sequence)]
            ticket = entry.ticket
            assert ticket is not None
            if entry.first_token_at is None:
                entry.first_token_at = now
                if ticket.stream:
                    self.pending.append(FirstToken((now - ticket.submitted_at) * 1000))
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
            self.observed.append(finished)
        else:
            if error is None and state is RequestState.CANCELLED and not ticket.cancelled:
                error = SchedulerShutdown("the runtime stopped while this request ran")  # close()
            ticket.terminate(state, Failure(error) if error is not None else None)
        self.pending.append(finished)
        self.freed_pending.append(ticket)
        self.slots_freed += ticket.slots

    def close(self) -> None:
        """Retire everything still held (the actor is stopping): sequences are freed."""
        for entry in list(self.waiting) + list(self.active.values()):
            self._retire_entry(entry, RequestState.CANCELLED)
        self.waiting.clear()
        self.report()


def _send_feedback(channel: trio.MemorySendChannel[T] | Chute[T], msg: T) -> None:
    try:
        channel.send_nowait(msg)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the reader has stopped: nobody needs to know


def _reply(msg: RegisterPrefix, error: BaseException | None) -> None:
    try:
        msg.reply.send_nowait(error)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
        pass  # the caller went away: the prefix stays registered (or the error is dropped)


def drain(inbox: trio.MemoryReceiveChannel[EngineInbox], loop: EngineState) -> bool:
    """Handle every message already in the inbox; True once it has ended."""
    while True:
        try:
            msg = inbox.receive_nowait()
        except trio.WouldBlock:
            return False
        except trio.EndOfChannel:
            return True
        loop.handle(msg)


async def run(*, inbox: trio.MemoryReceiveChannel[EngineInbox], outbox: trio.MemorySendChannel[Event | EventBatch],
              settings: Settings, engine: EnginePort, freed: trio.MemorySendChannel[SlotFreed],
              observe: Chute[list[Finished]], index: int = 0, label: int | None = None,
              task_status: trio.TaskStatus[EngineState] = trio.TASK_STATUS_IGNORED) -> None:
    """Started with ``nursery.start``, which returns the actor's state: read it through its
    ``statistics()`` (and ``health``), never write it. ``index``: which of the runtime's engines
    this is; ``label``: the same, when its events are to be told apart from other engines'."""
    pool: PrefixPool[Any] = PrefixPool(settings.prefix_pool_capacity)
    loop = EngineState(engine, pool, Health(), freed, observe, outbox, KVPlanner(settings.kv_aging_ms / 1000),
                       index=index, label=label)
    async with inbox, freed, outbox:
        task_status.started(loop)
        try:
            closed = False
            while not (closed and not loop.active and not loop.waiting):
                if not loop.active and not loop.waiting and not closed:
                    try:
                        loop.handle(await inbox.receive())
                    except trio.EndOfChannel:
                        closed = True
                closed = closed or drain(inbox, loop)
                retired = loop.retired
                if not await loop.step():
                    await trio.lowlevel.checkpoint()  # the step ran nothing: let the others run
                if loop.retired != retired:
                    # Freed slots are being refilled a few hops upstream: two scheduler passes
                    # let those requests join the next step instead of a step of their own.
                    await trio.lowlevel.checkpoint()
                    await trio.lowlevel.checkpoint()
        finally:
            loop.close()
            observe.close()
            for handle in pool.clear():
                engine.free(handle)
