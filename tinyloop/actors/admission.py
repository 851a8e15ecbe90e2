"""The admission actor: answers each ``Admit`` at once with a decision or a refusal.

It owns the ``Admission`` policy (queue cap, SLO with an EMA predictor, downgrade) and feeds the
predictor from the engine's ``Observe`` messages. Admitted tickets go to the queue actor.

Cancellation: cancelled with its nursery; a caller waiting on a reply then sees its reply
channel closed. Errors in the policy are refusals delivered to the caller, never raised here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import trio

from tinyloop.errors import SchedulerError, SchedulerShutdown
from tinyloop.messages import Admit, AdmitReply, Admitted, Enqueue, Event, Observe, Rejected
from tinyloop.actors.queue import Backlog
from tinyloop.policy.admission import Admission, least_loops

__all__ = ["run", "Load"]


@dataclass(frozen=True, slots=True)
class Load:
    """What admission needs to know about the rest of the runtime right now."""

    queue_depth: int
    in_flight: int
    slots: int
    shutting_down: bool
    broken: str | None


async def run(*, inbox: trio.MemoryReceiveChannel[Admit | Observe],
              outbox: trio.MemorySendChannel[Enqueue], events: trio.MemorySendChannel[Event],
              policy: Admission, load: Callable[[], Load], backlog: Backlog, default_loops: int,
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with inbox, outbox, events:
        task_status.started()
        async for msg in inbox:
            match msg:
                case Observe(service_ms=ms, loops=loops, tokens=tokens):
                    policy.predictor.observe(ms, loops=loops, tokens=tokens)
                case Admit(ticket=ticket, reply=reply):
                    now = load()
                    try:
                        if now.broken is not None:
                            raise SchedulerShutdown(f"the engine is broken: {now.broken}")
                        req = ticket.request
                        decision = policy.check(
                            queue_depth=now.queue_depth, in_flight=now.in_flight, slots=now.slots,
                            slo_ms=ticket.slo_ms, shutting_down=now.shutting_down,
                            loops=req.loops or default_loops, max_tokens=req.max_tokens,
                            least_loops=least_loops(req))
                    except SchedulerError as exc:
                        if not isinstance(exc, SchedulerShutdown):  # the seeds count queue-full and SLO only
                            events.send_nowait(Rejected(type(exc).__name__))
                        reply.send_nowait(AdmitReply(None, exc))
                        continue
                    if decision.downgraded and decision.loops is not None:
                        ticket.request = dataclasses.replace(req, loops=decision.loops)
                    backlog.in_transit += 1
                    await outbox.send(Enqueue(ticket))
                    events.send_nowait(Admitted())
                    reply.send_nowait(AdmitReply(decision, None))
