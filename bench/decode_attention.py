"""Decode attention on the CPU: the C kernel that reads K and V in place against torch's gather + SDPA.

    python bench/decode_attention.py [--preset small] [--rows 1 16] [--keys 24 64 256 480] [--repeat 40]

One layer's decode attention (``Backend.decode_attention``) over a float32 paged pool of the
preset's shape (``--pool-mb`` of blocks of 16 rows), each row's keys in blocks scattered over the
pool as a serving engine's are. Per row count and key count, two cases: ``equal``, every row
attends to all its keys (decode of rows of one length: torch takes SDPA's unmasked path), and
``mixed``, row r attends to its first ``keys * (r + 1) / rows`` (rows of different lengths, as
continuous batching makes them: torch needs a mask). Timed ``cold``: before each call a 64 MiB
tensor is streamed through the cache, as a decode step's weights stream between one layer's
KV write and its read at the next step; the median of ``--repeat`` calls. One torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from tinyloop.cpu import kernels
from tinyloop.cpu.backend import CPU
from tinyloop.model.backend import TORCH
from tinyloop.model.kvstore import KVStore
from tinyloop.model.presets import PRESETS
from tinyloop.vocabulary import KVMode

BLOCK = 16


def cold_us(call: Callable[[], object], evict: torch.Tensor, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        evict.add_(1.0)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--keys", type=int, nargs="+", default=[24, 64, 256, 480])
    ap.add_argument("--pool-mb", type=int, default=256, help="the pool's size (MiB of K and V)")
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("the CPU kernel cannot be built here (no C compiler): nothing to compare")
    torch.set_num_threads(1)
    cfg = PRESETS[args.preset]
    row_bytes = 2 * cfg.kv_heads * cfg.head_dim * 4
    blocks = args.pool_mb * 2**20 // (row_bytes * BLOCK)
    store = KVStore(KVMode.parse(None), cfg, blocks * BLOCK, BLOCK, torch.float32, "cpu")
    for field in store.fields.values():
        field.tensors[0].normal_()
    evict = torch.zeros(16 * 2**20)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.preset}: {cfg.heads} query heads, {cfg.kv_heads} KV heads, head_dim {cfg.head_dim}; "
          f"pool {args.pool_mb} MiB, blocks of {BLOCK}; float32, 1 thread, cold cache, median of {args.repeat}")
    print(f"{'rows':>4} {'keys':>5} {'case':>6} {'kernel us':>10} {'torch us':>9} {'torch/kernel':>12} {'max diff':>9}")
    for rows in args.rows:
        for keys in args.keys:
            per_row = -(-keys // BLOCK)
            tables = torch.randperm(blocks, generator=gen)[:rows * per_row].view(rows, per_row)
            pos = torch.arange(keys)
            pool_rows = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK  # [R, L]
            q = torch.randn(rows, cfg.heads, 1, cfg.head_dim, generator=gen)
            for case in ("equal", "mixed"):
                if case == "equal":
                    n_keys, mask = torch.full((rows,), keys), None
                else:
                    n_keys = torch.tensor([max(1, keys * (r + 1) // rows) for r in range(rows)])
                    mask = (pos[None, :] < n_keys[:, None])[:, None, None, :]
                call = partial(CPU.decode_attention, store, q, pool_rows, n_keys, mask)
                reference = partial(TORCH.decode_attention, store, q, pool_rows, n_keys, mask)
                ours, ref = cold_us(call, evict, args.repeat), cold_us(reference, evict, args.repeat)
                diff = (call() - reference()).abs().max().item()
                print(f"{rows:>4} {keys:>5} {case:>6} {ours:>10.0f} {ref:>9.0f} {ref / ours:>11.2f}x {diff:>9.1e}")


if __name__ == "__main__":
    main()
