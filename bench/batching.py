"""Continuous batching through the HTTP server: aggregate tokens/s and inter-token latency.

    python bench/batching.py [--quick] [--preset small|tiny] [--streams 1 4 16] [--tokens 64]
                             [--prompt 16] [--threads N] [--batch 16]

A random model of ``--preset`` (default ``small``) behind the real server (runtime + hypercorn
in this process, 127.0.0.1:0, ``max_batch_size`` ``--batch``). For each count of concurrent
streams, that many httpx clients POST ``/generate`` with ``stream: true`` at the same time
(greedy, EOS ignored, ``--tokens`` tokens each, distinct random prompts) and record when
each token event arrives. Columns:

- ``agg tok/s``: every stream's tokens / wall time from the first request to the last event;
- ``ITL p50/p99``: gaps between consecutive token events of one stream, over all streams (ms);
- ``TTFT p50``: request sent to first token event (ms);
- ``mean batch``: tokens generated / decode steps, from the server's ``tinyloop_batch_size``
  histogram on ``/metrics`` (how full the batches were).

The client runs in the server's process (one Trio loop), so its parsing cost is included;
it is small next to a model step. On a shared machine pass ``--threads 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402

from tinyloop.actors.runtime import open_runtime  # noqa: E402
from tinyloop.engine.engine import Engine  # noqa: E402
from tinyloop.http.serve import serve_http  # noqa: E402
from tinyloop.http.service import ServedModel  # noqa: E402
from tinyloop.model.presets import PRESETS, init_model  # noqa: E402
from tinyloop.settings import Settings  # noqa: E402
from tinyloop.tokenizer import default_tokenizer  # noqa: E402


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


async def one_stream(client: httpx.AsyncClient, prompt: list[int], n: int, gaps: list[float],
                     ttfts: list[float]) -> int:
    body = {"prompt_tokens": prompt, "max_tokens": n, "stream": True, "ignore_eos": True,
            "temperature": 0}
    start = time.perf_counter()
    last: float | None = None
    tokens = 0
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("done"):
                continue
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - start)
            else:
                gaps.append(now - last)
            last = now
            tokens += 1
    return tokens


async def run(args: argparse.Namespace) -> None:
    config = PRESETS[args.preset]
    max_len = args.prompt + args.tokens + 8
    model = init_model(config, seed=0)
    engine = Engine(model, default_tokenizer(), max_seq_len=max_len, prefix_caching=False,
                    kv_cache_mb=args.kv_cache_mb, name=args.preset)
    settings = Settings(port=0, max_batch_size=args.batch, max_queue_depth=1024, max_seq_len=max_len)
    served = ServedModel.from_engine(engine, settings)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.preset} (random init): {config.n_prelude}+{config.n_core}x{config.default_loops}+"
          f"{config.n_coda} layers, hidden {config.hidden}; prompt {args.prompt}, {args.tokens} tokens "
          f"per stream, greedy; max_batch_size {args.batch}; torch threads {torch.get_num_threads()}")
    print(f"{'streams':>7} {'agg tok/s':>9} {'per-stream tok/s':>16} {'ITL p50 ms':>10} "
          f"{'ITL p99 ms':>10} {'TTFT p50 ms':>11} {'mean batch':>10}")
    async with trio.open_nursery() as nursery, open_runtime(engine, settings) as rt:
        binds = await nursery.start(partial(serve_http, rt, served, settings))
        limits = httpx.Limits(max_connections=max(args.streams) + 2)
        async with httpx.AsyncClient(base_url=binds[0], limits=limits, timeout=600) as client:
            # Warm-up: open every connection and run every batch shape once.
            async with trio.open_nursery() as warm:
                for p in torch.randint(0, config.vocab_size, (max(args.streams), args.prompt),
                                       generator=gen).tolist():
                    warm.start_soon(one_stream, client, p, 4, [], [])
            for streams in args.streams:
                prompts = torch.randint(0, config.vocab_size, (streams, args.prompt), generator=gen).tolist()
                gaps: list[float] = []
                ttfts: list[float] = []
                counts: list[int] = []
                before = batch_histogram((await client.get("/metrics")).text)
                start = time.perf_counter()

                async def go(p: list[int], counts: list[int] = counts, gaps: list[float] = gaps,
                             ttfts: list[float] = ttfts) -> None:
                    counts.append(await one_stream(client, p, args.tokens, gaps, ttfts))

                async with trio.open_nursery() as clients:
                    for p in prompts:
                        clients.start_soon(go, p)
                wall = time.perf_counter() - start
                after = batch_histogram((await client.get("/metrics")).text)
                assert counts == [args.tokens] * streams, counts
                steps = after[1] - before[1]
                mean_batch = (after[0] - before[0]) / steps if steps else float("nan")
                agg = sum(counts) / wall
                print(f"{streams:>7} {agg:>9.1f} {agg / streams:>16.1f} {pct(gaps, 0.5):>10.1f} "
                      f"{pct(gaps, 0.99):>10.1f} {statistics.median(ttfts) * 1000:>11.1f} {mean_batch:>10.1f}")
        nursery.cancel_scope.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny preset, 8 tokens")
    ap.add_argument("--preset", choices=["tiny", "small"], default="small")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per stream")
    ap.add_argument("--batch", type=int, default=16, help="max_batch_size")
    ap.add_argument("--kv-cache-mb", type=float, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.tokens = "tiny", 8
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    trio.run(run, args)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
