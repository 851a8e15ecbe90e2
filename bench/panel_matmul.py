"""Matrix products of a few rows on the CPU: the C panel kernel against torch's paths.

    python bench/panel_matmul.py [--preset small] [--rows 1 2 4 8 16] [--threads 1] [--repeat 200]
                                 [--cold-mb 96] [--kernel-threads N]

For each weight shape of ``--preset``'s layers (q/k/v, o, gate/up, down, the loop adapter, the
LM head) and each row count, ``cpu_linear.PackedWeight.linear`` with and without its panel copy:
``torch`` is what the engine runs without the C kernels (one row: MKL's product on the re-laid
weight, split over the threads where there are several; more: oneDNN's blocked kernel), ``panel``
is ``kernels.panel_matmul`` (what ``PackedWeight`` runs for 1-16 rows where the weight has its
panels and torch runs at most two threads). Two timings each:

- ``hot``: the same weight over and over (in cache: the kernels' arithmetic);
- ``cold``: cycling through enough copies of the weight to fill ``--cold-mb`` MiB (default 96), far
  beyond the caches, as a decode step streams
  its weights from memory (a step reads every weight once per loop: tens of MB).

Microseconds a call (the median of ``--repeat``), torch / panel, and the largest difference of the
outputs. ``--threads`` sets torch's intra-op threads (the panel kernel runs on one).
``--kernel-threads N`` (N > 1) adds the panel kernel on N threads of its own (``kernels.set_threads``:
products of 4 rows or more split among them), cold, and its speed against one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from tinyloop.cpu import kernels
from tinyloop.model.cpu_linear import PackedWeight
from tinyloop.model.presets import PRESETS


def shapes(preset: str) -> list[tuple[str, int, int]]:
    c = PRESETS[preset]
    q = c.heads * c.head_dim + 2 * c.kv_heads * c.head_dim
    out = [("qkv", q, c.hidden), ("o", c.hidden, c.heads * c.head_dim), ("gate/up", 2 * c.intermediate, c.hidden),
           ("down", c.hidden, c.intermediate)]
    if c.injection == "concat_linear":
        out.append(("adapter", c.hidden, 2 * c.hidden))
    return [*out, ("head", c.vocab_size, c.hidden)]


def per_call_us(calls: list[Callable[[], object]], repeat: int) -> float:
    """Median time of one call, cycling through ``calls`` (one weight each)."""
    for call in calls:
        call()
    times = []
    rounds = max(1, repeat // len(calls))
    for _ in range(rounds):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) / len(calls))
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--repeat", type=int, default=200, help="timed calls per cell (default 200)")
    ap.add_argument("--cold-mb", type=int, default=96, help="MiB of weight copies the cold timing cycles through")
    ap.add_argument("--kernel-threads", type=int, default=1,
                    help="also time the panel kernel on this many threads of its own (cold)")
    args = ap.parse_args()
    if max(args.rows) > 16:
        ap.error("the panel kernel serves 1-16 rows (kernels.PANEL_ROWS)")
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit("the C kernels do not build here (no C compiler?)")
    gen = torch.Generator().manual_seed(0)
    print(f"preset {args.preset}; torch threads {torch.get_num_threads()}; cold: {args.cold_mb} MiB of copies; "
          f"us a call (median)")
    split = args.kernel_threads > 1
    print(f"{'weight':<8} {'N x K':>11} {'rows':>4} {'torch hot':>9} {'panel hot':>9} {'ratio':>6} "
          f"{'torch cold':>10} {'panel cold':>10} {'ratio':>6} {'max diff':>9}"
          + (f" {f'{args.kernel_threads} thr cold':>11} {'vs 1':>6}" if split else ""))
    with torch.inference_mode():
        for name, n, k in shapes(args.preset):
            copies = max(1, (args.cold_mb << 20) // (n * k * 4))
            torch_w = [PackedWeight(torch.randn(n, k, generator=gen) * k ** -0.5) for _ in range(copies)]
            panels = [kernels.pack_panels(w.weight.detach()) for w in torch_w]
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen)
                diff = (torch_w[0].linear(x) - kernels.panel_matmul(x, panels[0], n, None)).abs().max().item()
                cells = []
                for calls in ([partial(w.linear, x) for w in torch_w],
                              [partial(kernels.panel_matmul, x, p, n, None) for p in panels]):
                    cells.append((per_call_us(calls[:1], args.repeat), per_call_us(calls, args.repeat)))
                (t_hot, t_cold), (p_hot, p_cold) = cells
                extra = ""
                if split:
                    kernels.set_threads(args.kernel_threads)
                    s_cold = per_call_us([partial(kernels.panel_matmul, x, p, n, None) for p in panels], args.repeat)
                    kernels.set_threads(1)
                    extra = f" {s_cold:>11.1f} {p_cold / s_cold:>5.2f}x"
                print(f"{name:<8} {f'{n}x{k}':>11} {rows:>4} {t_hot:>9.1f} {p_hot:>9.1f} {t_hot / p_hot:>5.2f}x "
                      f"{t_cold:>10.1f} {p_cold:>10.1f} {t_cold / p_cold:>5.2f}x {diff:>9.1e}" + extra)


if __name__ == "__main__":
    main()
