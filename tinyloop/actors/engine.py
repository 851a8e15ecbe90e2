"""The engine actor: owns the engine and runs the continuous-batching iteration loop.

Each iteration: drop sequences whose caller went away, plan the KV (``policy/kvplan.py``:
preempt the youngest growing sequence while the batch's next step does not fit, then start
waiting entries that fit), run one ``step`` over all active sequences (a prefill chunk for new
ones, one batched decode for the rest, in a worker thread), deliver each new token to its
ticket, retire finished sequences and free their KV. This module runs the loop; the state it
drives is ``engine_state.py``'s ``EngineState``, what it publishes and sends ``engine_reports.py``.

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

from typing import Any

import trio

from tinyloop.actors.chute import Chute
from tinyloop.actors.engine_reports import EngineStatistics as EngineStatistics
from tinyloop.actors.engine_reports import Health as Health
from tinyloop.actors.engine_reports import Reports
from tinyloop.actors.engine_state import EngineState as EngineState
from tinyloop.actors.port import EnginePort
from tinyloop.messages import EngineInbox, Event, EventBatch, Finished, SlotFreed
from tinyloop.policy.kvplan import KVPlanner
from tinyloop.policy.prefix_pool import PrefixPool
from tinyloop.settings import Settings

__all__ = ["run", "Health", "EngineState", "EngineStatistics"]


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
    reports = Reports(freed, observe, outbox, index=index, label=label)
    loop = EngineState(engine, pool, Health(), reports, KVPlanner(settings.kv_aging_ms / 1000))
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
