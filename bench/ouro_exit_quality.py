"""Ouro's exit, ``stop`` against ``select``: loops saved, agreement, KL and decode speed per threshold.

Two semantics of Ouro's exit gate (lambda_t = sigmoid(gate(state_t)), exit probability
p_t = lambda_t * prod_{j<t}(1 - lambda_j), the first loop whose cumulative p reaches the
threshold):

- ``select`` (exit kind ``gate_select``, the reference's): every loop runs and writes KV; per
  position the chosen loop's state feeds the head.
- ``stop`` (exit kind ``gate``, TinyLoop's): a decoded token stops looping at that loop; its later
  loop KV slots are copies of the last one written. Less compute, not bit-equal: later tokens
  attend to the copies. The prompt is prefilled at every loop (the gate decides on decode only),
  so the first token comes from the last loop's state.

Per threshold and prompt: ``select`` generates ``--tokens`` greedy tokens; ``stop`` is fed the same
tokens (teacher forcing) and at every position its next-token distribution is compared with
select's: top-1 agreement (stop's argmax = select's token), KL(select || stop), and the first
position alone (the prefill's). Loops per decode step (select always runs all of them) and decode
tokens/s of the two, timed side by side on the same engine. One table::

    python bench/ouro_exit_quality.py                            # the tiny Ouro fixture (random weights)
    python bench/ouro_exit_quality.py OURO.tinyloop --dtype bfloat16 --tokens 64
    python bench/ouro_exit_quality.py HF_DIR --prompts FILE      # converted into a temp dir first

``--prompts FILE``: one prompt per line. The fixture has random weights: its figures show the tool
works, not how a trained model's gate behaves.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinyloop.convert import convert
from tinyloop.engine.engine import Engine
from tinyloop.requests import GenerationRequest
from tinyloop.vocabulary import ExitRule

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "checkpoints" / "ouro-tiny"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: what is 17 + 25? Answer:",
    "Once upon a time, in a small village by the sea, there lived",
]


@dataclass
class Run:
    """One prompt under one exit rule: next-token log-probabilities at every position, tokens,
    loops of each decode step and the seconds spent decoding."""

    logps: list[torch.Tensor] = field(default_factory=list)  # each [V] float32
    tokens: list[int] = field(default_factory=list)
    loops: list[int] = field(default_factory=list)
    decode_s: float = 0.0


def generate(engine: Engine, prompt: list[int], loops: int, rule: ExitRule, n: int,
             forced: list[int] | None = None) -> Run:
    """``n`` positions: greedy, or fed ``forced`` (teacher forcing); the KV is freed afterwards."""
    vocab = min(engine.tokenizer.vocab_size, engine.config.vocab_size)
    seq = engine.start(GenerationRequest(prompt_tokens=tuple(prompt), loops=loops, max_tokens=n + 1, exit=rule))
    run = Run()
    try:
        logits = engine.prefill(seq)
        start = time.perf_counter()
        for i in range(n):
            logp = logits[:vocab].float().log_softmax(-1)
            run.logps.append(logp)
            run.tokens.append(int(logp.argmax()) if forced is None else forced[i])
            if i + 1 == n:
                break
            seq.pending = run.tokens[-1]
            logits = engine.decode([seq])[0]
            run.loops.append(seq.last_loops)
        run.decode_s = time.perf_counter() - start
    finally:
        engine.free(seq)
    return run


@dataclass
class Row:
    """Totals over the prompts at one threshold."""

    positions: int = 0
    agree: int = 0
    first_agree: int = 0
    kl: float = 0.0
    loops_stop: list[int] = field(default_factory=list)
    loops_select: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: {"select": 0.0, "stop": 0.0})

    def add(self, select: Run, stop: Run) -> None:
        for i, (p, q) in enumerate(zip(select.logps, stop.logps)):
            same = int(q.argmax()) == select.tokens[i]
            self.agree += same
            self.first_agree += same and i == 0
            self.kl += float((p.exp() * (p - q)).sum())
            self.positions += 1
        self.loops_select += select.loops
        self.loops_stop += stop.loops
        self.seconds["select"] += select.decode_s
        self.seconds["stop"] += stop.decode_s


def load(model: str | None, dtype: str | None, tmp: Path, max_seq_len: int) -> Engine:
    path = Path(model) if model else FIXTURE
    if path.is_dir():
        artifact = tmp / f"{path.name}.tinyloop"
        convert(path, artifact, dtype=dtype)
        path = artifact
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype or "")
    return Engine.load(path, dtype=torch_dtype, max_seq_len=max_seq_len, prefix_caching=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="an Ouro HF directory or .tinyloop artifact "
                                                 "(default: the tiny Ouro test fixture)")
    parser.add_argument("--prompts", help="a file with one prompt per line (default: four built-in texts)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--thresholds", default="0.5,0.7,0.9,1.0", help="exit thresholds, comma-separated")
    parser.add_argument("--loops", type=int, default=None, help="loops (default: the model's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weights (default: the artifact's / the checkpoint's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = ([line for line in Path(args.prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
             if args.prompts else PROMPTS)
    thresholds = [float(x) for x in args.thresholds.split(",")]
    with tempfile.TemporaryDirectory(prefix="ouro-exit-") as tmp:
        engine = load(args.model, args.dtype, Path(tmp), max_seq_len=4096)
    if not engine.config.has_exit_gate:
        raise SystemExit(f"{engine.name}: no exit gate (not an Ouro model)")
    loops = args.loops or engine.default_loops
    prompts = [engine.tokenizer.encode(t)[:4096 - args.tokens - 1] for t in texts]
    generate(engine, prompts[0], loops, ExitRule("gate", 0.5), 2)  # warm-up
    rows = {}
    for threshold in thresholds:
        row = rows[threshold] = Row()
        for prompt in prompts:  # the two alternate, so load on a shared machine hits both alike
            select = generate(engine, prompt, loops, ExitRule("gate_select", threshold), args.tokens)
            row.add(select, generate(engine, prompt, loops, ExitRule("gate", threshold), args.tokens, select.tokens))
    c = engine.config
    print(f"model: {engine.name}; {c.n_core} layers x {loops} loops, hidden {c.hidden}, {engine.dtype}; "
          f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens), {args.tokens} greedy tokens each "
          f"(select's, fed to stop); torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'threshold':>9} {'loops/step stop':>15} {'select':>6} {'top-1 agree':>11} {'first token':>11} "
          f"{'KL(select||stop)':>16} {'select tok/s':>12} {'stop tok/s':>10} {'stop/select':>11}")
    for threshold, row in rows.items():
        steps = len(row.loops_stop)
        tps = {k: steps / s if s else float("nan") for k, s in row.seconds.items()}
        print(f"{threshold:>9.2f} {sum(row.loops_stop) / steps:>15.2f} {sum(row.loops_select) / steps:>6.2f} "
              f"{row.agree / row.positions:>11.1%} {row.first_agree:>7}/{len(prompts):<3} "
              f"{row.kl / row.positions:>16.2e} {tps['select']:>12.1f} {tps['stop']:>10.1f} "
              f"{tps['stop'] / tps['select']:>10.2f}x")
    print("loops/step: loops run per decode step; first token: from the prefill, where stop runs every loop "
          "and feeds the last one to the head; KL in nats, mean over every position")


if __name__ == "__main__":
    main()
