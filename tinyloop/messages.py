"""The frozen messages actors exchange (no dicts between actors), and each channel's union.

Control flow (the top row is the pipeline: closing a channel there ends the actor it feeds,
which then closes its own outbox; the bottom rows are feedback, read beside the pipeline)::

    caller (admission) ──Enqueue──▶ queue ──Ready──▶ dispatcher ──Dispatch──▶ engine i
    Runtime ──RegisterPrefix───────────────────────────────────────────▶ engine i
    Runtime ──Cancel──▶ queue ◀──Pull── dispatcher ◀──SlotFreed── engine i
    engine i ──Finished──▶ admission         every actor ──Event──▶ metrics

With several engines (``open_runtime([...])``) each has its own engine actor and inbox; the one
dispatcher places every request on one of them.

Admission is no actor: it decides in the caller's task (``actors/admission.py``). Ready,
Dispatch and SlotFreed carry every ticket of one wake-up, so the actors exchange one message per
batch, not one per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyloop.requests import GenerationResult, RequestState

if TYPE_CHECKING:
    import trio

    from tinyloop.actors.ticket import Ticket

__all__ = [
    "Enqueue", "Cancel", "Pull", "Ready", "Dispatch", "SlotFreed",
    "RegisterPrefix", "Event", "Admitted", "Rejected", "Started", "FirstToken", "Finished",
    "StepDone", "PoolDispatched", "Preempted",
    "EventBatch", "QueueFeedback", "EngineInbox",
]


# -- control -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Enqueue:
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Cancel:
    """The caller cancelled a queued ticket (``Ticket.cancel``): take it out of the queue now."""

    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Pull:
    """The dispatcher has ``slots`` more free engine slots (one ticket each)."""

    slots: int = 1


@dataclass(frozen=True, slots=True)
class Ready:
    """The queue's answer to the Pulls it has: the best tickets, best first (one per slot)."""

    tickets: list[Ticket]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Tickets for one engine, in dispatch order; ``via_pool``: they go through its prefix pool."""

    tickets: list[Ticket]
    via_pool: bool


@dataclass(frozen=True, slots=True)
class SlotFreed:
    """Engine ``engine`` retired these tickets (a step's worth, in one message): their slots are free."""

    tickets: list[Ticket]
    engine: int = 0


@dataclass(frozen=True, slots=True)
class RegisterPrefix:
    tokens: tuple[int, ...]
    loops: int | None
    cache_window: int | None
    reply: trio.MemorySendChannel[BaseException | None]


# -- events for the metrics actor --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Admitted:
    count: int = 1  # requests admitted (the queue sends one event per batch it takes in)


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str


@dataclass(frozen=True, slots=True)
class Started:
    """A request reached the engine (never sent for one retired before it did). ``hit_tokens``:
    how many of its prompt tokens' KV came from the prefix pool or the engine's prefix cache
    (0 when neither had it; None when the engine could not start it, so nothing was looked up)."""

    queue_wait_ms: float
    prompt_tokens: int = 0
    hit_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class FirstToken:
    ms: float


@dataclass(frozen=True, slots=True)
class Finished:
    state: RequestState
    wall_ms: float
    dispatch_ms: float | None
    result: GenerationResult | None


@dataclass(frozen=True, slots=True)
class StepDone:
    """One engine step: the sequences it ran and the tokens it emitted (whatever becomes of
    their requests later)."""

    batch_size: int
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class PoolDispatched:
    count: int = 1  # ``generate`` requests dispatched through the prefix pool (one event per batch)


@dataclass(frozen=True, slots=True)
class Preempted:
    """A running sequence gave its KV back, to be recomputed when the pool has room."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Several events in one message: the engine actor reports a step's events at once.
    ``engine``: which engine's, when the runtime drives several (its ``engine="i"`` series)."""

    events: list[Event]
    engine: int | None = None


Event = (Admitted | Rejected | Started | FirstToken | Finished | StepDone | PoolDispatched
         | Preempted)


# -- what each channel carries -----------------------------------------------------------------
QueueFeedback = Cancel | Pull  # beside the queue's Enqueue inbox
EngineInbox = Dispatch | RegisterPrefix
