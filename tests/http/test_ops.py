"""Operations routes: ``/healthz`` and ``/metrics`` (every seed series, counters that move)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import LiveServer, running_server, tiny_engine
from tinyloop.errors import EngineBroken
from tinyloop.http.service import ServedModel
from tinyloop.settings import Settings
from tinyloop.testing import FakeEngine
from tinyloop.tokenizer import default_tokenizer

COUNTERS = ["tinyloop_requests_submitted", "tinyloop_requests_rejected", "tinyloop_requests_completed",
            "tinyloop_requests_errored", "tinyloop_requests_cancelled", "tinyloop_prefix_pool_hits"]
HISTOGRAMS = ["tinyloop_queue_wait_ms", "tinyloop_dispatch_ms", "tinyloop_first_token_ms",
              "tinyloop_request_wall_ms"]
GAUGES = ["tinyloop_queue_depth", "tinyloop_requests_in_flight", "tinyloop_max_seq_len",
          "tinyloop_default_loops", "tinyloop_up_timestamp_seconds"]
BUCKETS = ["1.0", "5.0", "10.0", "25.0", "50.0", "100.0", "250.0", "500.0", "1000.0", "2500.0",
           "5000.0", "10000.0", "30000.0", "60000.0", "+Inf"]


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Every sample of /metrics by name (histogram buckets as ``name{le}``), type-checked."""
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
        les = [s.labels["le"] for s in families[name].samples if s.name == name + "_bucket"]
        assert les == BUCKETS, name
    for name in GAUGES:
        assert families[name].type == "gauge", name
    samples: dict[str, float] = {}
    for family in families.values():
        for s in family.samples:
            key = f"{s.name}{{{s.labels['le']}}}" if "le" in s.labels else s.name
            samples[key] = s.value
    return samples


