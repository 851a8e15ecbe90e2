"""The runtime: the actors wired in one nursery, and the API callers use.

::

    async with tinyloop.open_runtime(engine, settings) as rt:
        result = await rt.submit(req, priority=5, slo_ms=200)
        async with rt.submit_stream(req) as stream:
            async for chunk in stream:
                ...

Channel buffers are sized so that no actor ever blocks on another inside the cycle
admission -> queue -> dispatcher -> engine -> (dispatcher, admission): the engine inbox and the
queue-to-dispatcher path carry at most ``max_batch_size`` messages (one per engine slot); the
queue inbox and the event stream are unbounded but carry at most a few messages per live request.
"""

from __future__ import annotations

import inspect
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import trio

from tinyloop.actors import admission, dispatcher, engine as engine_actor, metrics as metrics_actor, queue
from tinyloop.actors.dispatcher import DispatcherState
from tinyloop.actors.engine import Health
from tinyloop.actors.queue import Backlog
from tinyloop.actors.stream import RequestStream
from tinyloop.actors.ticket import Failure, Ticket
from tinyloop.actors.port import EnginePort, ThreadedEngine
from tinyloop.policy.prefix_pool import PrefixPool
from tinyloop.errors import SchedulerShutdown
from tinyloop.messages import Admit, Cancel, Event, Observe, RegisterPrefix
from tinyloop.metrics import Metrics
from tinyloop.policy.admission import Admission
from tinyloop.policy.queue import PriorityQueue
from tinyloop.requests import GenerationRequest, GenerationResult, RequestState
from tinyloop.settings import Settings

if TYPE_CHECKING:
    from tinyloop.engine.engine import Engine

__all__ = ["Runtime", "RuntimeStatistics", "open_runtime"]

_KEEP_STATES = 4096  # terminal request states remembered for request_state()


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
    broken: str | None
    shutting_down: bool


