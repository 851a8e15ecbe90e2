"""Every Prometheus series TinyLoop exposes, on one registry per runtime.

Names, types, help text and buckets of the scheduler series follow seeds/scheduler.md (help is
the seed's "Meaning"/"Observation" text); the engine gauges follow seeds/http-server.md. There is
no global registry: two runtimes in one process keep separate numbers.

prometheus-client appends ``_total`` to counter names itself, so counters are created without it
(``tinyloop_requests_submitted`` is exposed as ``tinyloop_requests_submitted_total``). It also
adds a ``*_created`` sample to each counter and histogram, which the 0.0.4 text format prints as
an extra gauge family per series; :meth:`Metrics.render` leaves those out (per render, not via
the library's process-global switch), so /metrics shows exactly the seeds' series.

Gauges that mirror actor state (queue depth, in flight, KV blocks) are *set from a snapshot*: the
metrics actor reads the actors' ``statistics()`` and calls :meth:`Metrics.set_gauges`. A plain
``set`` keeps this class free of references into actor state and keeps rendering a pure read.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["BATCH_SIZE_BUCKETS", "CONTENT_TYPE", "ENGINE_COUNTERS", "LATENCY_BUCKETS_MS", "LOOPS_BUCKETS",
           "EngineSeries", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS_MS: tuple[float, ...] = (
    1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, float("inf"),
)
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, float("inf"))
LOOPS_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, float("inf"))


class Metrics:
    """The runtime's metrics; each attribute is one prometheus-client metric on ``registry``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_series: EngineSeries | None = None

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_MS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        # Scheduler counters (seeds/scheduler.md).
        self.requests_submitted = counter("tinyloop_requests_submitted",
                                          "Admitted requests (before any terminal state).")
        self.requests_rejected = counter("tinyloop_requests_rejected",
                                         "Rejected by QueueFullError or AdmissionRejected.")
        self.requests_completed = counter("tinyloop_requests_completed", "Reached DONE.")
        self.requests_errored = counter("tinyloop_requests_errored", "Reached ERROR.")
        self.requests_cancelled = counter("tinyloop_requests_cancelled",
                                          "Cancelled before or during dispatch.")
        self.prefix_pool_hits = counter("tinyloop_prefix_pool_hits",
                                        "Dispatched through generate_with_pool (pool had entries).")
        # Scheduler histograms, in ms.
        self.queue_wait_ms = histogram("tinyloop_queue_wait_ms",
                                       "Ms between submit() and first engine call (queue time only).")
        self.dispatch_ms = histogram("tinyloop_dispatch_ms",
                                     "Ms from engine call start to terminal state (prefill + decode).")
        self.first_token_ms = histogram("tinyloop_first_token_ms",
                                        "Streaming only: ms from submit to first emitted chunk.")
        self.request_wall_ms = histogram("tinyloop_request_wall_ms",
                                         "End-to-end ms from submit to terminal state.")
        # Scheduler gauges.
        self.queue_depth = gauge("tinyloop_queue_depth", "Requests currently queued.")
        self.requests_in_flight = gauge("tinyloop_requests_in_flight",
                                        "Requests currently DISPATCHED or DECODING.")
        # Engine gauges (seeds/http-server.md).
        self.max_seq_len = gauge("tinyloop_max_seq_len", "Maximum sequence length the model was loaded with.")
        self.default_loops = gauge("tinyloop_default_loops", "Default loop depth.")
        self.up_timestamp_seconds = gauge("tinyloop_up_timestamp_seconds", "Unix timestamp at server start.")
        # Engine throughput and KV.
        self.batch_size = histogram("tinyloop_batch_size", "Sequences decoded together in one decode step.",
                                    BATCH_SIZE_BUCKETS)
        self.tokens_generated = counter("tinyloop_tokens_generated",
                                        "Tokens generated, counted as emitted (whatever becomes of the request).")
        self.prompt_tokens = counter("tinyloop_prompt_tokens",
                                     "Prompt tokens of requests that reached the engine (prefilled or cached).")
        self.requests_waiting_for_kv = gauge(
            "tinyloop_requests_waiting_for_kv",
            "Requests dispatched to the engine that wait for their KV blocks to fit.")
        self.preemptions = counter("tinyloop_preemptions",
                                   "Running sequences that gave their KV back to be recomputed later.")
        self.kv_blocks_used = gauge("tinyloop_kv_blocks_used", "KV cache blocks currently allocated.")
        self.kv_blocks_total = gauge("tinyloop_kv_blocks_total", "KV cache blocks in the pool.")
        self.kv_bytes_per_token = gauge("tinyloop_kv_bytes_per_token",
                                        "KV cache bytes per token in the active cache mode.")
        self.prefix_cache_hit_tokens = counter("tinyloop_prefix_cache_hit_tokens",
                                               "Prompt tokens served from cached KV instead of prefill.")
        self.prefix_cache_queried_tokens = counter("tinyloop_prefix_cache_queried_tokens",
                                                   "Prompt tokens looked up in the prefix cache.")
        # Speculative decoding.
        self.spec_drafted_tokens = counter("tinyloop_spec_drafted_tokens", "Tokens drafted by speculative decoding.")
        self.spec_accepted_tokens = counter("tinyloop_spec_accepted_tokens", "Drafted tokens accepted by verification.")
        self.spec_rejected_tokens = counter("tinyloop_spec_rejected_tokens", "Drafted tokens rejected by verification.")
        self.loops_per_token = histogram("tinyloop_loops_per_token",
                                         "Core loops run per generated token (after any early exit).",
                                         LOOPS_BUCKETS)

    def set_engine_info(self, *, max_seq_len: int, default_loops: int, up_timestamp_s: float,
                        kv_bytes_per_token: float | None = None) -> None:
        """Set the engine gauges once at startup; the caller reads the clock for ``up_timestamp_s``."""
        self.max_seq_len.set(max_seq_len)
        self.default_loops.set(default_loops)
        self.up_timestamp_seconds.set(up_timestamp_s)
        if kv_bytes_per_token is not None:
            self.kv_bytes_per_token.set(kv_bytes_per_token)

    def set_gauges(self, *, queue_depth: int | None = None, in_flight: int | None = None,
                   waiting_for_kv: int | None = None, kv_used: int | None = None,
                   kv_total: int | None = None) -> None:
        """Mirror a snapshot of actor state; an argument left None leaves its gauge as it was."""
        for metric, value in ((self.queue_depth, queue_depth), (self.requests_in_flight, in_flight),
                              (self.requests_waiting_for_kv, waiting_for_kv),
                              (self.kv_blocks_used, kv_used), (self.kv_blocks_total, kv_total)):
            if value is not None:
                metric.set(value)

    def engine_series(self) -> EngineSeries:
        """The ``engine="i"`` series, made on first use: a runtime with one engine never shows
        them, so its exposition is exactly the seeds' series."""
        if self._engine_series is None:
            self._engine_series = EngineSeries(self.registry)
        return self._engine_series

    def set_engine_gauges(self, engines: Sequence[Any], slots_used: Sequence[int]) -> None:
        """Mirror each engine's snapshot (``EngineStatistics``) and the dispatcher's slots in use
        on it into the ``engine="i"`` gauges."""
        series = self.engine_series()
        for i, e in enumerate(engines):
            label = str(i)
            series.healthy.labels(label).set(0 if e.broken is not None else 1)
            series.slots_used.labels(label).set(slots_used[i])
            series.decoding.labels(label).set(e.decoding)
            series.prefix_pool_size.labels(label).set(e.prefix_pool_size)
            if e.kv is not None:
                series.kv_blocks_used.labels(label).set(e.kv.blocks_used)
                series.kv_blocks_total.labels(label).set(e.kv.blocks_total)

    @staticmethod
    def observe_all(histogram: Histogram, values: list[float]) -> None:
        """``histogram.observe(v)`` for each value, with one update per bucket and one of the
        sum (the runtime's metrics actor reports a batch of events at a time). Falls back to
        one ``observe`` per value if prometheus-client's histogram internals ever differ."""
        bounds = getattr(histogram, "_upper_bounds", None)
        buckets = getattr(histogram, "_buckets", None)
        total = getattr(histogram, "_sum", None)
        if len(values) == 1 or bounds is None or buckets is None or total is None:
            for v in values:
                histogram.observe(v)
            return
        counts: dict[int, int] = {}
        for v in values:
            i = bisect_left(bounds, v)  # the first bound >= v, as observe() picks it
            counts[i] = counts.get(i, 0) + 1
        total.inc(sum(values))
        for i, n in counts.items():
            if i < len(buckets):
                buckets[i].inc(n)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry (serve it with :data:`CONTENT_TYPE`)."""
        return generate_latest(_WithoutCreated(self.registry))

    def __repr__(self) -> str:
        get = self.registry.get_sample_value
        return (f"<Metrics submitted={get('tinyloop_requests_submitted_total')} "
                f"completed={get('tinyloop_requests_completed_total')} "
                f"queue_depth={get('tinyloop_queue_depth')} "
                f"in_flight={get('tinyloop_requests_in_flight')}>")


ENGINE_COUNTERS = ("tokens_generated", "prompt_tokens", "prefix_cache_hit_tokens",
                   "prefix_cache_queried_tokens", "requests_completed", "requests_errored", "preemptions")
"""The runtime's counters that also move per engine (``EngineSeries``), by ``Metrics`` attribute."""


