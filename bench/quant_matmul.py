"""The quantised products (tinyloop/cpu/qmatmul.c) streaming a decode step's weights, per path.

    python bench/quant_matmul.py [--preset base100m] [--rows 1 8] [--threads 1 2] [--rounds 7]
                                 [--modes int8 int4 bf16] [--paths avx512vnni avx2 portable]

Every linear weight of one pass through ``--preset``'s layers (prelude, core once, coda: q/k/v,
o, gate/up, down per block, the loop adapter) and its LM head, each a ``quant.QuantWeight`` of
the mode with its panels (int8 grouped as the engine quantises it, ``quant.int8_group``),
multiplied once in sequence by ``--rows`` rows: what a decode step reads (about 100 MB of int8
for ``base100m``, past this machine's caches). Per mode, path (``kernels.set_quant_isa``; bf16
runs AVX-512 BF16 on the ``avx512vnni`` path where the CPU has it), thread count
(``kernels.set_threads``) and row count: milliseconds for the pass (the median of ``--rounds``
rounds; in each round every configuration runs once, so a slow spell of a shared machine hits
all) and the GB/s of panel bytes read, set against the machine's copy bandwidth (read + write)
measured in the same run. The paths this CPU's build lacks are skipped.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from engine_vs_hf import copy_bandwidth

from tinyloop.cpu import kernels
from tinyloop.model.presets import PRESETS
from tinyloop.model.quant import QuantWeight, int8_group


def weight_shapes(preset: str) -> list[tuple[int, int]]:
    c = PRESETS[preset]
    block = [((c.heads + 2 * c.kv_heads) * c.head_dim, c.hidden), (c.hidden, c.heads * c.head_dim),
             (2 * c.intermediate, c.hidden), (c.hidden, c.intermediate)]
    adapter = [(c.hidden, 2 * c.hidden)] if c.injection == "concat_linear" else []
    return block * (c.n_prelude + c.n_core + c.n_coda) + adapter + [(c.vocab_size, c.hidden)]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="base100m", choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--modes", nargs="+", default=["int8", "int4", "bf16"], choices=["int8", "int4", "bf16"])
    ap.add_argument("--paths", nargs="+", default=list(kernels.QUANT_ISAS), choices=list(kernels.QUANT_ISAS))
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("the C kernels cannot be built here")
    best = kernels.QUANT_ISAS.index(kernels.best_quant_isa())
    paths = [p for p in args.paths if kernels.QUANT_ISAS.index(p) <= best]
    gen = torch.Generator().manual_seed(0)
    shapes = weight_shapes(args.preset)
    weights = {mode: [QuantWeight(w, mode, int8_group(mode, w))
                      for w in (torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes)] for mode in args.modes}
    for ws in weights.values():
        for w in ws:
            w.set_panels(True)
    inputs = {(rows, k): torch.randn(rows, k, generator=gen) for rows in args.rows for _, k in shapes}

    def one_pass(mode: str, rows: int) -> None:
        for w in weights[mode]:
            w.linear(inputs[rows, w.shape[1]])

    configs = [(m, p, t, r) for m in args.modes for p in paths for t in args.threads for r in args.rows]
    times: dict[tuple[str, str, int, int], list[float]] = {c: [] for c in configs}
    bandwidth = copy_bandwidth(256, 5)
    try:
        for _ in range(args.rounds):
            for mode, path, threads, rows in configs:
                kernels.set_quant_isa(path)
                kernels.set_threads(threads)
                one_pass(mode, rows)  # warm: the next pass finds the pages mapped
                times[mode, path, threads, rows].append(_timed(partial(one_pass, mode, rows)))
    finally:
        kernels.set_quant_isa(None)
        kernels.set_threads(1)
    print(f"{args.preset}: {len(weight_shapes(args.preset))} weights a pass; {args.rounds} rounds; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); best path here {kernels.best_quant_isa()}")
    print(f"{'mode':>5} {'path':>11} {'threads':>7} {'rows':>4} {'MB':>6} {'ms':>8} {'GB/s':>6} {'of copy':>7}")
    for mode, path, threads, rows in configs:
        nbytes = sum(w.panels.numel() * w.panels.element_size() for w in weights[mode] if w.panels is not None)
        ms = statistics.median(times[mode, path, threads, rows])
        print(f"{mode:>5} {path:>11} {threads:>7} {rows:>4} {nbytes / 1e6:>6.0f} {ms * 1e3:>8.2f} "
              f"{nbytes / ms / 1e9:>6.1f} {nbytes / ms / bandwidth:>7.0%}")


if __name__ == "__main__":
    main()
