"""Three ``tinyloop serve`` replicas on 127.0.0.1 behind HAProxy with the shipped router config
(``deploy/router/haproxy.cfg``), started and stopped here.

* Requests sharing a long prefix land on one replica: its prefix-cache hit counter moves, the
  others' do not.
* Killing one replica (SIGKILL) under load loses only its in-flight streams, each ending in an
  error the client sees at once (a broken response, never a hang); the other replicas' streams
  complete and new requests keep being served.

Skipped without ``haproxy`` (``apt-get install haproxy``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.deploy.cluster import Cluster, router_binary

pytestmark = pytest.mark.skipif(router_binary("haproxy") is None, reason="haproxy is not installed")

PREFIX = "You are a careful assistant. " + " ".join(f"rule {i}: answer in short sentences." for i in range(40))
HIT = "tinyloop_prefix_cache_hit_tokens_total"
REPLICA = "x-tinyloop-replica"


@pytest.fixture(scope="module")
def cluster(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(tiny_artifact, tmp_path_factory.mktemp("replicas"), router="haproxy",
                 serve_args=("--max-batch-size", "8")) as running:
        yield running


async def test_requests_sharing_a_long_prefix_land_on_one_replica(cluster: Cluster) -> None:
    before = [r.metrics()[HIT] for r in cluster.replicas]
    served: set[str] = set()
    with trio.fail_after(60):
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as client:
            for question in ("What is a loop?", "What is a cache?", "Why hash a prefix?", "Who drains?"):
                body = {"prompt": f"{PREFIX}\nQ: {question}\nA:", "max_tokens": 4, "temperature": 0}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                served.add(resp.headers[REPLICA])
    moved = [r.metrics()[HIT] - b for r, b in zip(cluster.replicas, before)]
    assert len(served) == 1, served
    assert sorted(moved)[:2] == [0, 0] and max(moved) > 0, moved  # one replica hit its cache, only one
    assert moved[int(served.pop().removeprefix("r"))] > 0


async def test_killing_a_replica_loses_only_its_in_flight_streams(cluster: Cluster) -> None:
    streams = 9
    started: dict[int, str] = {}  # stream -> the replica serving it
    all_started = trio.Event()
    outcome: dict[int, str] = {}

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Conversation {i}: {PREFIX[:300]}", "max_tokens": 400, "ignore_eos": True,
                "stream": True, "temperature": 0}
        events: list[str] = []
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        if len(events) == 1:
                            started[i] = resp.headers[REPLICA]
                            if len(started) == streams:
                                all_started.set()
        except httpx.TransportError as exc:  # the replica died mid-stream: the body broke off
            outcome[i] = f"broken: {type(exc).__name__}"
            return
        outcome[i] = "done" if events and events[-1] == "[DONE]" and "error" not in events[-2] else "error"

    with trio.fail_after(120):
        async with (httpx.AsyncClient(base_url=cluster.url, timeout=60,
                                      limits=httpx.Limits(max_connections=streams + 4)) as client,
                    trio.open_nursery() as nursery):
            for i in range(streams):
                nursery.start_soon(stream, client, i)
            await all_started.wait()
            victim = max(set(started.values()), key=list(started.values()).count)  # the busiest replica
            cluster.replicas[int(victim.removeprefix("r"))].kill()
        on_victim = {i for i, name in started.items() if name == victim}
        assert 0 < len(on_victim) < streams, started
        assert {i for i, o in outcome.items() if o != "done"} == on_victim, (outcome, started)
        assert all(outcome[i].startswith("broken") for i in on_victim), outcome
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as client:
            for i in range(6):  # new conversations, some of which hashed to the dead replica
                body = {"prompt": f"After the kill {i}: {PREFIX[:200]}", "max_tokens": 4, "ignore_eos": True}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.headers[REPLICA] != victim
                assert json.loads(resp.text)["usage"]["completion_tokens"] == 4
