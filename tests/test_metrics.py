from __future__ import annotations

import math

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.http.conftest import running_server
from tinyloop.metrics import CONTENT_TYPE, Metrics

SEED_MS_BUCKETS = [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, math.inf]

# Exposed family name (as the parser reports it: counters without `_total`) -> type.
EXPECTED = {
    "tinyloop_requests_submitted": "counter",
    "tinyloop_requests_rejected": "counter",
    "tinyloop_requests_completed": "counter",
    "tinyloop_requests_errored": "counter",
    "tinyloop_requests_cancelled": "counter",
    "tinyloop_prefix_pool_hits": "counter",
    "tinyloop_queue_wait_ms": "histogram",
    "tinyloop_dispatch_ms": "histogram",
    "tinyloop_first_token_ms": "histogram",
    "tinyloop_request_wall_ms": "histogram",
    "tinyloop_queue_depth": "gauge",
    "tinyloop_requests_in_flight": "gauge",
    "tinyloop_requests_waiting_for_kv": "gauge",
    "tinyloop_max_seq_len": "gauge",
    "tinyloop_default_loops": "gauge",
    "tinyloop_up_timestamp_seconds": "gauge",
    "tinyloop_batch_size": "histogram",
    "tinyloop_tokens_generated": "counter",
    "tinyloop_prompt_tokens": "counter",
    "tinyloop_preemptions": "counter",
    "tinyloop_kv_blocks_used": "gauge",
    "tinyloop_kv_blocks_total": "gauge",
    "tinyloop_kv_bytes_per_token": "gauge",
    "tinyloop_prefix_cache_hit_tokens": "counter",
    "tinyloop_prefix_cache_queried_tokens": "counter",
    "tinyloop_spec_drafted_tokens": "counter",
    "tinyloop_spec_accepted_tokens": "counter",
    "tinyloop_spec_rejected_tokens": "counter",
    "tinyloop_loops_per_token": "histogram",
}


def families(m: Metrics) -> dict[str, tuple[str, str, list[Sample]]]:
    text = m.render().decode("utf-8")
    return {f.name: (f.type, f.documentation, f.samples) for f in text_string_to_metric_families(text)}


def buckets(samples: list[Sample]) -> list[float]:
    return [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]


def test_every_series_present_with_its_type_and_nothing_else() -> None:
    found = families(Metrics())
    assert {name: kind for name, (kind, _, _) in found.items()} == EXPECTED


def test_exposed_names_and_seed_help_text() -> None:
    text = Metrics().render().decode("utf-8")
    for line in (
        "# HELP tinyloop_requests_submitted_total Admitted requests (before any terminal state).",
        "# TYPE tinyloop_requests_submitted_total counter",
        "# HELP tinyloop_requests_rejected_total Rejected by QueueFullError or AdmissionRejected.",
        "# HELP tinyloop_requests_completed_total Reached DONE.",
        "# HELP tinyloop_requests_errored_total Reached ERROR.",
        "# HELP tinyloop_requests_cancelled_total Cancelled before or during dispatch.",
        "# HELP tinyloop_prefix_pool_hits_total Dispatched through generate_with_pool (pool had entries).",
        "# HELP tinyloop_queue_wait_ms Ms between submit() and first engine call (queue time only).",
        "# HELP tinyloop_dispatch_ms Ms from engine call start to terminal state (prefill + decode).",
        "# HELP tinyloop_first_token_ms Streaming only: ms from submit to first emitted chunk.",
        "# HELP tinyloop_request_wall_ms End-to-end ms from submit to terminal state.",
        "# HELP tinyloop_queue_depth Requests currently queued.",
        "# HELP tinyloop_requests_in_flight Requests currently DISPATCHED or DECODING.",
        "# HELP tinyloop_max_seq_len Maximum sequence length the model was loaded with.",
        "# HELP tinyloop_default_loops Default loop depth.",
        "# HELP tinyloop_up_timestamp_seconds Unix timestamp at server start.",
        'tinyloop_queue_wait_ms_bucket{le="1.0"} 0.0',
        'tinyloop_queue_wait_ms_bucket{le="+Inf"} 0.0',
    ):
        assert line in text.splitlines()
    assert "_created" not in text
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_histogram_buckets_are_the_seeds() -> None:
    found = families(Metrics())
    for name in ("tinyloop_queue_wait_ms", "tinyloop_dispatch_ms", "tinyloop_first_token_ms",
                 "tinyloop_request_wall_ms"):
        assert buckets(found[name][2]) == SEED_MS_BUCKETS
    assert buckets(found["tinyloop_batch_size"][2]) == [1, 2, 4, 8, 16, 32, 64, 128, math.inf]
    assert buckets(found["tinyloop_loops_per_token"][2]) == [1, 2, 4, 8, 16, 32, 64, math.inf]


