"""Admission: decides each request at once, in its caller's task, and hands it to the queue actor.

Not an actor: every check is pure (the ``Admission`` policy, and the snapshots the other actors
publish), so it runs synchronously inside ``submit`` and a refusal is raised right there, with
no message and no wake-up per request. ``Admitter`` owns the policy (queue cap, SLO with an EMA
predictor, downgrade) and the count of tickets it sent the queue; it feeds the predictor with
the ``Finished`` events of completed requests, which the engine actor hands it a step's worth at
a time on a ``Chute`` (read before each decision; nobody waits on it).

Its view of the load comes from the snapshots (``Sources``), never from the actors' state:
queued is the queue's heap plus the tickets admission sent that the queue has not taken in yet
(so a burst of submissions cannot overshoot ``max_queue_depth``); busy slots are those the
dispatcher filled less those the engine freed (a caller that got its result finds its slot free,
though the engine's SlotFreed may not have reached the dispatcher yet); the slot count is the
dispatcher's; ``broken`` is the engine's. Admitted tickets go down the queue's ``Pipe``
(unbounded: the queue cap bounds it); the queue reports them to the metrics actor as it takes
them in, so an admission costs no event of its own (a refusal sends ``Rejected``).

Shutdown: ``Runtime.refuse_new_requests`` closes the admitter, which closes its pipe (so
starts the actors' cascade) and its end of the event channel; the runtime refuses later callers
before they get here. No task,
so nothing to cancel. Errors in the policy are refusals raised to the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from tinyloop.actors.chute import Chute
from tinyloop.actors.mailbox import Pipe
from tinyloop.actors.ticket import Ticket
from tinyloop.errors import SchedulerError, SchedulerShutdown
from tinyloop.limits import Resolved
from tinyloop.messages import Enqueue, Event, EventBatch, Finished, Rejected
from tinyloop.policy.admission import Admission, Decision, least_loops
from tinyloop.requests import GenerationRequest
from tinyloop.settings import Settings

if TYPE_CHECKING:
    from tinyloop.actors.dispatcher import DispatcherStatistics
    from tinyloop.actors.queue import QueueStatistics

__all__ = ["Admitter", "Sources"]


@dataclass(frozen=True, slots=True)
class Sources:
    """Where admission reads the other actors' published state: the queue's and the
    dispatcher's snapshots, the slots the engines freed (``EngineStatistics.slots_freed``, all
    engines together) and why they are broken (None while one of them is fine)."""

    queue: Callable[[], QueueStatistics]
    dispatcher: Callable[[], DispatcherStatistics]
    slots_freed: Callable[[], int]
    broken: Callable[[], str | None]


class Admitter:
    """Admit a ticket into the queue, or raise the refusal (module docstring)."""

    def __init__(self, *, outbox: Pipe[Enqueue], settings: Settings,
                 observations: Sequence[Chute[list[Finished]]],
                 events: trio.MemorySendChannel[Event | EventBatch], sources: Sources,
                 check: Callable[[GenerationRequest], Resolved]) -> None:
        self.policy = Admission.from_settings(settings)
        self.sent = 0  # Enqueue messages sent to the queue, ever
        self._outbox = outbox
        self._observations = observations
        self._events = events
        self._sources = sources
        self._check = check

    def __repr__(self) -> str:
        return f"<Admitter sent={self.sent} {self.policy.predictor!r}>"

    def admit(self, ticket: Ticket) -> Decision:
        """Send ``ticket`` to the queue, downgraded if the policy says so; raise
        ``QueueFullError``, ``AdmissionRejected``, or ``SchedulerShutdown`` when the engine is
        broken or the queue has stopped. A refused ticket is left to the caller to end."""
        self._learn()
        try:
            decision = self._decide(ticket)
        except SchedulerError as exc:
            if not isinstance(exc, SchedulerShutdown):  # the seeds count queue-full and SLO only
                self._report(Rejected(type(exc).__name__))
            raise
        if decision.downgraded and decision.loops is not None:
            ticket.request = dataclasses.replace(ticket.request, loops=decision.loops)
            ticket.resolved = self._check(ticket.request)  # the limits resolve it again
        try:
            self._outbox.send_nowait(Enqueue(ticket))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise SchedulerShutdown("the runtime is shutting down") from None
        self.sent += 1
        return decision

    def close(self) -> None:
        """No more admissions: close the pipe (the queue finishes what it holds, then the
        cascade goes on) and this end of the event channel. Idempotent."""
        self._outbox.close()
        self._events.close()

    def _learn(self) -> None:
        """The predictor learns from every request finished so far (on any engine)."""
        for observations in self._observations:
            while observations.ready:
                try:
                    step = observations.receive_nowait()
                except trio.EndOfChannel:  # the engine actor has stopped
                    break
                for done in step:  # service: dispatch to done; every result has run a loop and a token
                    assert done.result is not None
                    self.policy.predictor.observe(done.dispatch_ms or 0.0, loops=done.result.loops_used or 1,
                                                  tokens=max(done.result.completion_tokens, 1))

    def _decide(self, ticket: Ticket) -> Decision:
        sources = self._sources
        broken = sources.broken()
        if broken is not None:
            raise SchedulerShutdown(f"the engine is broken: {broken}")  # every engine is
        queue, dispatcher = sources.queue(), sources.dispatcher()
        req = ticket.request
        return self.policy.check(
            queue_depth=queue.queued + self.sent - queue.taken_in,
            in_flight=dispatcher.slots_taken - sources.slots_freed(),
            slots=dispatcher.slots, slo_ms=ticket.slo_ms, shutting_down=False,
            loops=ticket.loops, max_tokens=req.max_tokens, least_loops=least_loops(req))

    def _report(self, event: Event) -> None:
        try:
            self._events.send_nowait(event)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the metrics actor has stopped
