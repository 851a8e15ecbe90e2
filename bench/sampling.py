"""Sampling speed: the one-row draw, and a batch sampled row by row against all at once.

    python bench/sampling.py [--vocab 4096 32768 65536] [--batches 1 16 32] [--repeat 200] [--device cpu|cuda]

1. One row's draw from its filtered distribution (no filter, and top-p 0.9): ``sampling.draw``
   (inverse CDF over the tokens left: one uniform a draw) against ``torch.multinomial`` over
   the same tokens (one exponential a token: the draw before it), in turn in one process, the
   best of three rounds each.
2. A batch of sampled rows (temperature 0.8, top-p 0.9, presence penalty 0.3, seeded): the
   host path (``sample_token`` on each row, as ``sample_batch`` runs on the CPU) against
   ``batch_sampling.sample_rows`` (the batch as tensor ops, what ``sample_batch`` runs on a
   GPU), with how many rows pick the same token. On ``--device cuda`` the logits live there and
   the host path copies each row over, as it would without the batched path.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tinyloop.engine.batch_sampling import sample_rows  # noqa: E402
from tinyloop.engine.sampling import _filtered_probs, draw, make_generator, sample_token  # noqa: E402
from tinyloop.requests import SamplingParams  # noqa: E402


def multinomial_draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    support = probs.nonzero().squeeze(-1)
    pick = torch.multinomial(probs.index_select(0, support), 1, generator=generator)
    return int(support[int(pick)])


def best_us(fn: Callable[[], object], repeat: int, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t) / repeat * 1e6)
    return best


History = tuple[list[list[int]], list[list[int]]]  # each row's prompt and output tokens


def row_by_row(logits: torch.Tensor, params: SamplingParams, history: History) -> list[int]:
    return [sample_token(logits[b], params, make_generator(b), prompt_tokens=history[0][b],
                         output_tokens=history[1][b]).token_id for b in range(logits.shape[0])]


def batched(logits: torch.Tensor, params: SamplingParams, history: History, sync: Callable[[], None]) -> list[int]:
    rows = logits.shape[0]
    picked: list[int] = sample_rows(logits, [params] * rows, [make_generator(b) for b in range(rows)],
                                    *history).tolist()
    sync()
    return picked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 32768, 65536])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), device {device}")
    print("\none row's draw (us, best of 3 rounds)")
    print(f"{'vocab':>7} {'filter':>8} {'multinomial':>12} {'inverse-cdf':>12} {'speed-up':>9}")
    for vocab in args.vocab:
        logits = torch.randn(vocab, generator=g) * 3
        for label, params in (("none", SamplingParams(temperature=1.0)),
                              ("top-p .9", SamplingParams(temperature=0.8, top_p=0.9))):
            probs = _filtered_probs(logits, params)
            old = best_us(partial(multinomial_draw, probs, g), args.repeat)
            new = best_us(partial(draw, probs, g), args.repeat)
            print(f"{vocab:>7} {label:>8} {old:>12.1f} {new:>12.1f} {old / new:>8.2f}x")
    vocab = max(args.vocab)
    print(f"\na batch of sampled rows, vocab {vocab} (ms a batch, best of 3 rounds)")
    print(f"{'rows':>5} {'row by row':>11} {'batched':>9} {'speed-up':>9} {'same picks':>11}")
    params = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.3, seed=0)
    for rows in args.batches:
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
        history = [list(range(b, b + 16)) for b in range(rows)], [list(range(100 + b, 108 + b)) for b in range(rows)]
        same = sum(a == b for a, b in zip(row_by_row(logits, params, history), batched(logits, params, history, sync)))
        repeat = max(1, args.repeat // 20)
        slow = best_us(partial(row_by_row, logits, params, history), repeat) / 1000
        fast = best_us(partial(batched, logits, params, history, sync), repeat) / 1000
        print(f"{rows:>5} {slow:>11.2f} {fast:>9.2f} {slow / fast:>8.2f}x {same:>6}/{rows}")


if __name__ == "__main__":
    main()
