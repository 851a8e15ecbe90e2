"""Self-speculative decoding: plain vs chain vs tree, tokens/s and acceptance, one table.

    python bench/speculative.py [--model FILE.tinyloop | --random] [--prompt TEXT] [--tokens 128]
                                [--threads 1] [--repeat 5] [--draft-min-prob 0,0.2] [--draft-weights same,int8]

Without ``--model`` the bundled demo model (trained: its drafts agree with its verify as a real
model's do); ``--random`` a random ``small`` preset (what ``tinyloop init --preset small``
writes) saved to a temporary file and loaded from there. The last line gives the server's
default setting against plain decoding (a chain of ``DEFAULT_DRAFT_AHEAD`` at
``DEFAULT_DRAFT_LOOPS`` loops, ``draft_min_prob`` and ``draft_weights`` as ``tinyloop serve``
defaults them). Every row decodes the same prompt greedily
(ignoring EOS) for ``--tokens`` tokens at the model's default loops, alone (batch 1), and checks
that the tokens equal plain decoding's. Chain rows run once per ``--draft-weights`` (``i8``: the
drafts run on an int8 twin of the model's linear weights, the verify on the model's own) and
``--draft-min-prob`` (the engine's ``draft_min_prob``: a chain stops at a draft token the draft
gives less than this probability; 0 drafts ``draft_ahead`` every time), labelled ``p<value>``.
Columns:

- ``tok/s``: generated tokens per second of wall time, prefill included (the median over
  ``--repeat`` rounds; a round runs every row once, plain first);
- ``vs plain``: the median over the rounds of plain's time / the row's, both from one round (a
  slow spell of a shared machine hits the row and its baseline alike);
- ``accept``: accepted / drafted tokens (for a tree every node counts as drafted);
- ``tok/step``: tokens emitted per decode step (one draft + verify round, or one plain step);
  plain decoding is 1.0, a perfect chain of ``draft_ahead`` k is k + 1.

Random weights give flat, near-tied logits: a few-loop draft rarely agrees with the full
model, so acceptance here is a floor. A trained artifact (``--model``) is the real measure.
On a shared machine pass ``--threads 1``: torch's default threads spin against other processes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.model.artifact import save_artifact
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import (
    DEFAULT_DRAFT_AHEAD,
    DEFAULT_DRAFT_LOOPS,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer

PROMPT = "Once upon a time, in a small town by the sea, there lived"
DEMO = Path(__file__).resolve().parents[1] / "tinyloop" / "data" / "demo.tinyloop"
# (mode, draft_loops, draft_ahead, k_branches)
SETTINGS = [
    ("plain", None, None, None),
    ("chain", 1, 4, None),
    ("chain", 1, 8, None),
    ("chain", 2, 4, None),
    ("chain", 2, 8, None),
    ("tree", 1, 4, 2),
    ("tree", 2, 4, 2),
    ("tree", 2, 8, 2),
]


@dataclass
class Row:
    label: str
    tok_s: float
    speedup: float  # the median over rounds of plain's wall time / this row's, in the same round
    accept: float | None
    tok_step: float
    same: bool


def random_small(tmp: Path, seed: int) -> Path:
    path = tmp / "small.tinyloop"
    save_artifact(path, init_model(PRESETS["small"], seed=seed), default_tokenizer())
    return path


def request(tokens: list[int], n: int, mode: str, draft_loops: int | None, ahead: int | None,
            k: int | None) -> GenerationRequest:
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    if mode == "plain":
        return GenerationRequest(prompt_tokens=tuple(tokens), max_tokens=n, sampling=greedy)
    return GenerationRequest(prompt_tokens=tuple(tokens), max_tokens=n, sampling=greedy,
                             mode="tree" if mode == "tree" else "speculative",
                             draft_loops=draft_loops, draft_ahead=ahead, k_branches=k)


def timed(engine: Engine, req: GenerationRequest, repeat: int) -> tuple[float, GenerationResult]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = engine.generate(req)
        best = min(best, time.perf_counter() - start)
    assert result is not None
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEMO, help="a .tinyloop artifact (default: the bundled demo model)")
    ap.add_argument("--random", action="store_true", help="a random small preset instead of --model")
    ap.add_argument("--tokens", type=int, default=128, help="tokens to generate per row")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=5,
                    help="rounds (each runs every row once); medians over them count")
    ap.add_argument("--seed", type=int, default=0, help="init seed of the random model")
    ap.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                    help="attention and RMSNorm on torch ops, not the C kernels (TINYLOOP_CPU_KERNELS=0)")
    ap.add_argument("--prompt", default=PROMPT, help="the prompt every row decodes from")
    ap.add_argument("--draft-min-prob", default="0,0.2",
                    help="comma-separated draft_min_prob values; chain rows run once per value")
    ap.add_argument("--draft-weights", default="same,int8",
                    help="comma-separated draft_weights values; chain rows run once per value (int8: i8)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_kernels and kernels.available():  # the same threads as torch's (and transformers')
        kernels.set_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        path = random_small(Path(tmp), args.seed) if args.random else args.model
        engine = Engine.load(path, cpu_kernels=args.cpu_kernels)
        draft_modes = args.draft_weights.split(",")
        # plain and tree rows always run on the model's own weights ("same"), chains on each mode asked for
        engines = {"same": engine, **{w: Engine.load(path, draft_weights=w, cpu_kernels=args.cpu_kernels)
                                      for w in draft_modes if w != "same"}}
        name = f"random small (seed {args.seed})" if args.random else str(path)
    tokens = engine.tokenizer.encode(args.prompt)
    loops = engine.default_loops
    print(f"model: {name}; {engine.config.n_prelude}+{engine.config.n_core}x{loops}+"
          f"{engine.config.n_coda} layers, hidden {engine.config.hidden}; prompt {len(tokens)} tokens, "
          f"{args.tokens} generated, greedy, batch 1, verify_loops {loops}, "
          f"torch threads {torch.get_num_threads()}; "
          f"C kernel threads {kernels.threads() if kernels.loaded() else 0}; backend {engine.model.backend.name}")
    engine.generate(request(tokens, 4, "plain", None, None, None))  # warm-up
    rows: list[Row] = []
    min_probs = [float(p) for p in args.draft_min_prob.split(",")]
    runs = [(s, p, w) for s in SETTINGS
            for p in (min_probs if s[0] == "chain" else [engine.draft_min_prob])
            for w in (draft_modes if s[0] == "chain" else ["same"])]
    walls: list[list[float]] = [[] for _ in runs]  # per row, one wall time per round
    results: list[GenerationResult] = []
    for round_ in range(args.repeat):  # rounds: every row once, so a slow spell hits all rows alike
        for i, ((mode, draft_loops, ahead, k), min_prob, weights) in enumerate(runs):
            runner = engines[weights]
            runner.draft_min_prob = min_prob
            wall, result = timed(runner, request(tokens, args.tokens, mode, draft_loops, ahead, k), 1)
            walls[i].append(wall)
            if round_ == 0:
                results.append(result)
    reference = results[0].tokens
    for i, ((mode, draft_loops, ahead, k), min_prob, weights) in enumerate(runs):
        result = results[i]
        steps = result.completion_tokens - 1 - (result.accepted_draft_tokens or 0)
        label = "plain" if mode == "plain" else (
            f"{mode} d{draft_loops} a{ahead}" + (f" K{k}" if k else f" p{min_prob:g}")
            + ("" if weights == "same" else " i8"))
        accept = None if result.draft_tokens is None else (
            (result.accepted_draft_tokens or 0) / max(result.draft_tokens, 1))
        speedup = statistics.median(p / w for p, w in zip(walls[0], walls[i]))  # within each round
        rows.append(Row(label, result.completion_tokens / statistics.median(walls[i]), speedup, accept,
                        (result.completion_tokens - 1) / max(steps, 1), result.tokens == reference))
    print(f"{'setting':<22} {'tok/s':>8} {'vs plain':>9} {'accept':>8} {'tok/step':>9} {'= plain':>8}")
    for r in rows:
        acc = "-" if r.accept is None else f"{r.accept:.1%}"
        print(f"{r.label:<22} {r.tok_s:>8.1f} {r.speedup:>8.2f}x {acc:>8} {r.tok_step:>9.2f} "
              f"{'yes' if r.same else 'NO':>8}")
    served = Settings()
    default = (f"chain d{DEFAULT_DRAFT_LOOPS} a{DEFAULT_DRAFT_AHEAD} p{served.draft_min_prob:g}"
               + ("" if served.draft_weights == "same" else " i8"))
    match = next((r for r in rows if r.label == default), None)
    print(f"server default ({default}): " + (f"{match.speedup:.2f}x plain decoding" if match else
                                             "not among the rows run (see --draft-min-prob, --draft-weights)"))
    if any(e.kv_statistics().blocks_used for e in engines.values()):
        raise SystemExit("KV blocks leaked")


if __name__ == "__main__":
    main()