def test_observations_gauges_and_engine_info_render() -> None:
    m = Metrics()
    m.requests_submitted.inc()
    m.requests_submitted.inc()
    m.queue_wait_ms.observe(7.0)
    m.set_gauges(queue_depth=3, in_flight=2, kv_used=10, kv_total=64)
    m.set_gauges(queue_depth=1)  # the others stay as they were
    m.set_engine_info(max_seq_len=2048, default_loops=8, up_timestamp_s=1713475200.0, kv_bytes_per_token=4096)
    get = m.registry.get_sample_value
    assert get("tinyloop_requests_submitted_total") == 2.0
    assert get("tinyloop_queue_wait_ms_bucket", {"le": "5.0"}) == 0.0
    assert get("tinyloop_queue_wait_ms_bucket", {"le": "10.0"}) == 1.0
    assert get("tinyloop_queue_wait_ms_sum") == 7.0
    assert (get("tinyloop_queue_depth"), get("tinyloop_requests_in_flight")) == (1.0, 2.0)
    assert (get("tinyloop_kv_blocks_used"), get("tinyloop_kv_blocks_total")) == (10.0, 64.0)
    assert get("tinyloop_max_seq_len") == 2048.0
    assert get("tinyloop_kv_bytes_per_token") == 4096.0
    text = m.render().decode("utf-8")
    assert "tinyloop_requests_submitted_total 2.0" in text.splitlines()
    assert "tinyloop_up_timestamp_seconds 1.7134752e+09" in text.splitlines()
    assert repr(m) == "<Metrics submitted=2.0 completed=0.0 queue_depth=1.0 in_flight=2.0>"


def test_two_instances_do_not_share_state() -> None:
    a, b = Metrics(), Metrics()
    assert a.registry is not b.registry
    a.requests_completed.inc(5)
    a.set_gauges(queue_depth=4)
    assert b.registry.get_sample_value("tinyloop_requests_completed_total") == 0.0
    assert b.registry.get_sample_value("tinyloop_queue_depth") == 0.0
    assert a.registry.get_sample_value("tinyloop_requests_completed_total") == 5.0


ROUTES = [("/generate", {"prompt": "hi"}), ("/v1/completions", {"prompt": "hi"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


async def test_first_token_ms_counts_streamed_http_requests_only() -> None:
    """A JSON answer (``stream: false``) is no stream: only the SSE requests count."""

    async def first_tokens(client: httpx.AsyncClient) -> float:
        text = (await client.get("/metrics")).text
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "tinyloop_first_token_ms_count")

    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for path, body in ROUTES:
                resp = await client.post(path, json={**body, "max_tokens": 2, "stream": False})
                assert resp.status_code == 200, resp.text
            for path, body in ROUTES:
                resp = await client.post(path, json={**body, "max_tokens": 2, "stream": True})
                assert resp.status_code == 200 and resp.text.rstrip().endswith("[DONE]"), resp.text
            while await first_tokens(client) < len(ROUTES):  # the metrics actor lags a little
                await trio.sleep(0.01)
            # events arrive in order: the JSON requests' ones (if any) came before the streams'
            assert await first_tokens(client) == len(ROUTES)