async def wait_for(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await trio.sleep(0.01)


async def settled(srv: LiveServer, **counts: float) -> None:
    """Wait until the metrics actor has recorded these samples (it runs after the response)."""
    get = srv.runtime.metrics.registry.get_sample_value
    await wait_for(lambda: all(get(name) == value for name, value in counts.items()))


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The counters and histogram counts that changed, by how much."""
    names = [c + "_total" for c in COUNTERS] + [h + "_count" for h in HISTOGRAMS]
    return {n: after[n] - before[n] for n in names if after[n] != before[n]}


async def test_healthz_ok_then_shutting_down() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            ok = await client.get("/healthz")
            assert (ok.status_code, ok.text) == (200, "ok\n")
            assert ok.headers["content-type"].startswith("text/plain")
            srv.runtime.refuse_new_requests()
            closing = await client.get("/healthz")
            assert closing.status_code == 503 and closing.text == "shutting down\n"


async def test_healthz_reports_a_broken_engine_which_refuses_work() -> None:
    engine = FakeEngine(fail_with=EngineBroken("boom"))
    model = ServedModel(id="fake", tokenizer=default_tokenizer(), chat_template="", max_seq_len=2048,
                        default_loops=8, max_loops=64, vocab_size=4096)
    with trio.fail_after(30):
        async with running_server(Settings(port=0), engine, model) as srv, \
                httpx.AsyncClient(base_url=srv.url) as client:
            assert (await client.get("/healthz")).status_code == 200
            failed = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert failed.status_code == 500 and "boom" in failed.json()["error"]["message"]
            broken = await client.get("/healthz")
            assert broken.status_code == 503 and "boom" in broken.text
            # A broken engine also refuses work, with the error object.
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert refused.status_code == 503 and "boom" in refused.json()["error"]["message"]


async def test_metrics_shows_every_seed_series() -> None:
    with trio.fail_after(30):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            started = time.time()
            m = await scrape(client)
            for name in COUNTERS:
                assert m[name + "_total"] == 0, name
            for name in HISTOGRAMS:
                assert m[name + "_count"] == 0 and m[name + "_sum"] == 0, name
            assert m["tinyloop_max_seq_len"] == srv.model.max_seq_len
            assert m["tinyloop_default_loops"] == srv.model.default_loops
            assert started - 120 < m["tinyloop_up_timestamp_seconds"] <= started
            assert m["tinyloop_queue_depth"] == 0 and m["tinyloop_requests_in_flight"] == 0
            assert not any(name.endswith("_created") for name in m)


async def test_counters_move_as_requests_complete_and_are_cancelled() -> None:
    settings = Settings(port=0, max_batch_size=8)
    with trio.fail_after(60):
        async with (running_server(settings, tiny_engine(max_seq_len=4096)) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=30) as client):
            before = await scrape(client)
            for _ in range(2):
                resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
                assert resp.status_code == 200
            resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
            assert resp.text.endswith("data: [DONE]\n\n")
            await settled(srv, tinyloop_request_wall_ms_count=3)
            done = await scrape(client)
            assert moved(before, done) == {
                "tinyloop_requests_submitted_total": 3, "tinyloop_requests_completed_total": 3,
                "tinyloop_queue_wait_ms_count": 3, "tinyloop_dispatch_ms_count": 3,
                "tinyloop_first_token_ms_count": 1,  # the stream's only
                "tinyloop_request_wall_ms_count": 3}
            assert done["tinyloop_request_wall_ms_sum"] > 0
            assert done["tinyloop_request_wall_ms_bucket{+Inf}"] == 3

            # A running stream shows in the gauges; closing it mid-stream cancels it.
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as resp:
                await wait_for(lambda: srv.runtime.statistics().in_flight == 1)
                running = await scrape(client)
                assert running["tinyloop_requests_in_flight"] == 1
            await wait_for(lambda: srv.runtime.statistics().in_flight == 0)
            await settled(srv, tinyloop_request_wall_ms_count=4)
            after = await scrape(client)
            assert moved(done, after) == {
                "tinyloop_requests_submitted_total": 1, "tinyloop_requests_cancelled_total": 1,
                "tinyloop_queue_wait_ms_count": 1, "tinyloop_dispatch_ms_count": 1,
                "tinyloop_first_token_ms_count": 1, "tinyloop_request_wall_ms_count": 1}
            assert after["tinyloop_requests_in_flight"] == 0

            # Refused while shutting down: a 503, but not a rejection (the seeds count queue-full
            # and SLO refusals only), so no counter moves.
            srv.runtime.refuse_new_requests()
            refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "SchedulerShutdown"
            assert moved(after, await scrape(client)) == {}


def fake_model() -> ServedModel:
    tok = default_tokenizer()
    return ServedModel(id="fake", tokenizer=tok, chat_template=tok.chat_template, max_seq_len=4096,
                       default_loops=8, max_loops=64, vocab_size=tok.vocab_size)


async def test_queue_full_is_a_503_counted_as_rejected() -> None:
    """One slot and a queue of one: a long request runs, a second waits, a third is refused."""
    engine = FakeEngine(latency_ms=10, token_latency_ms=20, stream_tokens=list(range(1, 2001)),
                        max_seq_len=4096)
    settings = Settings(port=0, max_batch_size=1, max_queue_depth=1)
    with trio.fail_after(30):
        async with (running_server(settings, engine, fake_model()) as srv,
                    httpx.AsyncClient(base_url=srv.url, timeout=30) as client):
            before = await scrape(client)
            queued: list[httpx.Response] = []

            async def second() -> None:
                queued.append(await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))

            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "hi", "max_tokens": 2000, "stream": True}) as first:
                await wait_for(lambda: srv.runtime.statistics().in_flight == 1)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(second)
                    await wait_for(lambda: srv.runtime.statistics().queue_depth == 1)
                    assert (await scrape(client))["tinyloop_queue_depth"] == 1
                    third = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                    assert third.status_code == 503
                    assert third.json()["error"]["code"] == "QueueFullError"
                    assert third.headers["Retry-After"] == "1"
                    await first.aclose()  # the client leaves: the slot frees, the second runs
            assert queued[0].status_code == 200 and queued[0].json()["choices"][0]["text"] == "<1><2>"
            await settled(srv, tinyloop_requests_cancelled_total=1, tinyloop_requests_completed_total=1,
                          tinyloop_requests_rejected_total=1)
            after = await scrape(client)
            assert {k: v for k, v in moved(before, after).items() if k.endswith("_total")} == {
                "tinyloop_requests_submitted_total": 2, "tinyloop_requests_rejected_total": 1,
                "tinyloop_requests_completed_total": 1, "tinyloop_requests_cancelled_total": 1}
            assert after["tinyloop_queue_depth"] == 0 and after["tinyloop_requests_in_flight"] == 0
            assert engine.live == 0
