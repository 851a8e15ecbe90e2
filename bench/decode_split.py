"""Where a decode step's CPU time goes: the matrix products against everything else, per layer.

    python bench/decode_split.py [--model PATH | --preset small] [--batches 1 16] [--rounds 3]

In one process, the engine decodes greedily at each batch size (``--prompt`` tokens each, KV
for 256 positions) and times steps by the thread's CPU time (less disturbed by other processes
on a shared machine than the wall clock). It runs every step twice over: once as it is, once
with every product (``PackedWeight.linear``) swapped for a cached zero tensor of the right
shape, so what is left is the engine's work outside the products (norms, RoPE, KV writes and
reads, attention, sampling, bookkeeping). Rounds alternate the two and the batch sizes; each
cell is the median over rounds of the median step. ``layers`` counts layer applications per
token (prelude + loops x core + coda). Torch runs on one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from tinyloop.engine.engine import Engine
from tinyloop.model import cpu_linear
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer


def step_ms(engine: Engine, batch: int, prompt: int, steps: int) -> float:
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    seqs = [engine.start(GenerationRequest(prompt_tokens=tuple(range(5, 5 + prompt)), max_tokens=steps + 4,
                                           sampling=greedy)) for _ in range(batch)]
    engine.step(seqs)
    engine.step(seqs)
    times = []
    for _ in range(steps):
        t = time.thread_time()
        engine.step(seqs)
        times.append(time.thread_time() - t)
    for s in seqs:
        engine.free(s)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .tinyloop artifact (default: the random --preset)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per cell and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.model:
        engine = Engine.load(args.model, max_seq_len=256)
    else:
        engine = Engine(init_model(PRESETS[args.preset], seed=0), default_tokenizer(), max_seq_len=256,
                        prefix_caching=False, kv_cache_mb=256)
    c = engine.config
    layers = c.n_prelude + c.default_loops * c.n_core + c.n_coda
    real = cpu_linear.PackedWeight.linear
    zeros: dict[tuple[Any, ...], torch.Tensor] = {}

    def constant(self: cpu_linear.PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        key = (*x.shape[:-1], self.weight.shape[0])
        if key not in zeros:
            zeros[key] = torch.zeros(key)
        return zeros[key]

    cells: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for kind, linear in (("step", real), ("outside", constant)):
            cpu_linear.PackedWeight.linear = linear  # type: ignore[method-assign]
            for b in args.batches:
                cells.setdefault((kind, b), []).append(step_ms(engine, b, args.prompt, args.steps))
    cpu_linear.PackedWeight.linear = real  # type: ignore[method-assign]
    med = {k: statistics.median(v) for k, v in cells.items()}
    print(f"{args.model or args.preset}: {layers} layers per token, hidden {c.hidden}; CPU ms per decode step, "
          f"median of {args.rounds} rounds; torch threads 1")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>7} {'products ms':>11} {'outside ms':>10} {'outside us/layer':>16}")
    for b in args.batches:
        step, outside = med[("step", b)], med[("outside", b)]
        print(f"{b:>5} {step:>8.2f} {b * 1000 / step:>7.1f} {step - outside:>11.2f} {outside:>10.2f} "
              f"{outside * 1000 / layers:>16.0f}")
    if len(args.batches) > 1:
        lo, hi = args.batches[0], args.batches[-1]
        step_lo, step_hi = med[("step", lo)], med[("step", hi)]
        out_lo, out_hi = med[("outside", lo)], med[("outside", hi)]
        print(f"batch {hi} against batch {lo}: {hi * step_lo / (lo * step_hi):.2f}x the tokens/s (products "
              f"{step_hi - out_hi:.2f} / {step_lo - out_lo:.2f} ms, outside {out_hi:.2f} / {out_lo:.2f} ms)")


if __name__ == "__main__":
    main()
