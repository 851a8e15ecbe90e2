"""Continuous batching through the HTTP server: aggregate tokens/s and inter-token latency.

    python bench/batching.py [--quick] [--preset small|tiny] [--streams 1 4 16] [--tokens 64]
                             [--prompt 16] [--threads N] [--kernel-threads N] [--batch 16]
                             [--clients process|inproc|both] [--client-http raw|httpx]
                             [--no-alone] [--repeat N]

A random model of ``--preset`` (default ``small``) behind the real server (runtime + hypercorn
in this process, 127.0.0.1:0, ``max_batch_size`` ``--batch``). For each count of concurrent
streams, that many httpx clients POST ``/generate`` with ``stream: true`` at the same time
(greedy, EOS ignored, ``--tokens`` tokens each, distinct random prompts) and record when
each token event arrives.

Where the clients run (``--clients``), as vLLM's ``benchmark_serving`` does it:

- ``process`` (the default): in a child Python process (this script with ``--client-of URL``),
  which runs the streams when the parent asks (a JSON line on its stdin) and answers with the
  timings (a JSON line on its stdout). The server's process then holds only the server, so
  the figures are the server's (on a 2-core machine the child still takes CPU from the same
  cores: ``client us/tok`` says how much). By default (``--client-http raw``, since 2026-12-01)
  the child writes each request by hand on a connection of its own and counts the token events
  as their bytes arrive without decoding their JSON, as a load generator such as ``wrk`` does:
  about 45 us of CPU a token at 16 streams against httpx's 110-145 (``--client-http httpx``,
  what the figures before that date used), which the server's engine otherwise lost;
- ``inproc``: in the server's own process and Trio loop (what this benchmark did until
  2026-11-30): the clients' parsing (about 110 us of CPU per token at 16 streams) then runs on
  the server's event-loop thread and takes the GIL in turn with the engine's worker thread, so
  the figures mix the clients' cost into the server's;
- ``both``: each count of streams with the clients in a child, then in process.

Before the server, the same streams run through the engine alone (``Engine.step`` in a loop on
the event loop's thread while the runtime idles, no HTTP; ``--no-alone`` skips it): the ceiling
for this workload. ``--repeat N`` runs N rounds, each count of streams and kind of client in
turn, and ends with each row's median round (a shared machine's load comes and goes). Columns:

- ``agg tok/s``: every stream's tokens / wall time from the first request to the last event
  (prefill included: the engine prefills each new prompt on its own, which at 16 streams is
  15-20% of the run);
- ``decode tok/s``: the sum over streams of (tokens - 1) / (last event - first event): the
  aggregate rate once the streams decode, prefill left out;
- ``ITL p50/p99``: gaps between consecutive token events of one stream, over all streams (ms);
- ``TTFT p50``: request sent to first token event (ms);
- ``batch``: tokens generated / decode steps, from the server's ``tinyloop_batch_size``
  histogram on ``/metrics`` (how full the batches were);
- ``step ms``: the engine's decode steps (no prefill in them), mean wall time in the worker
  thread; ``wait``: of that, the time the thread was not running (wall - thread CPU): waiting
  for the GIL, or for a core on a busy machine; ``gap``: median time from the end of one
  decode step to the start of the next (the worker thread waking the event loop, the engine
  actor's turn: deliver the tokens, retire, plan, and the next step waking the worker thread);
- ``loop us/tok``: CPU time of the server's event-loop thread (HTTP, actors, and with
  ``inproc`` the clients) per token; ``client us/tok``: the child client process's CPU per token.

The last lines give 16 streams (the largest count) against 1 (the smallest) in aggregate tokens/s.
On a shared machine pass ``--threads 1``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import trio


def _kernel_threads() -> int:
    from tinyloop.cpu import kernels

    return kernels.threads() if kernels.available() else 0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def batch_histogram(text: str) -> tuple[float, float]:
    """(sum, count) of the ``tinyloop_batch_size`` histogram in a Prometheus exposition."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("tinyloop_batch_size_sum"):
            total = float(line.split()[-1])
        elif line.startswith("tinyloop_batch_size_count"):
            count = float(line.split()[-1])
    return total, count


# -- the clients (in the server's process, or in a child) ---------------------------------------
async def one_stream(client: httpx.AsyncClient, prompt: list[int], n: int) -> tuple[float, list[float]]:
    """(when the request went out, when each token event arrived), perf_counter seconds."""
    body = {"prompt_tokens": prompt, "max_tokens": n, "stream": True, "ignore_eos": True,
            "temperature": 0}
    start = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if not event.get("done"):
                arrivals.append(time.perf_counter())
    return start, arrivals


