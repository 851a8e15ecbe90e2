"""Load: 400 streamed requests at concurrency 64 through the real server, twice.

Every request ends DONE with its full token count or with the designed 503 refusal (the queue
is deliberately shallower than the concurrency); afterwards nothing is queued, running or
holding KV, and a second identical round grows the process's RSS by under 10%.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import trio

from tests.http.conftest import LiveServer, running_server, tiny_engine
from tests.reliability.conftest import assert_drained, counter, final_event, rss_kib, sse_events
from tinyloop.settings import Settings

pytestmark = pytest.mark.slow

REQUESTS, CONCURRENCY, MAX_TOKENS = 400, 64, 6


async def one_request(client: httpx.AsyncClient, i: int) -> str:
    """``done`` or ``refused``; anything else fails the test."""
    body = {"prompt": f"load {i % 7}", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/generate", json=body) as resp:
        if resp.status_code == 503:
            error = json.loads(await resp.aread())["error"]
            assert error["type"] and error["message"], error
            assert "retry-after" in resp.headers
            return "refused"
        assert resp.status_code == 200, await resp.aread()
        events = await sse_events(resp)
    final = final_event(events)
    assert final["done"] is True and final["completion_tokens"] == MAX_TOKENS, final
    assert len(events) == MAX_TOKENS + 2  # one per token, the final event, [DONE]
    return "done"


async def load_round(srv: LiveServer) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    limiter = trio.CapacityLimiter(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)

    async def worker(i: int) -> None:
        async with limiter:
            outcomes[await one_request(client, i)] += 1

    async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=limits) as client:
        async with trio.open_nursery() as nursery:
            for i in range(REQUESTS):
                nursery.start_soon(worker, i)
    return outcomes


async def test_400_streams_at_concurrency_64_end_done_or_refused_and_leak_nothing() -> None:
    settings = Settings(port=0, max_batch_size=16, max_queue_depth=40)
    with trio.fail_after(120):
        async with running_server(settings, tiny_engine()) as srv:
            first = await load_round(srv)
            # 16 running + 40 queued < 64 callers: some are refused by design (and, answered at once,
            # come back sooner than the ones served), the rest complete.
            assert first["done"] + first["refused"] == REQUESTS and first["done"] >= REQUESTS // 8, first
            assert counter(srv, "errored") == 0
            assert_drained(srv)
            rss_before = rss_kib()
            second = await load_round(srv)
            rss_after = rss_kib()
            assert sum(second.values()) == REQUESTS and second["done"] >= REQUESTS // 8, second
            assert_drained(srv)
            assert counter(srv, "completed") == first["done"] + second["done"]
            assert counter(srv, "rejected") == first["refused"] + second["refused"]
            assert rss_after < rss_before * 1.10, (rss_before, rss_after)
