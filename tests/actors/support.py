"""Helpers for the runtime's tests on FakeEngine (seeds/scheduler.md), one file per concern.

Every test runs on the ``autojump_clock``: FakeEngine's latencies are Trio sleeps, so a test
that "waits" half a second takes a few real milliseconds and always sees the same interleaving.
``settle()`` lets every task run until all are blocked without moving the clock; the
``fail_after`` ceilings are virtual seconds, so a deadlock fails at once instead of hanging.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from tinyloop import GenerationRequest, GenerationResult, RequestStream, Runtime, Settings, TinyLoopError, open_runtime
from tinyloop.testing import FakeEngine

CEILING_S = 60  # virtual seconds

SEED_BUCKETS_MS = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, math.inf]
SEED_COUNTERS = ["tinyloop_requests_submitted", "tinyloop_requests_rejected", "tinyloop_requests_completed",
                 "tinyloop_requests_errored", "tinyloop_requests_cancelled", "tinyloop_prefix_pool_hits"]
SEED_HISTOGRAMS = ["tinyloop_queue_wait_ms", "tinyloop_dispatch_ms", "tinyloop_first_token_ms",
                   "tinyloop_request_wall_ms"]
SEED_GAUGES = ["tinyloop_queue_depth", "tinyloop_requests_in_flight"]

Outcomes = dict[str, GenerationResult | TinyLoopError]

settle = trio.testing.wait_all_tasks_blocked


def req(max_tokens: int = 3, prompt: tuple[int, ...] = (1, 2), **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=prompt, max_tokens=max_tokens, **kw)


def ids(*requests: GenerationRequest) -> list[str]:
    return [r.request_id for r in requests]


def sample(rt: Runtime, name: str) -> float:
    """A sample's value straight from the registry (0 when it has not been created)."""
    value = rt.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def exposition(rt: Runtime) -> dict[str, float]:
    """``metrics_text()`` parsed the way a Prometheus server parses it: sample name -> value
    (bucket samples keyed ``name{le}``)."""
    values = {}
    for family in text_string_to_metric_families(rt.metrics_text()):
        for s in family.samples:
            key = f"{s.name}{{{s.labels['le']}}}" if "le" in s.labels else s.name
            values[key] = s.value
    return values


@asynccontextmanager
async def runtime(engine: FakeEngine, **settings: Any) -> AsyncIterator[Runtime]:
    """``open_runtime`` with ``Settings(**settings)``; on a clean exit, check nothing is left over
    and that the body ran to its end (a Cancelled absorbed by the runtime would skip its rest)."""
    body_finished = False
    async with open_runtime(engine, Settings(**settings)) as rt:
        yield rt
        await settle()
        stats = rt.statistics()
        assert (stats.queue_depth, stats.in_flight) == (0, 0), rt
        body_finished = True
    assert body_finished, "the test body was cut short"
    assert engine.live == 0, "every sequence and prefix handle is freed"


async def run_request(rt: Runtime, request: GenerationRequest, outcomes: Outcomes, *, priority: int = 0,
                      slo_ms: float | None = None, stream: bool = False,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Submit ``request`` (as ``rt.submit`` does, or as a stream), report once admission has
    answered, and record the result or the TinyLoopError in ``outcomes``."""
    async with RequestStream(rt, request, priority, slo_ms, stream=stream) as s:
        try:
            await s.start()
        except TinyLoopError as exc:
            outcomes[request.request_id] = exc
            task_status.started()
            return
        task_status.started()
        try:
            async for _ in s:
                pass
        except TinyLoopError as exc:
            outcomes[request.request_id] = exc
            return
    assert s.result is not None
    outcomes[request.request_id] = s.result


async def until(predicate: Any, poll_s: float = 0.001) -> None:
    """Poll ``predicate`` on the virtual clock (the caller holds a fail_after ceiling)."""
    while not predicate():
        await trio.sleep(poll_s)


# -- ordering -----------------------------------------------------------------------------------
