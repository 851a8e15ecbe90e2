"""The metrics actor: turns the other actors' events into prometheus-client series.

Counters and histograms move here, one event at a time; gauges (queue depth, in flight, KV
blocks) are read from the actors' ``statistics()`` when the exposition is rendered, so there is
no second set of counters to drift.

Cancellation: cancelled with its nursery; events still buffered are dropped.
"""

from __future__ import annotations

import trio

from tinyloop.actors.mailbox import receive_all
from tinyloop.messages import (
    Admitted,
    Event,
    Finished,
    FirstToken,
    PoolDispatched,
    Preempted,
    PrefixLookup,
    Rejected,
    Started,
    StepDone,
)
from tinyloop.metrics import Metrics
from tinyloop.requests import GenerationResult, RequestState

__all__ = ["run", "record"]


def record(metrics: Metrics, event: Event) -> None:
    """Apply one event to the metrics."""
    match event:
        case Admitted():
            metrics.requests_submitted.inc()
        case Rejected():
            metrics.requests_rejected.inc()
        case Started(queue_wait_ms=ms, prompt_tokens=prompt):
            metrics.queue_wait_ms.observe(ms)
            metrics.prompt_tokens.inc(prompt)
        case FirstToken(ms=ms):
            metrics.first_token_ms.observe(ms)
        case PoolDispatched():
            metrics.prefix_pool_hits.inc()
        case Preempted():
            metrics.preemptions.inc()
        case PrefixLookup(queried_tokens=queried, hit_tokens=hit):
            metrics.prefix_cache_queried_tokens.inc(queried)
            metrics.prefix_cache_hit_tokens.inc(hit)
        case StepDone(batch_size=n, tokens=tokens):
            metrics.batch_size.observe(n)
            metrics.tokens_generated.inc(tokens)
        case Finished(state=state, wall_ms=wall, dispatch_ms=dispatch, result=result):
            _finished(metrics, state, wall, dispatch, result)


def _finished(metrics: Metrics, state: RequestState, wall: float, dispatch: float | None,
              result: GenerationResult | None) -> None:
    metrics.request_wall_ms.observe(wall)
    if dispatch is not None:
        metrics.dispatch_ms.observe(dispatch)
    if state is RequestState.DONE:
        metrics.requests_completed.inc()
    elif state is RequestState.ERROR:
        metrics.requests_errored.inc()
    else:
        metrics.requests_cancelled.inc()
    if result is not None:
        if result.mean_loops is not None:
            metrics.loops_per_token.observe(result.mean_loops)
        if result.draft_tokens is not None:  # a speculative request
            metrics.spec_drafted_tokens.inc(result.draft_tokens)
            metrics.spec_accepted_tokens.inc(result.accepted_draft_tokens or 0)
            metrics.spec_rejected_tokens.inc(result.rejected_draft_tokens or 0)


async def run(*, inbox: trio.MemoryReceiveChannel[Event], metrics: Metrics,
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with inbox:
        task_status.started()
        while True:
            try:
                batch = await receive_all(inbox)
            except trio.EndOfChannel:
                return
            for event in batch:
                record(metrics, event)
