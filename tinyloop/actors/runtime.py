"""The runtime: the actors wired in one nursery, and the API callers use.

::

    async with tinyloop.open_runtime(engine, settings) as rt:
        result = await rt.submit(req, priority=5, slo_ms=200)
        async with rt.submit_stream(req) as stream:
            async for chunk in stream:
                ...

Ownership. Each piece of state has one owner: admission (``Admitter``, run in callers' tasks)
its policy and the count of tickets it sent on; the queue its heap; the dispatcher its slots;
the engine actor its entries, the prefix pool and ``Health``; the metrics actor the counters and
histograms; the runtime (this module, running in callers' tasks) the lifecycle flag and the
registry of tickets for ``request_state``. Each actor publishes a frozen ``...Statistics``
snapshot that the runtime and admission read; nothing else of theirs is read or written from
outside. A ticket's fields are
written by whoever holds it (``ticket.py`` has the table). In flight is one count: the
dispatcher's ``dispatched`` minus the engines' ``retired``.

Several engines (``open_runtime([e0, e1, ...])``): one engine actor each, with its own inbox,
worker thread, KV pool and prefix cache; the one dispatcher places every request
(``dispatcher.py``), admission and the statistics sum over the engines, and the runtime is
healthy while one engine works.

Shutdown cascades by closing channels (each actor ends when its pipeline inbox ends and it holds
nothing, then closes its outbox): ``refuse_new_requests`` closes admission's pipe to the queue
(and the prefix channel to the engine); the queue, once empty, closes the dispatcher's; the
dispatcher, once nothing waits for a slot, closes the engine's; the engine,
once what it holds has finished, closes the metrics actor's. ``shutdown`` waits for the last
actor to return; without ``drain`` it first cancels every request, so each actor's hold empties
at once. When the runtime is left by an exception or cancellation the actors are cancelled
instead; once they have all stopped the runtime retires what they left (``_orphans``).

Hops. A request costs its caller one wake-up (its result); admission runs in the caller's task,
and the actors pass tickets on in batches (one Ready, one Dispatch, one SlotFreed per wake-up),
so each actor wakes once per batch of requests, not once per request.

Channel buffers: the dispatch channel holds ``max_batch_size + 1`` messages (each Dispatch
carries at least one ticket for a free slot; register_prefix callers wait there beside them);
the enqueue channel is unbounded but admission's queue cap bounds it; the ready, feedback and
event channels are unbounded but carry at most a few messages per live request; nobody blocks
on a feedback channel.
"""

from __future__ import annotations

import inspect
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

import trio

from tinyloop.actors import admission, dispatcher, queue
from tinyloop.actors import engine as engine_actor
from tinyloop.actors import metrics as metrics_actor
from tinyloop.actors.chute import Chute
from tinyloop.actors.dispatcher import DispatcherState
from tinyloop.actors.engine import EngineState, EngineStatistics
from tinyloop.actors.mailbox import Pipe, UpstreamClosed, open_mailbox
from tinyloop.actors.port import EnginePort, ThreadedEngine
from tinyloop.actors.queue import QueueState
from tinyloop.actors.stream import RequestStream
from tinyloop.actors.ticket import Failure, Ticket
from tinyloop.errors import SchedulerError, SchedulerShutdown
from tinyloop.limits import Resolved
from tinyloop.messages import (
    Cancel,
    EngineInbox,
    Enqueue,
    Event,
    EventBatch,
    Finished,
    QueueFeedback,
    Ready,
    RegisterPrefix,
    SlotFreed,
)
from tinyloop.metrics import Metrics
from tinyloop.requests import GenerationRequest, GenerationResult, RequestState
from tinyloop.settings import Settings

if TYPE_CHECKING:
    from tinyloop.engine.engine import Engine

__all__ = ["Runtime", "RuntimeStatistics", "open_runtime"]

_KEEP_STATES = 4096  # terminal request states remembered for request_state()
_SWEEP_SLACK = 64  # ended tickets held, at most, beyond twice the live ones before a sweep


@dataclass(frozen=True, slots=True)
class RuntimeStatistics:
    """A snapshot of the whole runtime."""

    queue_depth: int
    in_flight: int  # dispatched or decoding
    waiting_for_kv: int  # dispatched, not started yet: the engine waits for their KV to fit
    slots: int
    dispatched: int
    prefix_pool_size: int
    kv_blocks_used: int | None
    kv_blocks_total: int | None
    healthy: bool
    broken: str | None  # every engine is broken (None while one works)
    shutting_down: bool
    engines: tuple[EngineStatistics, ...] = ()  # each engine's own snapshot


