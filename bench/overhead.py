"""Runtime overhead with a zero-latency FakeEngine, against the stack's own ceiling, one table.

    python bench/overhead.py [--quick] [--concurrency 16] [--requests 4000] [--seconds 5]
                             [--sse-tokens 2000] [--sse-streams 3] [--no-pin]

The engine does no work (``FakeEngine(latency_ms=0, token_latency_ms=0)``), so every number is
the cost of the runtime and the HTTP stack. Rows:

- ``actors in-process``: ``rt.submit`` of a one-token request from ``--concurrency`` Trio
  tasks in this process (admission in the caller's task -> queue -> dispatcher -> engine actor
  -> caller);
- ``HTTP /generate``: the full server (``serve_http``: runtime + QuartTrio app + hypercorn's
  trio worker) in a child process, driven over loopback by an httpx client with a pool of
  ``--concurrency`` connections and as many Trio tasks, one-token non-streaming requests;
- ``bare QuartTrio``: a QuartTrio app on the same hypercorn config whose POST /generate returns
  a constant JSON, driven by the same client: the ceiling of the stack (STACK-NOTES.md).

The HTTP ratio (ours / bare) is the share of the stack's ceiling the runtime keeps. The client
is Python too and may itself be the bottleneck on 2 cores, so the table also gives the server
process's CPU time per request (from /proc), which does not depend on the client's speed.
Server and client are pinned to different cores when there are at least two (``--no-pin``).

SSE rows: one connection streams ``--sse-tokens`` events: ours is ``/generate`` with
``stream: true`` (FakeEngine emitting as fast as it can, one SSE event per token), the bare app
yields the same number of constant events. ``wrk`` is not used: a Lua script would be needed
for POST bodies and it is rarely installed; the Python client and the CPU-per-request column
make the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial

import httpx
import trio

CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the servers (child process: python bench/overhead.py --serve fake|bare) -------------------
def _fake_model():  # type: ignore[no-untyped-def]
    from tinyloop.http.service import ServedModel
    from tinyloop.tokenizer import default_tokenizer

    tok = default_tokenizer()
    return ServedModel(id="fake", tokenizer=tok, chat_template=tok.chat_template, max_seq_len=8192,
                       default_loops=8, max_loops=64, vocab_size=tok.vocab_size)


def _settings(batch: int):  # type: ignore[no-untyped-def]
    from tinyloop.settings import Settings

    return Settings(port=0, max_batch_size=batch, max_queue_depth=100_000, max_seq_len=8192)


async def _serve_fake(sse_tokens: int, batch: int) -> None:
    from tinyloop.actors.runtime import open_runtime
    from tinyloop.http.serve import serve_http
    from tinyloop.testing import FakeEngine

    engine = FakeEngine(latency_ms=0, token_latency_ms=0, stream_tokens=list(range(1, sse_tokens + 1)),
                        max_seq_len=8192)
    settings = _settings(batch)
    async with trio.open_nursery() as nursery, open_runtime(engine, settings) as rt:
        binds = await nursery.start(partial(serve_http, rt, _fake_model(), settings))
        print(binds[0], flush=True)
        await trio.sleep_forever()


def bare_app(sse_tokens: int):  # type: ignore[no-untyped-def]
    from quart import Response, jsonify
    from quart_trio import QuartTrio

    app = QuartTrio("bare")
    app.config["RESPONSE_TIMEOUT"] = None
    body = {"id": "gen-0", "text": "<1>", "tokens": [1], "finish_reason": "length"}
    event = b"data: " + json.dumps({"token_id": 1, "text": "<1>", "index": 0, "loops": 8}).encode() + b"\n\n"

    @app.post("/generate")
    async def generate():  # type: ignore[no-untyped-def]
        from quart import request

        data = await request.get_json(force=True)
        if data.get("stream"):
            async def events():  # type: ignore[no-untyped-def]
                for _ in range(sse_tokens):
                    yield event
                yield b"data: [DONE]\n\n"
            return Response(events(), content_type="text/event-stream")
        return jsonify(body)

    return app


async def _serve_bare(sse_tokens: int) -> None:
    import hypercorn.trio

    from tinyloop.http.serve import hypercorn_config

    config = hypercorn_config(_settings(16))
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, bare_app(sse_tokens), config))
        print(binds[0], flush=True)


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def start_server(kind: str, args: argparse.Namespace, core: int | None) -> Server:
    cmd = [sys.executable, __file__, "--serve", kind, "--sse-tokens", str(args.sse_tokens),
           "--batch", str(args.batch)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if core is not None else None)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        proc.kill()
        raise SystemExit(f"{kind} server did not start (got {url!r})")
    return Server(proc, url)


# -- measuring -----------------------------------------------------------------------------------
@dataclass
class Row:
    label: str
    n: int
    seconds: float
    latencies: list[float]
    cpu_s: float | None = None  # server CPU seconds over the run
    client_cpu_s: float | None = None  # this (client) process's CPU seconds, HTTP rows

    @property
    def rate(self) -> float:
        return self.n / self.seconds

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def closed_loop(call, concurrency: int, total: int, seconds: float) -> tuple[int, float, list[float]]:  # type: ignore[no-untyped-def]
    """``concurrency`` tasks calling ``call()`` back to back until ``total`` calls or ``seconds``."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    left = [total]

    async def worker() -> None:
        while left[0] > 0 and time.perf_counter() < deadline:
            left[0] -= 1
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return len(latencies), time.perf_counter() - start, latencies


