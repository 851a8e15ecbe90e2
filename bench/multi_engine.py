"""Several engines under one scheduler against one engine with all the threads, on the demo model.

    python bench/multi_engine.py [--quick] [--repeat 2] [--threads 2] [--model PATH]

Two configurations, each in a fresh process (torch's thread settings are per worker thread,
fixed when a thread first runs an op), run alternately ``--repeat`` times:

- ``1 engine x T threads``: one engine, ``max_batch_size`` 16, ``torch.set_num_threads(T)``;
- ``N engines x 1 thread``: ``Engine.replica`` shares the weights, ``max_batch_size`` 16/N each
  (the same 16 slots in all), ``torch.set_num_threads(1)``, each engine stepping in its own
  worker thread;
- the same placed round robin over the engines with room (a plain balancer): the control that
  shows what prefix affinity is worth.

Two workloads through the in-process runtime (``open_runtime``, no HTTP):

- ``streams``: 16 concurrent requests, distinct 16-token prompts, 64 tokens each (greedy, EOS
  ignored): aggregate tokens/s from the first submit to the last result;
- ``chat``: 4 conversations x 8 turns, run at once, each turn's prompt the previous prompt, its
  answer and a new 24-token message (greedy, 16 tokens per answer): the prefix-cache hit rate
  (``tinyloop_prefix_cache_hit_tokens_total`` / ``..._queried_tokens_total``), which shows
  whether the dispatcher kept each conversation on the engine holding its KV. The 4 conversations
  run at once, each turn after the previous answer.

The table gives each configuration's median over the repeats; the last lines the ratios that
issue 17 asks for (aggregate tokens/s side by side; hit rate with N engines >= 90% of one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "tinyloop" / "data" / "demo.tinyloop"
SLOTS = 16


def child(model: str, engines: int, threads: int, affinity: int, streams: int, tokens: int,
          turns: int) -> dict[str, float]:
    """One configuration, measured in this process."""
    import torch
    import trio

    from tinyloop.actors.runtime import open_runtime
    from tinyloop.engine.engine import Engine
    from tinyloop.policy.placement import Room
    from tinyloop.requests import GenerationRequest, SamplingParams
    from tinyloop.settings import Settings

    torch.set_num_threads(threads)
    first = Engine.load(model, max_seq_len=2048)
    pool = [first] + [first.replica() for _ in range(engines - 1)]
    settings = Settings(max_batch_size=SLOTS // engines, max_queue_depth=1024, kv_block_size=16)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = first.config.vocab_size

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(10, vocab, (n,), generator=gen).tolist())

    out: dict[str, float] = {}

    async def main() -> None:
        async with open_runtime(pool, settings) as rt:
            if not affinity:  # the control: round robin over the engines with room, as a plain balancer
                turn = iter(range(10**9))

                def round_robin(prompt: object, salt: object, rooms: list[Room], *args: object,
                                **kwargs: object) -> int:
                    return rooms[next(turn) % len(rooms)].engine

                rt._dispatcher.placement.choose = round_robin  # type: ignore[method-assign]
            async with trio.open_nursery() as warm:  # every engine runs every batch shape once
                for _ in range(streams):
                    warm.start_soon(rt.submit, GenerationRequest(prompt_tokens=prompt(16), max_tokens=4,
                                                                 sampling=greedy))
            requests = [GenerationRequest(prompt_tokens=prompt(16), max_tokens=tokens, sampling=greedy)
                        for _ in range(streams)]
            counts: list[int] = []

            async def one(r: GenerationRequest) -> None:
                counts.append((await rt.submit(r)).completion_tokens)

            start = time.perf_counter()
            async with trio.open_nursery() as n:
                for r in requests:
                    n.start_soon(one, r)
            wall = time.perf_counter() - start
            assert counts == [tokens] * streams, counts
            out["streams_tok_s"] = sum(counts) / wall

            registry = rt.metrics.registry

            def sample(name: str) -> float:
                return registry.get_sample_value(name) or 0.0

            hit0 = sample("tinyloop_prefix_cache_hit_tokens_total")
            query0 = sample("tinyloop_prefix_cache_queried_tokens_total")

            async def conversation() -> None:
                history = prompt(24)
                for _ in range(turns):
                    r = await rt.submit(GenerationRequest(prompt_tokens=history, max_tokens=16, sampling=greedy))
                    history = history + tuple(r.tokens) + prompt(24)

            start = time.perf_counter()
            async with trio.open_nursery() as n:
                for _ in range(4):
                    n.start_soon(conversation)
            out["chat_s"] = time.perf_counter() - start
            hits = sample("tinyloop_prefix_cache_hit_tokens_total") - hit0
            queried = sample("tinyloop_prefix_cache_queried_tokens_total") - query0
            out["hit_rate"] = hits / queried if queried else 0.0

    trio.run(main)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="threads of the one-engine configuration")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and turns (a smoke run)")
    ap.add_argument("--child", nargs=3, type=int, metavar=("ENGINES", "THREADS", "AFFINITY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    streams, tokens, turns = (16, 16, 3) if args.quick else (16, 64, 8)
    if args.child:
        print(json.dumps(child(args.model, *args.child, streams, tokens, turns)))
        return
    configs = [(1, args.threads, 1), (args.engines, 1, 1), (args.engines, 1, 0)]
    runs: dict[tuple[int, int, int], list[dict[str, float]]] = {c: [] for c in configs}
    for _ in range(args.repeat):
        for engines, threads, affinity in configs:
            argv = [sys.executable, __file__, "--model", args.model, "--child", str(engines), str(threads),
                    str(affinity)]
            if args.quick:
                argv.append("--quick")
            done = subprocess.run(argv, check=True, capture_output=True, text=True)
            runs[(engines, threads, affinity)].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"model {args.model}; {streams} streams x {tokens} tokens; chat: 4 conversations x {turns} turns; "
          f"{SLOTS} slots in all; median of {args.repeat} alternating runs, each in a fresh process")
    print(f"{'configuration':<38} {'streams tok/s':>13} {'chat s':>7} {'prefix hit rate':>15}")
    med: dict[tuple[int, int, int], dict[str, float]] = {}
    for (engines, threads, affinity), rs in runs.items():
        m = med[(engines, threads, affinity)] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        name = (f"{engines} engine{'s' if engines > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
                + ("" if affinity else ", round robin"))
        print(f"{name:<38} {m['streams_tok_s']:>13.1f} {m['chat_s']:>7.2f} {m['hit_rate']:>15.1%}")
    one, many = med[configs[0]], med[configs[1]]
    print(f"\n{args.engines} engines / 1 engine: streams tokens/s {many['streams_tok_s'] / one['streams_tok_s']:.2f}x; "
          f"prefix hit rate {many['hit_rate'] / one['hit_rate']:.0%} of one engine's (target >= 90%)")


if __name__ == "__main__":
    main()