async def one_stream_raw(url: str, prompt: list[int], n: int) -> tuple[float, list[float]]:
    """``one_stream`` without an HTTP client library: the request written by hand on a connection
    of its own, each token event counted when its bytes arrive, its JSON not decoded (what a load
    generator such as ``wrk`` does: on a machine of two cores the clients' CPU is the server's)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt_tokens": prompt, "max_tokens": n, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    request = (f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    start = time.perf_counter()
    arrivals: list[float] = []
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(request)
        data, head = b"", True
        while chunk := await stream.receive_some(1 << 16):
            now, data = time.perf_counter(), data + chunk
            if head:  # the status line and headers first
                if b"\r\n\r\n" not in data:
                    continue
                status, data = data.split(b"\r\n\r\n", 1)
                if not status.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"HTTP {status[:200]!r}")
                head = False
            *events, data = data.split(b"\n\n")  # whole SSE events (chunked framing between them)
            for event in events:
                at = event.find(b"data: {")
                if event.startswith(b'data: {"error"', at):
                    raise RuntimeError(event[at:at + 300].decode(errors="replace"))
                if at >= 0 and not event.startswith(b'data: {"done"', at):
                    arrivals.append(now)
    return start, arrivals


async def run_streams(client: httpx.AsyncClient | str, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Every prompt as a stream at once (through ``client``, or ``one_stream_raw`` to the URL
    ``client``); the timings as JSON-able data (see ``Run``)."""
    timings: list[tuple[float, list[float]]] = []

    async def go(p: list[int]) -> None:
        timings.append(await (one_stream_raw(client, p, tokens) if isinstance(client, str)
                              else one_stream(client, p, tokens)))

    cpu0, start = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for p in prompts:
            nursery.start_soon(go, p)
    return {"start": start, "end": time.perf_counter(), "cpu_s": time.process_time() - cpu0,
            "streams": [[s - start, [t - start for t in ts]] for s, ts in timings]}


