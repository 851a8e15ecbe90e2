"""The metrics actor: turns the other actors' events into prometheus-client series.

Counters and histograms move here, once per batch of events (``Tally``); gauges (queue depth, in flight, KV
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
    EventBatch,
    Finished,
    FirstToken,
    PoolDispatched,
    Preempted,
    Rejected,
    Started,
    StepDone,
)
from tinyloop.metrics import ENGINE_COUNTERS, Metrics
from tinyloop.requests import GenerationResult, RequestState

__all__ = ["run", "record", "Tally"]


def record(metrics: Metrics, event: Event | EventBatch) -> None:
    """Apply one event to the metrics."""
    tally = Tally()
    tally.add(event)
    tally.flush(metrics)


class Tally:
    """Events of one batch summed up, so each series moves once per batch: one ``inc`` per
    counter, one bulk observation per histogram (``Metrics.observe_all``), whatever the number
    of requests and tokens the batch reports. The exposition is the same as applying the
    events one by one."""

    __slots__ = ("counts", "observed", "per_engine", "_engine")

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}  # Metrics attribute -> amount
        self.observed: dict[str, list[float]] = {}  # Metrics attribute -> values
        self.per_engine: dict[tuple[str, int], float] = {}  # (ENGINE_COUNTERS name, engine) -> amount
        self._engine: int | None = None  # the engine whose batch is being added, when labelled

    def inc(self, name: str, amount: float = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + amount
        if self._engine is not None and name in ENGINE_COUNTERS:
            key = (name, self._engine)
            self.per_engine[key] = self.per_engine.get(key, 0) + amount

    def observe(self, name: str, value: float) -> None:
        values = self.observed.get(name)
        if values is None:
            self.observed[name] = [value]
        else:
            values.append(value)

    def add(self, event: Event | EventBatch) -> None:
        match event:
            case EventBatch(events=events, engine=engine):
                self._engine = engine
                try:
                    for e in events:
                        self.add(e)
                finally:
                    self._engine = None
            case Finished(state=state, wall_ms=wall, dispatch_ms=dispatch, result=result):  # per request first
                self._finished(state, wall, dispatch, result)
            case Started(queue_wait_ms=ms, prompt_tokens=prompt, hit_tokens=hit):
                self.observe("queue_wait_ms", ms)
                self.inc("prompt_tokens", prompt)
                if hit is not None:  # the engine started it: its prompt went through the prefix cache
                    self.inc("prefix_cache_queried_tokens", prompt)
                    self.inc("prefix_cache_hit_tokens", hit)
            case StepDone(batch_size=n, tokens=tokens):
                self.observe("batch_size", n)
                self.inc("tokens_generated", tokens)
            case FirstToken(ms=ms):
                self.observe("first_token_ms", ms)
            case Admitted(count=n):
                self.inc("requests_submitted", n)
            case Rejected():
                self.inc("requests_rejected")
            case PoolDispatched(count=n):
                self.inc("prefix_pool_hits", n)
            case Preempted():
                self.inc("preemptions")

    def _finished(self, state: RequestState, wall: float, dispatch: float | None,
                  result: GenerationResult | None) -> None:
        self.observe("request_wall_ms", wall)
        if dispatch is not None:
            self.observe("dispatch_ms", dispatch)
        if state is RequestState.DONE:
            self.inc("requests_completed")
        elif state is RequestState.ERROR:
            self.inc("requests_errored")
        else:
            self.inc("requests_cancelled")
        if result is not None:
            if result.mean_loops is not None:
                self.observe("loops_per_token", result.mean_loops)
            if result.draft_tokens is not None:  # a speculative request
                self.inc("spec_drafted_tokens", result.draft_tokens)
                self.inc("spec_accepted_tokens", result.accepted_draft_tokens or 0)
                self.inc("spec_rejected_tokens", result.rejected_draft_tokens or 0)

    def flush(self, metrics: Metrics) -> None:
        """Apply what was summed up, then start again from nothing."""
        for name, amount in self.counts.items():
            getattr(metrics, name).inc(amount)
        for name, values in self.observed.items():
            metrics.observe_all(getattr(metrics, name), values)
        if self.per_engine:
            series = metrics.engine_series()
            for (name, engine), amount in self.per_engine.items():
                getattr(series, name).labels(str(engine)).inc(amount)
            self.per_engine.clear()
        self.counts.clear()
        self.observed.clear()


async def run(*, inbox: trio.MemoryReceiveChannel[Event | EventBatch], metrics: Metrics,
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    tally = Tally()
    async with inbox:
        task_status.started()
        while True:
            try:
                batch = await receive_all(inbox)
            except trio.EndOfChannel:
                return
            for event in batch:
                tally.add(event)
            tally.flush(metrics)