class Runtime:
    """The actors of one engine, started in ``nursery``; build it with ``open_runtime``."""

    def __init__(self, engine: EnginePort, settings: Settings, nursery: trio.Nursery) -> None:
        self.engine = engine
        self.settings = settings
        self._nursery = nursery
        self.metrics = Metrics()
        self.health = Health()
        self._queue: PriorityQueue[Ticket] = PriorityQueue(settings.priority_aging_ms)
        self._dispatch = DispatcherState(slots=settings.max_batch_size)
        self._backlog = Backlog()
        self._pool: PrefixPool[Any] = PrefixPool(settings.prefix_pool_capacity)
        self._admission = Admission.from_settings(settings)
        self._shutting_down = False
        self._stopped = False
        self._admitting = 0  # callers waiting for admission's answer
        self._tickets: OrderedDict[str, Ticket] = OrderedDict()
        self.started_at = time.time()

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<Runtime queued={s.queue_depth} in_flight={s.in_flight}/{s.slots} "
                f"{'healthy' if s.healthy else 'broken'}{' shutting-down' if s.shutting_down else ''}>")

    async def _start(self) -> None:
        slots = self.settings.max_batch_size
        events_send, events_recv = trio.open_memory_channel[Event](math.inf)
        adm_send, adm_recv = trio.open_memory_channel[Admit | Observe](slots)
        q_send, q_recv = trio.open_memory_channel[Any](math.inf)
        d_send, d_recv = trio.open_memory_channel[Any](2 * slots)
        e_send, e_recv = trio.open_memory_channel[Any](slots + 1)
        self._admit_send, self._queue_send, self._engine_send = adm_send, q_send.clone(), e_send.clone()
        n = self._nursery
        await n.start(lambda **kw: metrics_actor.run(inbox=events_recv, metrics=self.metrics, **kw))
        await n.start(lambda **kw: engine_actor.run(
            inbox=e_recv, freed=d_send.clone(), observe=adm_send.clone(), events=events_send.clone(),
            engine=self.engine, pool=self._pool, health=self.health,
            kv_aging_ms=self.settings.kv_aging_ms, **kw))
        await n.start(lambda **kw: dispatcher.run(
            inbox=d_recv, outbox=e_send, pulls=q_send.clone(), events=events_send.clone(),
            state=self._dispatch, pool_size=self._pool.size, **kw))
        await n.start(lambda **kw: queue.run(inbox=q_recv, outbox=d_send, events=events_send.clone(),
                                             queue=self._queue, backlog=self._backlog, **kw))
        await n.start(lambda **kw: admission.run(
            inbox=adm_recv, outbox=q_send, events=events_send, policy=self._admission,
            load=self._load, backlog=self._backlog, default_loops=self.engine.default_loops, **kw))
        kv_bytes = self.engine.kv_bytes_per_token()
        self.metrics.set_engine_info(max_seq_len=self.engine.max_seq_len,
                                     default_loops=self.engine.default_loops,
                                     up_timestamp_s=self.started_at, kv_bytes_per_token=kv_bytes)

    def _load(self) -> admission.Load:
        return admission.Load(len(self._queue) + self._backlog.in_transit, self._dispatch.in_flight, self._dispatch.slots,
                              self._shutting_down, self.health.broken)

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
            async for _ in stream:
                pass
        assert stream.result is not None
        return stream.result

    async def _admit(self, ticket: Ticket) -> None:
        if self._stopped:  # the admission actor is gone: nobody would answer
            ticket.state = RequestState.CANCELLED  # never queued: nothing to take out of the queue
            raise SchedulerShutdown("the runtime has stopped")
        reply_send, reply_recv = trio.open_memory_channel[Any](1)
        self._remember(ticket)
        self._admitting += 1
        try:
            await self._admit_send.send(Admit(ticket, reply_send))
            reply = await reply_recv.receive()
        except trio.BrokenResourceError:
            ticket.state = RequestState.CANCELLED
            self._tickets.pop(ticket.request_id, None)
            raise SchedulerShutdown("the runtime has stopped") from None
        finally:
            self._admitting -= 1
        if reply.error is not None:
            ticket.state = RequestState.CANCELLED
            self._tickets.pop(ticket.request_id, None)
            raise reply.error

    def _cancel(self, ticket: Ticket, error: BaseException | None = None) -> None:
        """The caller left (or the runtime is closing): retire the ticket at its holder's next step."""
        if ticket.state.terminal or ticket.cancelled:
            return
        ticket.cancelled = True
        ticket.cancel_error = error
        if ticket.state is RequestState.QUEUED:
            self._queue_send.send_nowait(Cancel(ticket, error))

    def _remember(self, ticket: Ticket) -> None:
        self._tickets[ticket.request_id] = ticket
        while len(self._tickets) > _KEEP_STATES:
            oldest = next(iter(self._tickets))
            if not self._tickets[oldest].state.terminal:
                break
            self._tickets.popitem(last=False)

    def request_state(self, request_id: str) -> RequestState | None:
        """Where a request is in QUEUED -> DISPATCHED -> DECODING -> DONE | ERROR | CANCELLED."""
        ticket = self._tickets.get(request_id)
        return None if ticket is None else ticket.state

    # -- prefix pool ---------------------------------------------------------------------------
    async def register_prefix(self, tokens: Sequence[int], loops: int | None = None,
                              cache_window: int | None = None) -> None:
        """Prefill ``tokens`` once and keep the KV; later ``generate`` requests whose prompt starts
        with them (at the same loops and window) reuse it."""
        if self._shutting_down:
            raise SchedulerShutdown("the runtime is shutting down")
        reply_send, reply_recv = trio.open_memory_channel[BaseException | None](1)
        await self._engine_send.send(RegisterPrefix(tuple(tokens), loops, cache_window, reply_send))
        error = await reply_recv.receive()
        if error is not None:
            raise error

    # -- observing -----------------------------------------------------------------------------
    def statistics(self) -> RuntimeStatistics:
        kv = self.engine.kv_statistics()
        return RuntimeStatistics(
            queue_depth=len(self._queue), in_flight=self._in_flight(),
            waiting_for_kv=sum(1 for t in self._tickets.values() if t.state is RequestState.DISPATCHED),
            slots=self._dispatch.slots, dispatched=self._dispatch.dispatched,
            prefix_pool_size=self._pool.size(),
            kv_blocks_used=None if kv is None else kv.blocks_used,
            kv_blocks_total=None if kv is None else kv.blocks_total,
            healthy=self.health.broken is None, broken=self.health.broken,
            shutting_down=self._shutting_down)

    def _in_flight(self) -> int:
        """Requests DISPATCHED or DECODING, read from the tickets' own states (never stale)."""
        running = (RequestState.DISPATCHED, RequestState.DECODING)
        return sum(1 for t in self._tickets.values() if t.state in running)

    @property
    def healthy(self) -> bool:
        return self.health.broken is None

    def metrics_text(self) -> str:
        """The Prometheus exposition of this runtime's registry."""
        s = self.statistics()
        self.metrics.set_gauges(queue_depth=s.queue_depth, in_flight=s.in_flight,
                                waiting_for_kv=s.waiting_for_kv, kv_used=s.kv_blocks_used,
                                kv_total=s.kv_blocks_total)
        return self.metrics.render().decode()

    # -- shutdown ------------------------------------------------------------------------------
    def refuse_new_requests(self) -> None:
        """Start shutting down: from now on admission answers SchedulerShutdown."""
        self._shutting_down = True

    async def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; with ``drain`` let queued and in-flight ones finish, else fail
        the queued ones with SchedulerShutdown and cancel those in flight."""
        self._shutting_down = True
        if not drain:
            for ticket in list(self._tickets.values()):
                self._cancel(ticket, SchedulerShutdown("the runtime shut down before this request ran"))
        # Every admitted ticket counts, wherever it is: in the queue, in a channel between two
        # actors (admitted but not yet queued, popped but not yet dispatched), or in the engine;
        # and every caller still waiting for admission gets its answer before admission stops.
        while self._admitting or len(self._queue) or self._dispatch.in_flight or any(
                not t.state.terminal and not t.cancelled for t in self._tickets.values()):
            await trio.sleep(0.005)
        self._stop()

    def _close(self) -> None:
        """Last resort on exit: no caller may wait forever on a ticket."""
        self._shutting_down = True
        for ticket in self._tickets.values():
            if not ticket.state.terminal:
                ticket.cancelled = True
                ticket.terminate(RequestState.CANCELLED, Failure(SchedulerShutdown("the runtime closed")))
        self._stop()

    def _stop(self) -> None:
        """Cancel the actors (only them: the caller's code around the runtime goes on)."""
        self._stopped = True
        self._nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_runtime(engine: Engine | EnginePort, settings: Settings | None = None) -> AsyncIterator[Runtime]:
    """Start the runtime's actors around ``engine``; on exit, drain and stop them.

    ``engine`` is a loaded ``Engine`` (its model work then runs in a worker thread) or anything
    implementing ``EnginePort``, such as ``tinyloop.testing.FakeEngine``.
    """
    # A blocking engine (``Engine``: ``step`` is a plain method) runs in a worker thread.
    port = cast(EnginePort, engine) if inspect.iscoroutinefunction(engine.step) else ThreadedEngine(cast("Engine", engine))
    async with trio.open_nursery() as nursery:
        # The actors get a nursery of their own: shutdown() cancels it, and with it no more
        # than the actors. Yielding inside the nursery that runs them would put the caller's
        # body under the same cancel scope, and shutdown() would silently cut the body short.
        actors: trio.Nursery = await nursery.start(_actor_nursery)
        rt = Runtime(port, settings or Settings(), actors)
        try:
            await rt._start()
            yield rt
            await rt.shutdown(drain=True)
        finally:
            rt._close()


async def _actor_nursery(*, task_status: trio.TaskStatus[trio.Nursery] = trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as nursery:
        task_status.started(nursery)
        await trio.sleep_forever()