async def client_main(url: str, connections: int, raw: bool) -> None:
    """The child: one JSON command a line on stdin (``{"prompts": [...], "tokens": n}``), one
    JSON answer a line on stdout (``run_streams``'s), until stdin ends; ``raw``: each stream
    through ``one_stream_raw``, else httpx."""
    limits = httpx.Limits(max_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            out = await run_streams(url if raw else client, cmd["prompts"], cmd["tokens"])
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()


class ChildClients:
    """The parent's side of the child client process."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.buffer = b""

    async def run(self, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        await self.process.stdin.send_all(json.dumps({"prompts": prompts, "tokens": tokens}).encode() + b"\n")
        while b"\n" not in self.buffer:
            data = await self.process.stdout.receive_some()
            if not data:
                raise RuntimeError("the client process ended without an answer")
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        out: dict[str, Any] = json.loads(line)
        return out


# -- measuring ------------------------------------------------------------------------------------
@dataclass
class StepClock:
    """Wraps an engine's ``step``: wall and thread CPU seconds of every step without prefill,
    and the gaps between two such steps in a row (the event loop's turn between them)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    last_end: float | None = None  # when the last decode step ended

    def wrap(self, engine: Any) -> None:
        inner: Callable[[Any], Any] = engine.step

        def step(seqs: Any) -> Any:
            decode = not any(s.prefilling for s in seqs)
            w, c = time.perf_counter(), time.thread_time()
            if decode and self.last_end is not None:
                self.gaps.append(w - self.last_end)
            try:
                return inner(seqs)
            finally:
                self.last_end = time.perf_counter() if decode else None
                if decode:
                    self.wall.append(self.last_end - w)
                    self.cpu.append(time.thread_time() - c)

        engine.step = step

    def take(self) -> tuple[float, float, float]:
        """(mean step ms, mean wait ms, median gap ms) since the last take."""
        wall, cpu, gaps = self.wall, self.cpu, self.gaps
        self.wall, self.cpu, self.gaps, self.last_end = [], [], [], None
        if not wall:
            return float("nan"), float("nan"), float("nan")
        return (statistics.mean(wall) * 1000, (statistics.mean(wall) - statistics.mean(cpu)) * 1000,
                statistics.median(gaps) * 1000 if gaps else float("nan"))


@dataclass
class Row:
    label: str
    streams: int
    tokens: int  # every stream's tokens
    wall: float
    decode_rate: float
    gaps: list[float]
    ttfts: list[float]
    mean_batch: float = float("nan")
    step_ms: float = float("nan")
    wait_ms: float = float("nan")
    gap_ms: float = float("nan")
    loop_us: float = float("nan")
    client_us: float = float("nan")

    @property
    def agg(self) -> float:
        return self.tokens / self.wall

    HEADER = (f"{'streams':>7} {'clients':>8} {'agg tok/s':>9} {'decode tok/s':>12} {'ITL p50':>7} "
              f"{'ITL p99':>7} {'TTFT p50':>8} {'batch':>5} {'step ms':>7} {'wait':>5} {'gap':>5} "
              f"{'loop us/tok':>11} {'client us/tok':>13}")

    def line(self) -> str:
        return (f"{self.streams:>7} {self.label:>8} {self.agg:>9.1f} {self.decode_rate:>12.1f} "
                f"{pct(self.gaps, 0.5):>7.1f} {pct(self.gaps, 0.99):>7.1f} "
                f"{statistics.median(self.ttfts) * 1000:>8.1f} {self.mean_batch:>5.1f} {self.step_ms:>7.1f} "
                f"{self.wait_ms:>5.1f} {self.gap_ms:>5.2f} {_us(self.loop_us):>11} {_us(self.client_us):>13}")


def _us(x: float) -> str:
    """Microseconds, or ``-`` where the row has none (the engine alone; clients in process)."""
    return "-" if math.isnan(x) else f"{x:.0f}"


def row_of(label: str, timings: dict[str, Any], expected: int) -> Row:
    """A row from ``run_streams``'s answer (times relative to its start)."""
    gaps: list[float] = []
    ttfts: list[float] = []
    decode = 0.0
    for sent, arrivals in timings["streams"]:
        assert len(arrivals) == expected, (len(arrivals), expected)
        ttfts.append(arrivals[0] - sent)
        gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
        if len(arrivals) > 1:
            decode += (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    n = len(timings["streams"])
    return Row(label, n, n * expected, timings["end"] - timings["start"], decode, gaps, ttfts)


def engine_alone(engine: Any, prompts: list[list[int]], tokens: int, clock: StepClock) -> Row:
    """The same streams through ``Engine.step`` in a loop on this thread: the ceiling."""
    from tinyloop.requests import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True)
    seqs = [engine.start(GenerationRequest(tuple(p), max_tokens=tokens, sampling=params)) for p in prompts]
    start = time.perf_counter()
    ends: list[float] = []
    while live := [s for s in seqs if not s.finished]:
        engine.step(live)
        ends.append(time.perf_counter() - start)
    for s in seqs:
        engine.free(s)
    steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    row = Row("alone", len(prompts), len(prompts) * tokens, ends[-1],
              len(prompts) * (tokens - 1) / (ends[-1] - ends[0]), steps * len(prompts), [ends[0]])
    row.mean_batch = float(len(prompts))
    row.step_ms, row.wait_ms, row.gap_ms = clock.take()
    return row


async def measure(label: str, runner: Callable[..., Any], client: httpx.AsyncClient, clock: StepClock,
                  prompts: list[list[int]], tokens: int) -> Row:
    """One count of streams through the server, the clients run by ``runner``."""
    before = batch_histogram((await client.get("/metrics")).text)
    clock.take()
    loop_cpu = time.thread_time()
    timings = await runner(prompts, tokens)
    loop_cpu = time.thread_time() - loop_cpu
    after = batch_histogram((await client.get("/metrics")).text)
    row = row_of(label, timings, tokens)
    steps = after[1] - before[1]
    row.mean_batch = (after[0] - before[0]) / steps if steps else float("nan")
    row.step_ms, row.wait_ms, row.gap_ms = clock.take()
    row.loop_us = loop_cpu / row.tokens * 1e6
    if label == "process":
        row.client_us = timings["cpu_s"] / row.tokens * 1e6
    return row


async def run(args: argparse.Namespace) -> None:
    import torch

    from tinyloop.actors.runtime import open_runtime
    from tinyloop.engine.engine import Engine
    from tinyloop.http.serve import serve_http
    from tinyloop.http.service import ServedModel
    from tinyloop.model.presets import PRESETS, init_model
    from tinyloop.settings import Settings
    from tinyloop.tokenizer import default_tokenizer

    config = PRESETS[args.preset]
    max_len = args.prompt + args.tokens + 8
    model = init_model(config, seed=0)
    engine = Engine(model, default_tokenizer(), max_seq_len=max_len, prefix_caching=False,
                    kv_cache_mb=args.kv_cache_mb, name=args.preset, cpu_kernels=args.cpu_kernels)
    clock = StepClock()
    clock.wrap(engine)
    settings = Settings(port=0, max_batch_size=args.batch, max_queue_depth=1024, max_seq_len=max_len)
    served = ServedModel.from_engine(engine, settings)
    gen = torch.Generator().manual_seed(0)
    labels = ["process", "inproc"] if args.clients == "both" else [args.clients]
    most = max(args.streams)
    print(f"{args.preset} (random init): {config.n_prelude}+{config.n_core}x{config.default_loops}+"
          f"{config.n_coda} layers, hidden {config.hidden}; prompt {args.prompt}, {args.tokens} tokens "
          f"per stream, greedy; max_batch_size {args.batch}; torch threads {torch.get_num_threads()}; "
          f"kernel threads {_kernel_threads()}; "
          f"clients {args.clients}; decode attention {engine.model.backend.name}")

    def prompts_for(n: int) -> list[list[int]]:
        out: list[list[int]] = torch.randint(0, config.vocab_size, (n, args.prompt), generator=gen).tolist()
        return out

    if args.alone:
        engine_alone(engine, prompts_for(most), 4, clock)  # warm-up: every batch shape
        clock.take()
    print(Row.HEADER)
    rows: list[Row] = []
    async with trio.open_nursery() as nursery, open_runtime(engine, settings) as rt:
        binds = await nursery.start(partial(serve_http, rt, served, settings))
        limits = httpx.Limits(max_connections=most + 2)
        argv = [sys.executable, __file__, "--client-of", binds[0], "--connections", str(most + 2),
                "--client-http", args.client_http]
        proc = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            async with httpx.AsyncClient(base_url=binds[0], limits=limits, timeout=600) as client:
                runners = {"process": ChildClients(proc).run, "inproc": partial(run_streams, client)}
                for label in labels:  # warm-up: open every connection, run every batch shape once
                    await runners[label](prompts_for(most), 4)
                for _ in range(args.repeat):  # each round: every count, each kind of client in turn
                    for streams in args.streams:
                        if args.alone:  # the runtime is idle: the engine is this thread's meanwhile
                            rows.append(engine_alone(engine, prompts_for(streams), args.tokens, clock))
                            print(rows[-1].line())
                        for label in labels:
                            rows.append(await measure(label, runners[label], client, clock,
                                                      prompts_for(streams), args.tokens))
                            print(rows[-1].line())
        finally:
            assert proc.stdin is not None
            await proc.stdin.aclose()
            await proc.wait()
        nursery.cancel_scope.cancel()
    if args.repeat > 1:
        rows = medians(rows)
        print(f"median of {args.repeat} rounds (the round with the median agg tok/s):")
        print(Row.HEADER)
        for row in rows:
            print(row.line())
    print(ratios(rows, min(args.streams), most))


def medians(rows: list[Row]) -> list[Row]:
    """For each count of streams and kind of client, the row with the median aggregate rate."""
    groups: dict[tuple[int, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.streams, r.label), []).append(r)
    return [sorted(g, key=lambda r: r.agg)[len(g) // 2] for g in groups.values()]


def ratios(rows: list[Row], few: int, most: int) -> str:
    """``most`` streams against ``few`` in aggregate tokens/s, for each kind of client."""
    parts = []
    for label in dict.fromkeys(r.label for r in rows):
        by = {r.streams: r for r in rows if r.label == label}
        if few in by and most in by and few != most:
            parts.append(f"{label} {by[most].agg / by[few].agg:.2f}x")
    return f"{most} streams / {few}, agg tok/s: " + ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny preset, 8 tokens")
    ap.add_argument("--preset", choices=["tiny", "small"], default="small")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per stream")
    ap.add_argument("--batch", type=int, default=16, help="max_batch_size")
    ap.add_argument("--kv-cache-mb", type=float, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--kernel-threads", type=int, default=None,
                    help="threads of the C kernels (default: the server's, TINYLOOP_KERNEL_THREADS)")
    ap.add_argument("--clients", choices=["process", "inproc", "both"], default="process",
                    help="where the HTTP clients run (the module docstring)")
    ap.add_argument("--client-http", choices=["raw", "httpx"], default="raw",
                    help="the child process's HTTP client: raw (the request by hand, events counted "
                         "unparsed) or httpx (each event's JSON decoded)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds (interleaved); the summary takes each row's median round")
    ap.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                    help="decode attention on torch ops, not the C kernel (TINYLOOP_CPU_KERNELS=0)")
    ap.add_argument("--no-alone", dest="alone", action="store_false",
                    help="skip the engine-alone rows")
    ap.add_argument("--client-of", metavar="URL", help=argparse.SUPPRESS)  # the child's role
    ap.add_argument("--connections", type=int, default=18, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client_of:
        trio.run(client_main, args.client_of, args.connections, args.client_http == "raw")
        return
    if args.quick:
        args.preset, args.tokens = "tiny", 8
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.cpu_kernels:
        from tinyloop.cpu import kernels
        from tinyloop.settings import Settings

        if kernels.available():
            kernels.set_threads(Settings(kernel_threads=args.kernel_threads).cpu_kernel_threads)
    t0 = time.perf_counter()
    trio.run(run, args)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
