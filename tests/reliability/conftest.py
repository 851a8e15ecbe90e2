"""Shared pieces of the reliability suite: a light torch, SSE reading, runtime bookkeeping."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

from tests.http.conftest import LiveServer


@pytest.fixture(autouse=True)
def _single_thread(one_torch_thread: None) -> None:
    """Keep the model work on one core (the suite shares the machine)."""


async def wait_for(predicate: Callable[[], bool], poll_s: float = 0.005) -> None:
    while not predicate():
        await trio.sleep(poll_s)


async def sse_events(resp: httpx.Response) -> list[str]:
    """Every ``data:`` payload of an SSE response, ``[DONE]`` included."""
    return [line.removeprefix("data: ") async for line in resp.aiter_lines() if line.startswith("data: ")]


def final_event(events: list[str]) -> dict[str, object]:
    """The last JSON event before ``[DONE]``."""
    assert events and events[-1] == "[DONE]", events[-3:]
    last: dict[str, object] = json.loads(events[-2])
    return last


async def poll_health(client: httpx.AsyncClient, done: trio.Event, seconds: list[float]) -> None:
    """Ask ``/healthz`` every 50 ms until ``done``, each answer a 200; its times go to ``seconds``."""
    while not done.is_set():
        start = trio.current_time()
        assert (await client.get("/healthz")).status_code == 200
        seconds.append(trio.current_time() - start)
        await trio.sleep(0.05)


def counter(srv: LiveServer, name: str) -> float:
    value = srv.runtime.metrics.registry.get_sample_value(f"tinyloop_requests_{name}_total")
    return value or 0.0


def assert_drained(srv: LiveServer) -> None:
    """Nothing queued, nothing running, no KV block held by a request (the prefix cache's
    blocks are ``blocks_cached``, not ``blocks_used``)."""
    stats = srv.runtime.statistics()
    assert (stats.queue_depth, stats.in_flight) == (0, 0), stats
    assert srv.engine.kv_statistics().blocks_used == 0, srv.engine.kv_statistics()


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")