class Runtime:
    """The actors around one engine or several; build it with ``open_runtime``."""

    _queue: QueueState  # the actors' published state, set once they have started
    _dispatcher: DispatcherState
    _engines: list[EngineState]
    _admission: admission.Admitter

    def __init__(self, engines: Sequence[EnginePort], settings: Settings) -> None:
        if not engines:
            raise ValueError("a runtime needs at least one engine")
        self.engines = list(engines)
        self.engine = self.engines[0]  # they all serve one model: its limits, its info
        self.settings = settings
        self.metrics = Metrics()
        self._shutting_down = False
        self._stopped = trio.Event()  # every actor has returned
        self._actors = trio.CancelScope()
        # request_state()'s registry: the tickets admitted, and once they have ended only their
        # state (a ticket and what it holds are garbage as soon as its caller is done, instead of
        # living on, for the collector to walk, through the next thousands of requests)
        self._live: dict[str, Ticket] = {}
        self._ended: OrderedDict[str, RequestState] = OrderedDict()  # oldest first
        self._sweep_at = _SWEEP_SLACK
        self.started_at = time.time()
        # each engine's inbox: the dispatcher's Dispatch and the runtime's RegisterPrefix
        inboxes = [trio.open_memory_channel[EngineInbox](settings.max_batch_size + 1) for _ in self.engines]
        self._prefix_sends = [send for send, _ in inboxes]
        self._engine_recvs = [recv for _, recv in inboxes]
        # the queue's mailbox: admission's pipe in, the runtime's Cancel and the dispatcher's Pull back
        self._enqueue_pipe: Pipe[Enqueue]
        self._cancel_send: trio.MemorySendChannel[QueueFeedback]
        self._queue_inbox: trio.MemoryReceiveChannel[Enqueue | QueueFeedback | UpstreamClosed]
        self._enqueue_pipe, self._cancel_send, self._queue_inbox = open_mailbox()

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Runtime queued={s.queue_depth} in_flight={s.in_flight}/{s.slots} "
                f"{'healthy' if s.healthy else 'broken'}{' shutting-down' if s.shutting_down else ''}>")

    async def _supervise(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the actors until the last one returns (or they are cancelled), then retire what
        they left."""
        try:
            with self._actors:
                async with trio.open_nursery() as nursery:
                    await self._start(nursery)
                    task_status.started()
        finally:
            self._orphans()
            self._stopped.set()

    async def _start(self, n: trio.Nursery) -> None:
        settings = self.settings
        events_send, events_recv = trio.open_memory_channel[Event | EventBatch](math.inf)
        # completed requests, for admission's predictor: one chute per engine (each closes its own)
        observations: list[Chute[list[Finished]]] = [Chute() for _ in self.engines]
        # the dispatcher's mailbox: the queue's pipe in, the engines' SlotFreed back
        ready_pipe: Pipe[Ready]
        freed_send: trio.MemorySendChannel[SlotFreed]
        dispatcher_inbox: trio.MemoryReceiveChannel[Ready | SlotFreed | UpstreamClosed]
        ready_pipe, freed_send, dispatcher_inbox = open_mailbox()
        await n.start(partial(metrics_actor.run, inbox=events_recv, metrics=self.metrics))
        several = len(self.engines) > 1
        self._engines = []
        with freed_send:
            for i, engine in enumerate(self.engines):
                self._engines.append(await n.start(partial(
                    engine_actor.run, inbox=self._engine_recvs[i], outbox=events_send.clone(), settings=settings,
                    engine=engine, freed=freed_send.clone(), observe=observations[i], index=i,
                    label=i if several else None)))
        self._dispatcher = await n.start(partial(
            dispatcher.run, inbox=dispatcher_inbox, outboxes=[send.clone() for send in self._prefix_sends],
            settings=settings, pulls=self._cancel_send.clone(), events=events_send.clone(),
            engines=self._engines))
        self._queue = await n.start(partial(
            queue.run, inbox=self._queue_inbox, outbox=ready_pipe, settings=settings,
            events=events_send.clone()))
        sources = admission.Sources(self._queue.statistics, self._dispatcher.statistics,
                                    lambda: sum(e.slots_freed for e in self._engines), self._broken)
        self._admission = admission.Admitter(
            outbox=self._enqueue_pipe, settings=settings, observations=observations, events=events_send,
            sources=sources, check=self.engine.check)
        kv_bytes = self.engine.kv_bytes_per_token()
        self.metrics.set_engine_info(max_seq_len=self.engine.max_seq_len,
                                     default_loops=self.engine.default_loops,
                                     up_timestamp_s=self.started_at, kv_bytes_per_token=kv_bytes)

    def check(self, request: GenerationRequest) -> Resolved:
        """The request checked against the model once (``RequestError`` naming the field), its
        defaults resolved: what admission and the engine actor then go by."""
        return self.engine.check(request)

    # -- submitting ----------------------------------------------------------------------------
    def submit_stream(self, request: GenerationRequest, *, priority: int = 0,
                      slo_ms: float | None = None, stream: bool = True) -> RequestStream:
        """A stream of the request's chunks: ``async with rt.submit_stream(req) as s: async for
        chunk in s``. Admission happens on ``await s.start()`` or the first iteration and raises
        ``QueueFullError``, ``AdmissionRejected`` or ``SchedulerShutdown``; ``s.result`` holds
        the GenerationResult once the stream ends. ``stream=False`` says the caller only wants
        the result (as ``submit``): the request then does not count in ``first_token_ms``."""
        return RequestStream(self, request, priority, slo_ms, stream=stream)

    async def submit(self, request: GenerationRequest, *, priority: int = 0,
                     slo_ms: float | None = None) -> GenerationResult:
        """Run a request to completion and return its result (cancel the caller to cancel it)."""
        async with RequestStream(self, request, priority, slo_ms, stream=False) as stream:
            while await stream.next_burst():  # what piled up in one go: one wake-up, no more
                pass
        assert stream.result is not None
        return stream.result

    def _admit(self, ticket: Ticket) -> None:
        """Admit the ticket into the queue, in the caller's task, or end it and raise the
        refusal: QueueFullError, AdmissionRejected, SchedulerShutdown (also once the runtime
        refuses new requests)."""
        if self._shutting_down:
            self._refused(ticket)
            raise SchedulerShutdown("the runtime has stopped" if self._stopped.is_set()
                                    else "the runtime is shutting down")
        try:
            self._admission.admit(ticket)
        except SchedulerError:
            self._refused(ticket)
            raise
        self._remember(ticket)

    def _refused(self, ticket: Ticket) -> None:
        """Admission never took the ticket on: the runtime, still its holder, ends it."""
        ticket.state = RequestState.CANCELLED
        ticket.items.close()

    def _cancel(self, ticket: Ticket, error: BaseException | None = None) -> None:
        """The caller left (or the runtime is closing): mark the ticket cancelled; its holder
        retires it at its next step, and a queued one leaves the queue now. Synchronous."""
        if not ticket.cancel(error) or ticket.state is not RequestState.QUEUED:
            return
        try:
            self._cancel_send.send_nowait(Cancel(ticket))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the queue has stopped: whoever holds the ticket reads the flag

    def _remember(self, ticket: Ticket) -> None:
        self._live[ticket.request_id] = ticket
        if len(self._live) >= self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Keep only the state of the tickets that have ended (the last ``_KEEP_STATES`` of
        them). Amortised: the next sweep waits for as many admissions as tickets are left live."""
        live, ended = self._live, self._ended
        for request_id, ticket in [(i, t) for i, t in live.items() if t.state.terminal]:
            del live[request_id]
            ended[request_id] = ticket.state
        while len(ended) > _KEEP_STATES:
            ended.popitem(last=False)
        self._sweep_at = 2 * len(live) + _SWEEP_SLACK

    def request_state(self, request_id: str) -> RequestState | None:
        """Where a request is in QUEUED -> DISPATCHED -> DECODING -> DONE | ERROR | CANCELLED."""
        ticket = self._live.get(request_id)
        return self._ended.get(request_id) if ticket is None else ticket.state

    # -- prefix pool ---------------------------------------------------------------------------
    async def register_prefix(self, tokens: Sequence[int], loops: int | None = None,
                              cache_window: int | None = None, *, everywhere: bool = False) -> None:
        """Prefill ``tokens`` once and keep the KV; later ``generate`` requests whose prompt starts
        with them (at the same loops and window) reuse it. With several engines the prefix goes
        to one of them (the working one with the fewest entries), and the dispatcher sends the
        requests it serves there; ``everywhere`` registers it on every working engine."""
        if self._shutting_down:
            raise SchedulerShutdown("the runtime is shutting down")
        working = [i for i, e in enumerate(self._engines) if e.broken() is None] or [0]
        targets = working if everywhere else [min(working, key=lambda i: self._engines[i].pool_size())]
        replies = []
        for i in targets:
            reply_send, reply_recv = trio.open_memory_channel[BaseException | None](1)
            try:
                await self._prefix_sends[i].send(RegisterPrefix(tuple(tokens), loops, cache_window, reply_send))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                raise SchedulerShutdown("the runtime is shutting down") from None
            replies.append(reply_recv)
        errors = [await reply.receive() for reply in replies]
        if (error := next((e for e in errors if e is not None), None)) is not None:
            raise error

    # -- observing -----------------------------------------------------------------------------
    def statistics(self) -> RuntimeStatistics:
        """Read from the snapshots the actors publish (the engines' summed up)."""
        q, d = self._queue.statistics(), self._dispatcher.statistics()
        engines = tuple(e.statistics() for e in self._engines)
        retired = sum(e.retired for e in engines)
        in_flight = d.dispatched - retired
        kvs = [e.kv for e in engines if e.kv is not None]
        broken = self._broken()
        return RuntimeStatistics(
            queue_depth=q.queued, in_flight=in_flight, waiting_for_kv=in_flight - sum(e.decoding for e in engines),
            slots=d.slots, dispatched=d.dispatched, prefix_pool_size=sum(e.prefix_pool_size for e in engines),
            kv_blocks_used=sum(kv.blocks_used for kv in kvs) if kvs else None,
            kv_blocks_total=sum(kv.blocks_total for kv in kvs) if kvs else None,
            healthy=broken is None, broken=broken, shutting_down=self._shutting_down, engines=engines)

    def _broken(self) -> str | None:
        """None while an engine works; once every one is broken, why (each engine's reason)."""
        reasons = [e.health.broken for e in self._engines]
        if any(r is None for r in reasons):
            return None
        if len(reasons) == 1:
            return reasons[0]
        return "; ".join(f"engine {i}: {r}" for i, r in enumerate(reasons))

    @property
    def healthy(self) -> bool:
        """Some engine works (with several, a broken one has left the pool and the rest serve)."""
        return self._broken() is None

    def metrics_text(self) -> str:
        """The Prometheus exposition of this runtime's registry."""
        s = self.statistics()
        self.metrics.set_gauges(queue_depth=s.queue_depth, in_flight=s.in_flight,
                                waiting_for_kv=s.waiting_for_kv, kv_used=s.kv_blocks_used,
                                kv_total=s.kv_blocks_total)
        if len(s.engines) > 1:
            self.metrics.set_engine_gauges(s.engines, self._dispatcher.statistics().engine_slots_used)
        return self.metrics.render().decode()

    # -- shutdown ------------------------------------------------------------------------------
    def refuse_new_requests(self) -> None:
        """Start shutting down: from now on ``submit`` and ``register_prefix`` raise
        SchedulerShutdown. Closing admission's pipe to the queue starts the cascade (module
        docstring)."""
        self._shutting_down = True
        self._admission.close()
        for send in self._prefix_sends:
            send.close()

    async def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; with ``drain`` let queued and in-flight ones finish, else fail
        the queued ones with SchedulerShutdown and cancel those in flight. Returns once every
        actor has stopped."""
        self.refuse_new_requests()
        if not drain:
            for ticket in list(self._live.values()):
                self._cancel(ticket, SchedulerShutdown("the runtime shut down before this request ran"))
        await self._stopped.wait()

    def _close(self) -> None:
        """Last resort on exit: stop the actors now (they retire what they hold on the way out)."""
        self.refuse_new_requests()
        self._actors.cancel()

    def _orphans(self) -> None:
        """Every actor has stopped, so the runtime holds every ticket again: none may leave its
        caller waiting (a cancelled runtime leaves tickets in channels and in the queue)."""
        for ticket in self._live.values():
            if not ticket.state.terminal:
                ticket.terminate(RequestState.CANCELLED,
                                 Failure(ticket.cancel_error or SchedulerShutdown("the runtime closed")))


@asynccontextmanager
async def open_runtime(engine: Engine | EnginePort | Sequence[Engine | EnginePort],
                       settings: Settings | None = None) -> AsyncIterator[Runtime]:
    """Start the runtime's actors around ``engine``; on exit, drain and stop them.

    ``engine`` is a loaded ``Engine`` (its model work then runs in a worker thread) or anything
    implementing ``EnginePort``, such as ``tinyloop.testing.FakeEngine``; or a list of them, all
    serving one model (``Engine.replica``, or one per GPU), which the one scheduler drives side by
    side, each with its own engine actor.
    """
    engines = list(engine) if isinstance(engine, Sequence) else [engine]
    rt = Runtime([_port(e) for e in engines], settings or Settings())
    async with trio.open_nursery() as nursery:
        # The actors run in a task of their own (``_supervise``): the caller's body is not under
        # their cancel scope, so stopping them never cuts the body short.
        await nursery.start(rt._supervise)
        try:
            yield rt
            await rt.shutdown(drain=True)
        finally:
            rt._close()


def _port(engine: Engine | EnginePort) -> EnginePort:
    """A blocking engine (``Engine``: ``step`` is a plain method) runs in a worker thread."""
    if inspect.iscoroutinefunction(engine.step):
        return cast(EnginePort, engine)
    return ThreadedEngine(cast("Engine", engine))
