"""The bundled demo model's quality per loop count: text loss, addition accuracy, samples, speculation.

    python bench/demo_model.py [--model FILE.tinyloop] [--loops 1,2,4,8,16] [--windows N]
                               [--problems 1000] [--threads 2] [--no-samples] [--no-speculation]
                               [--weights float,int8,int4]

Rebuilds the held-out splits the artifact was trained against (its ``tinyloop.train`` metadata
names the corpus spec): the text validation files of the Python standard library found on this
machine, and the held-out addition problems. Prints four tables:

1. text validation loss (nats/token) per loop count, and its gain over 1 loop;
2. exact-match greedy accuracy on held-out ``a+b=`` problems per loop count, overall and by
   the longer operand's digit count (carries through more digits need more iterations);
3. greedy completions of ``def fibonacci(n):`` and ``class Stack:`` at 1 loop and the default;
4. chain self-speculative decoding (1-loop draft, default-loop verify, draft ahead 4): accepted
   / drafted tokens and tokens per verify step, on code and addition prompts. The speculative
   tokens are checked equal to plain greedy decoding's.

Everything runs through the serving model's own forward (``LoopedLM`` in float32, the engine for
samples and speculation), so the figures describe the model as ``tinyloop serve`` runs it.

``--weights float,int8,int4`` replaces tables 1 and 2 by one table each with a column per weights
mode (loops x weights): the model's linear layers quantized as ``Engine(weights=...)`` and
``TINYLOOP_WEIGHTS`` do (``quant.quantize_linears``), each mode on a fresh load.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from tinyloop.engine.engine import Engine
from tinyloop.model.artifact import load_artifact
from tinyloop.model.quant import WEIGHT_MODES, quantize_linears
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.settings import Settings
from tinyloop.train.corpus import CorpusSpec, held_out_problems, validation_text
from tinyloop.train.evaluate import addition_accuracy, val_loss

SAMPLE_PROMPTS = ("def fibonacci(n):", "class Stack:")
SPEC_CODE_PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\nimport sys\n\n\ndef main(",
                     "    def __repr__(self):", "try:\n    import")
SPEC_ADD_PROMPTS = ("\n417+386=", "\n90210+4655=", "\n7+58=\n3049+12=", "\n55555+44445=")
DRAFT_LOOPS, DRAFT_AHEAD = 1, 4


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_windows(stream: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """``n`` evenly spaced, non-overlapping ``seq_len + 1`` windows (as the trainer's evaluation)."""
    length = seq_len + 1
    n = min(n, stream.size // length)
    starts = np.arange(n) * (stream.size // max(n, 1))
    return torch.from_numpy(stream[starts[:, None] + np.arange(length)].astype(np.int64))


def digits(pairs: np.ndarray) -> np.ndarray:
    return np.char.str_len(pairs.max(axis=1).astype(str))


def eval_sets(model, tokenizer, spec: CorpusSpec, n_windows: int, n_problems: int):
    """The held-out text stream, its windows and the held-out addition problems."""
    stream = validation_text(spec, tokenizer)
    windows = text_windows(stream, n_windows, model.config.max_position)
    pairs = held_out_problems(spec.seed, spec.n_held_out, spec.max_digits)[:n_problems]
    return stream, windows, pairs


def measure(model, tokenizer, windows: torch.Tensor, pairs: np.ndarray, loop_counts: list[int]):
    """Text loss, addition accuracy and accuracy by digit count per loop count."""
    losses, accs, by_digits = {}, {}, {}
    for r in loop_counts:
        t0 = time.perf_counter()
        losses[r] = val_loss(model, windows, r)
        by_digits[r] = {d: addition_accuracy(model, tokenizer, pairs[digits(pairs) == d], r)
                        for d in sorted(set(digits(pairs).tolist()))}
        accs[r] = sum(a * int((digits(pairs) == d).sum()) for d, a in by_digits[r].items()) / len(pairs)
        print(f"  loops {r}: {time.perf_counter() - t0:.1f}s", flush=True)
    return losses, accs, by_digits


def quality(model, tokenizer, spec: CorpusSpec, loop_counts: list[int], n_windows: int,
            n_problems: int) -> None:
    stream, windows, pairs = eval_sets(model, tokenizer, spec, n_windows, n_problems)
    default = model.config.default_loops
    losses, accs, by_digits = measure(model, tokenizer, windows, pairs, loop_counts)
    n_tok = windows[:, 1:].numel()
    print(f"\n### Text validation loss ({len(windows)} windows, {n_tok} tokens of "
          f"{stream.size} held-out stdlib tokens)\n")
    print(table(["loops", "loss (nats/token)", "gain over 1 loop"],
                [[f"{r}" + (" (default)" if r == default else ""), f"{losses[r]:.4f}",
                  f"{losses[loop_counts[0]] - losses[r]:+.4f}"] for r in loop_counts]))
    ds = sorted(by_digits[loop_counts[0]])
    counts = {d: int((digits(pairs) == d).sum()) for d in ds}
    print(f"\n### Held-out addition, exact match, greedy ({len(pairs)} problems)\n")
    print(table(["loops", "accuracy", "vs 1 loop (points)",
                 *[f"{d}-digit (n={counts[d]})" for d in ds]],
                [[f"{r}" + (" (default)" if r == default else ""), f"{100 * accs[r]:.1f}%",
                  f"{100 * (accs[r] - accs[loop_counts[0]]):+.1f}",
                  *[f"{100 * by_digits[r][d]:.0f}%" for d in ds]] for r in loop_counts]))


def quality_by_weights(path: Path, spec: CorpusSpec, loop_counts: list[int], n_windows: int,
                       n_problems: int, modes: list[str]) -> None:
    """The loss and accuracy tables with one column per weights mode (quant.py, as the engine
    quantizes at load), each mode on a fresh load of the artifact."""
    results = {}
    for mode in modes:
        art = load_artifact(path, dtype=torch.float32)
        n_quant = quantize_linears(art.model, mode)
        print(f"weights {mode}: {n_quant} weights quantized", flush=True)
        stream, windows, pairs = eval_sets(art.model, art.tokenizer, spec, n_windows, n_problems)
        results[mode] = measure(art.model, art.tokenizer, windows, pairs, loop_counts)
    default = art.model.config.default_loops
    base = modes[0]

    def row(r: int, cell) -> list[str]:  # type: ignore[no-untyped-def]
        return [f"{r}" + (" (default)" if r == default else ""), *[cell(mode, r) for mode in modes]]

    print(f"\n### Text validation loss by weights ({len(windows)} windows, {windows[:, 1:].numel()} tokens; "
          f"nats/token, change against {base} in brackets)\n")
    print(table(["loops", *modes], [row(r, lambda m, r: f"{results[m][0][r]:.4f}" + (
        "" if m == base else f" ({results[m][0][r] - results[base][0][r]:+.4f})")) for r in loop_counts]))
    print(f"\n### Held-out addition by weights, exact match, greedy ({len(pairs)} problems; "
          f"points against {base} in brackets)\n")
    print(table(["loops", *modes], [row(r, lambda m, r: f"{100 * results[m][1][r]:.1f}%" + (
        "" if m == base else f" ({100 * (results[m][1][r] - results[base][1][r]):+.1f})"))
        for r in loop_counts]))


def greedy(ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=ignore_eos)


def samples(engine: Engine, n_tokens: int) -> None:
    print(f"\n### Greedy completions ({n_tokens} tokens at most)\n")
    for prompt in SAMPLE_PROMPTS:
        for loops in sorted({1, engine.default_loops}):
            result = engine.generate(GenerationRequest(
                prompt_tokens=tuple(engine.tokenizer.encode(prompt)), max_tokens=n_tokens,
                loops=loops, sampling=greedy()))
            print(f"loops={loops}, {result.finish_reason}:\n```python\n{prompt}{result.text}\n```\n")


def speculation(engine: Engine, n_tokens: int) -> None:
    rows = []
    for kind, prompts in (("code", SPEC_CODE_PROMPTS), ("addition", SPEC_ADD_PROMPTS)):
        drafted = accepted = tokens = steps = 0
        same = True
        for prompt in prompts:
            ids = tuple(engine.tokenizer.encode(prompt))
            plain = engine.generate(GenerationRequest(prompt_tokens=ids, max_tokens=n_tokens,
                                                      sampling=greedy(True)))
            spec = engine.generate(GenerationRequest(
                prompt_tokens=ids, max_tokens=n_tokens, sampling=greedy(True),
                mode="speculative", draft_loops=DRAFT_LOOPS, draft_ahead=DRAFT_AHEAD))
            same &= spec.tokens == plain.tokens
            drafted += spec.draft_tokens or 0
            accepted += spec.accepted_draft_tokens or 0
            tokens += spec.completion_tokens
            steps += spec.completion_tokens - 1 - (spec.accepted_draft_tokens or 0)
        rows.append([kind, str(len(prompts)), str(tokens), f"{accepted}/{drafted}",
                     f"{100 * accepted / max(drafted, 1):.1f}%", f"{(tokens - len(prompts)) / max(steps, 1):.2f}",
                     "yes" if same else "NO"])
    print(f"\n### Chain self-speculation: draft {DRAFT_LOOPS} loop, verify {engine.default_loops} "
          f"loops, {DRAFT_AHEAD} ahead, greedy, {n_tokens} tokens per prompt\n")
    print(table(["prompts", "n", "tokens", "accepted/drafted", "acceptance", "tokens/verify step",
                 "equals plain greedy"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a .tinyloop artifact (default: the bundled demo)")
    ap.add_argument("--loops", default="1,2,4,8,16", help="comma-separated loop counts")
    ap.add_argument("--windows", type=int, default=10**6,
                    help="text validation windows of the context length (default: all that fit)")
    ap.add_argument("--problems", type=int, default=1000,
                    help="held-out addition problems (default: the whole held-out set)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--sample-tokens", type=int, default=80)
    ap.add_argument("--spec-tokens", type=int, default=48)
    ap.add_argument("--no-samples", action="store_true")
    ap.add_argument("--no-speculation", action="store_true")
    ap.add_argument("--weights", help="comma-separated weights modes (float,int8,int4): the loss and "
                    "accuracy tables side by side per mode, quantized as the engine does (quant.py)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or Settings().resolve_model_path()
    art = load_artifact(path, dtype=torch.float32)
    train_meta = json.loads(art.metadata.get("tinyloop.train") or "{}")
    spec = CorpusSpec(**train_meta["corpus_spec"]) if "corpus_spec" in train_meta else CorpusSpec()
    c = art.config
    print(f"model: {path.name}; {c.n_prelude}+{c.n_core}xloops+{c.n_coda} layers, hidden {c.hidden}, "
          f"default loops {c.default_loops}; trained {train_meta.get('step', '?')} steps, "
          f"{train_meta.get('tokens_seen', '?')} tokens; torch threads {torch.get_num_threads()}")
    loop_counts = [int(x) for x in args.loops.split(",")]
    if args.weights:
        modes = args.weights.split(",")
        if bad := [m for m in modes if m not in WEIGHT_MODES]:
            ap.error(f"--weights: unknown mode(s) {', '.join(bad)}; choose from {', '.join(WEIGHT_MODES)}")
        quality_by_weights(path, spec, loop_counts, args.windows, args.problems, modes)
    else:
        quality(art.model, art.tokenizer, spec, loop_counts, args.windows, args.problems)
    if not (args.no_samples and args.no_speculation):
        engine = Engine.load(path, max_seq_len=c.max_position)
        if not args.no_samples:
            samples(engine, args.sample_tokens)
        if not args.no_speculation:
            speculation(engine, args.spec_tokens)


if __name__ == "__main__":
    main()