async def in_process(args: argparse.Namespace) -> Row:
    from tinyloop.actors.runtime import open_runtime
    from tinyloop.requests import GenerationRequest
    from tinyloop.testing import FakeEngine

    engine = FakeEngine(latency_ms=0, token_latency_ms=0, stream_tokens=[1])
    async with open_runtime(engine, _settings(args.batch)) as rt:
        async def call() -> None:
            await rt.submit(GenerationRequest(prompt_tokens=(1,), max_tokens=1))

        await closed_loop(call, args.concurrency, args.warmup, 60)
        cpu0 = time.process_time()
        n, secs, lat = await closed_loop(call, args.concurrency, args.requests, args.seconds)
        cpu = time.process_time() - cpu0
    return Row("actors in-process (rt.submit)", n, secs, lat, cpu)


async def http_requests(label: str, server: Server, args: argparse.Namespace) -> Row:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    body = {"prompt_tokens": [1], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
        async def call() -> None:
            r = await client.post("/generate", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{label}: HTTP {r.status_code} {r.text[:200]}")

        await closed_loop(call, args.concurrency, args.warmup, 60)
        cpu0, client0 = server.cpu_s(), time.process_time()
        n, secs, lat = await closed_loop(call, args.concurrency, args.requests, args.seconds)
        cpu, client = server.cpu_s() - cpu0, time.process_time() - client0
    return Row(label, n, secs, lat, cpu, client)


async def sse_stream(label: str, server: Server, args: argparse.Namespace) -> Row:
    """Events/s on one connection; the best of ``--sse-streams`` streams (latencies: gaps)."""
    body = {"prompt_tokens": [1], "max_tokens": args.sse_tokens, "stream": True, "ignore_eos": True}
    best: Row | None = None
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        for _ in range(args.sse_streams):
            events, gaps = 0, []
            cpu0, client0 = server.cpu_s(), time.process_time()
            start = last = time.perf_counter()
            async with client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{label}: HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"done"' not in line:
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now
                        events += 1
            row = Row(label, events, time.perf_counter() - start, gaps, server.cpu_s() - cpu0,
                      time.process_time() - client0)
            if events != args.sse_tokens:
                raise RuntimeError(f"{label}: {events} events, expected {args.sse_tokens}")
            if best is None or row.rate > best.rate:
                best = row
    assert best is not None
    return best


def print_table(title: str, unit: str, rows: list[Row], base: Row | None, cpu_unit: str) -> None:
    print(f"\n{title}")
    print(f"{'path':<34} {unit:>10} {'p50 ms':>8} {'p99 ms':>8} {cpu_unit:>16} {'client CPU us':>13} "
          f"{'vs bare':>8}")
    for r in rows:
        cpu = f"{r.cpu_s / r.n * 1e6:>16.0f}" if r.cpu_s is not None and r.n else f"{'-':>16}"
        cpu += f" {r.client_cpu_s / r.n * 1e6:>13.0f}" if r.client_cpu_s is not None and r.n else f" {'-':>13}"
        versus_bare = base is not None and r is not base and "HTTP" in r.label
        ratio = f"{r.rate / base.rate:>8.0%}" if versus_bare else f"{'':>8}"
        print(f"{r.label:<34} {r.rate:>10,.0f} {r.pct(0.5):>8.2f} {r.pct(0.99):>8.2f} {cpu} {ratio}")


async def run(args: argparse.Namespace) -> None:
    cores = sorted(os.sched_getaffinity(0))
    server_core = cores[0] if args.pin and len(cores) >= 2 else None
    if server_core is not None:
        os.sched_setaffinity(0, set(cores[1:]))
    rows = [await in_process(args)]
    sse: list[Row] = []
    for kind, label in (("fake", "HTTP /generate (serve_http)"), ("bare", "bare QuartTrio (ceiling)")):
        server = start_server(kind, args, server_core)
        try:
            rows.append(await http_requests(label, server, args))
            sse.append(await sse_stream(f"SSE {label}", server, args))
        finally:
            server.proc.kill()
            server.proc.wait()
    pin = f"server pinned to core {server_core}, client on {cores[1:]}" if server_core is not None else "not pinned"
    print(f"FakeEngine latency 0; {args.concurrency} concurrent tasks / connections, one-token requests, "
          f"max_batch_size {args.batch}; {pin}; httpx {httpx.__version__}")
    print_table("Requests (closed loop; server CPU = the server process, or the whole process in-process; "
                "client CPU near 1e6 / req/s means the client, not the server, is the bottleneck)",
                "req/s", rows, rows[-1], "server CPU us/req")
    print_table(f"SSE on one connection ({args.sse_tokens} events, best of {args.sse_streams}; "
                f"p50/p99 = gap between events)", "events/s", sse, sse[-1], "server CPU us/ev")
    print(f"\nours / bare: requests {rows[1].rate / rows[2].rate:.0%}, "
          f"server CPU per request {rows[1].cpu_s / rows[1].n / (rows[2].cpu_s / rows[2].n):.1f}x; "  # type: ignore[operator]
          f"SSE events {sse[0].rate / sse[1].rate:.0%}, "
          f"server CPU per event {sse[0].cpu_s / sse[0].n / (sse[1].cpu_s / sse[1].n):.1f}x")  # type: ignore[operator]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a second or so per row")
    ap.add_argument("--concurrency", type=int, default=16, help="client tasks (and HTTP connections)")
    ap.add_argument("--requests", type=int, default=4000, help="requests per row (stops at --seconds)")
    ap.add_argument("--seconds", type=float, default=5.0, help="time limit per row")
    ap.add_argument("--warmup", type=int, default=200, help="requests before each row is timed")
    ap.add_argument("--batch", type=int, default=16, help="max_batch_size of the runtime")
    ap.add_argument("--sse-tokens", type=int, default=2000, help="events per SSE stream")
    ap.add_argument("--sse-streams", type=int, default=3, help="SSE streams per row (best counts)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin server and client")
    ap.add_argument("--serve", choices=["fake", "bare"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        trio.run(_serve_fake if args.serve == "fake" else _serve_bare,
                 *((args.sse_tokens, args.batch) if args.serve == "fake" else (args.sse_tokens,)))
        return
    if args.quick:
        args.requests, args.seconds, args.warmup = 300, 1.0, 30
        args.sse_tokens, args.sse_streams = 500, 1
    trio.run(run, args)


if __name__ == "__main__":
    main()
