"""Disconnect storm: 100 concurrent streams, 50 of them dropped by the client at a random point
(seeded). The dropped ones end CANCELLED and leave the batch within a decode step of the drop;
the others complete with their full token counts; no KV block stays in use.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import trio

from tests.http.conftest import running_server, tiny_engine
from tests.http.test_disconnect import read_events, record_streams
from tests.reliability.conftest import assert_drained, counter, final_event, sse_events, wait_for
from tinyloop.requests import RequestState
from tinyloop.settings import Settings

pytestmark = pytest.mark.slow

STREAMS, KEPT_TOKENS = 100, 5
DROPPED = {"max_tokens": 2000, "ignore_eos": True}  # cannot finish by itself in this test
KEPT = {"max_tokens": KEPT_TOKENS, "ignore_eos": True}


async def test_half_of_100_streams_dropped_at_random_points(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    plan = [i % 2 == 0 for i in range(STREAMS)]  # True: this one is dropped
    rng.shuffle(plan)
    settings = Settings(port=0, max_batch_size=16, max_queue_depth=STREAMS)
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    with trio.fail_after(60):
        async with (running_server(settings, tiny_engine(max_seq_len=4096)) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=60, limits=limits) as client):
            streams = record_streams(srv, monkeypatch)

            async def client_task(i: int, drop: bool, after: int) -> None:
                body: dict[str, Any] = {"prompt": f"storm {i}", "stream": True, **(DROPPED if drop else KEPT)}
                async with client.stream("POST", "/generate", json=body) as resp:
                    assert resp.status_code == 200
                    if drop:
                        events = await read_events(resp, after)
                        assert len(events) == after and "[DONE]" not in events
                        return
                    events = await sse_events(resp)
                final = final_event(events)
                assert final["completion_tokens"] == KEPT_TOKENS and final["finish_reason"] == "length"

            async with trio.open_nursery() as nursery:
                for i, drop in enumerate(plan):
                    nursery.start_soon(client_task, i, drop, rng.randint(1, 8))
            # Every client is done; the dropped requests must already be leaving the batch.
            with trio.fail_after(2):
                await wait_for(lambda: srv.runtime.statistics().in_flight == 0)
            await wait_for(lambda: counter(srv, "cancelled") == STREAMS // 2)
            assert counter(srv, "completed") == STREAMS // 2
            assert counter(srv, "errored") == 0
            assert len(streams) == STREAMS
            for stream in streams:  # a dropped request is the one that asked for 2000 tokens
                dropped = stream.ticket.request.max_tokens == DROPPED["max_tokens"]
                expected = RequestState.CANCELLED if dropped else RequestState.DONE
                assert srv.runtime.request_state(stream.request_id) is expected
            assert_drained(srv)