class EngineSeries:
    """Per-engine series of a runtime that drives several engines, labelled ``engine="i"``:
    ``tinyloop_engine_<counter>_total`` for each of ``ENGINE_COUNTERS`` (the unlabelled
    ``tinyloop_<counter>_total`` keeps the total over every engine), and gauges of each engine's
    health, slots in use, sequences, prefix-pool entries and KV blocks."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tinyloop_engine_{name}", doc, ["engine"], registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tinyloop_engine_{name}", doc, ["engine"], registry=registry)

        self.tokens_generated = counter("tokens_generated", "Tokens generated by this engine.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached this engine.")
        self.prefix_cache_hit_tokens = counter("prefix_cache_hit_tokens",
                                               "Prompt tokens this engine served from cached KV.")
        self.prefix_cache_queried_tokens = counter("prefix_cache_queried_tokens",
                                                   "Prompt tokens looked up in this engine's prefix cache.")
        self.requests_completed = counter("requests_completed", "Requests this engine brought to DONE.")
        self.requests_errored = counter("requests_errored", "Requests that reached ERROR on this engine.")
        self.preemptions = counter("preemptions", "Sequences this engine preempted.")
        self.healthy = gauge("healthy", "1 while the engine works, 0 once it broke (it left the pool).")
        self.slots_used = gauge("slots_used", "Batch slots held by requests dispatched to this engine.")
        self.decoding = gauge("requests_decoding", "Requests whose sequence exists on this engine.")
        self.prefix_pool_size = gauge("prefix_pool_size", "Prefix-pool entries registered on this engine.")
        self.kv_blocks_used = gauge("kv_blocks_used", "KV blocks allocated in this engine's pool.")
        self.kv_blocks_total = gauge("kv_blocks_total", "KV blocks in this engine's pool.")


class _WithoutCreated(Collector):
    """``registry``'s metric families, minus their ``<name>_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            trimmed = Metric(family.name, family.documentation, family.type, family.unit)
            trimmed.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield trimmed
