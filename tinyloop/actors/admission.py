"""The admission actor: answers each ``Admit`` at once with a decision or a refusal.

It owns the ``Admission`` policy (queue cap, SLO with an EMA predictor, downgrade) and feeds the
predictor from the engine's ``Observe`` messages, read before each decision. Its view of the load
comes from the snapshots the other actors publish (``Sources``), never from their state: queued
is the queue's heap plus the tickets admission sent that the queue has not taken in yet (so a
burst of submissions cannot overshoot ``max_queue_depth``); busy slots and the slot count are the
dispatcher's; ``broken`` is the engine's. Admitted tickets go to the queue actor.

Answers go on the ticket's own channel (no reply channel per request): a refusal always (the
ticket ends there), a go-ahead only when the caller waits for one (``RequestStream.start``; a
caller that only iterates learns of the go-ahead from its first chunk).

Shutdown: the runtime closes the Admit inbox (``refuse_new_requests``); a caller sending later
gets ``ClosedResourceError`` (SchedulerShutdown to it); admission answers what was buffered
before, then closes its outbox to the queue. Cancellation: cancelled with its nursery; the
tickets still in its inbox are retired by the runtime once every actor has stopped
(``Runtime._orphans``). Errors in the policy are refusals delivered to the caller, never raised
here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from tinyloop.actors.mailbox import Pipe, receive_all
from tinyloop.actors.ticket import AdmitReply
from tinyloop.errors import SchedulerError, SchedulerShutdown
from tinyloop.limits import Resolved
from tinyloop.messages import Admit, Admitted, Enqueue, Event, Observe, Rejected
from tinyloop.policy.admission import Admission, Decision, least_loops
from tinyloop.requests import GenerationRequest, RequestState
from tinyloop.settings import Settings

if TYPE_CHECKING:
    from tinyloop.actors.dispatcher import DispatcherStatistics
    from tinyloop.actors.queue import QueueStatistics

__all__ = ["run", "Sources"]


@dataclass(frozen=True, slots=True)
class Sources:
    """Where admission reads the other actors' published state: the queue's and the
    dispatcher's snapshots, and why the engine is broken (None while it is fine)."""

    queue: Callable[[], QueueStatistics]
    dispatcher: Callable[[], DispatcherStatistics]
    broken: Callable[[], str | None]


async def run(*, inbox: trio.MemoryReceiveChannel[Admit], outbox: Pipe[Enqueue],
              settings: Settings, observations: trio.MemoryReceiveChannel[list[Observe]],
              events: trio.MemorySendChannel[Event], sources: Sources,
              check: Callable[[GenerationRequest], Resolved],
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    policy = Admission.from_settings(settings)
    sent = 0  # Enqueue messages sent to the queue, ever
    admitted = 0  # in this batch (one Admitted event per batch)
    async with inbox, outbox, events, observations:
        task_status.started()
        while True:
            try:
                batch = await receive_all(inbox)
            except trio.EndOfChannel:
                break
            while True:  # the predictor learns from every request finished so far
                try:
                    step = observations.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                for seen in step:
                    policy.predictor.observe(seen.service_ms, loops=seen.loops, tokens=seen.tokens)
            # Nothing awaits while a batch is decided, so the other actors' snapshots hold for
            # all of it (admission's own ``sent`` counts the batch's tickets as queued).
            load = Load(sources.queue(), sources.dispatcher(), sources.broken())
            for msg in batch:
                ticket = msg.ticket
                try:
                    decision = _decide(policy, msg, load, sent)
                except SchedulerError as exc:
                    if not isinstance(exc, SchedulerShutdown):  # the seeds count queue-full and SLO only
                        events.send_nowait(Rejected(type(exc).__name__))
                    ticket.terminate(RequestState.CANCELLED, AdmitReply(None, exc))  # the caller raises it
                    continue
                if decision.downgraded and decision.loops is not None:
                    ticket.request = dataclasses.replace(ticket.request, loops=decision.loops)
                    ticket.resolved = check(ticket.request)  # the limits resolve it again
                sent += 1
                if msg.reply:  # before the Enqueue: the go-ahead is the ticket's first item
                    ticket.deliver(AdmitReply(decision, None))
                outbox.send_nowait(Enqueue(ticket))  # the queue's mailbox is unbounded
                admitted += 1
            if admitted:
                events.send_nowait(Admitted(admitted))
                admitted = 0

@dataclass(frozen=True, slots=True)
class Load:
    """The other actors' snapshots, read once per batch of Admit messages."""

    queue: QueueStatistics
    dispatcher: DispatcherStatistics
    broken: str | None


def _decide(policy: Admission, msg: Admit, load: Load, sent: int) -> Decision:
    if load.broken is not None:
        raise SchedulerShutdown(f"the engine is broken: {load.broken}")
    queue, dispatcher = load.queue, load.dispatcher
    req = msg.ticket.request
    return policy.check(
        queue_depth=queue.queued + sent - queue.taken_in, in_flight=dispatcher.slots_used,
        slots=dispatcher.slots, slo_ms=msg.ticket.slo_ms, shutting_down=False,
        loops=msg.ticket.loops, max_tokens=req.max_tokens, least_loops=least_loops(req))
