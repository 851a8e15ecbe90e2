"""Top-1 agreement of weight-only int8/int4 with float32 on the converted test fixtures.

    python bench/quant_agreement.py [--tokens 32] [--threads 1] [--weights float int8 int4]

Converts each checkpoint of ``tests/data/checkpoints`` (huginn-tiny, ouro-tiny,
retrofit-llama-tiny, retrofit-olmo-tiny) with ``tinyloop.convert.convert`` to float32, loads it
once as the float32 reference (plain ``F.linear``, no packed layouts) and once per weights mode
through ``Engine(weights=...)`` (``float`` is the engine's packed float32 layout; ``int8`` and
``int4`` are quant.py's). Along the reference's greedy continuation of a few prompts, at 1 loop
and the model's default loops, it feeds the same tokens to both (teacher forcing) and prints the
share of positions whose argmax agrees with the reference and the largest |logit difference|.

The fixtures have random weights: their logits are flatter than a trained model's, so near-ties
flip under small errors and the agreement here is a pessimistic figure for int8/int4.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from tinyloop.convert import convert
from tinyloop.engine.engine import Engine
from tinyloop.model.artifact import load_artifact
from tinyloop.model.context import FullContext
from tinyloop.model.looped import LoopedLM, RowSpec
from tinyloop.model.quant import WEIGHT_MODES, quant_available
from tinyloop.requests import GenerationRequest, SamplingParams

FIXTURES = ("huginn-tiny", "ouro-tiny", "retrofit-llama-tiny", "retrofit-olmo-tiny")
CHECKPOINTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "checkpoints"
PROMPTS = ("The quick brown fox", "def main():\n    ", "1 2 3 4", "Once upon a time")


@torch.no_grad()
def logits(model: LoopedLM, tokens: list[int], loops: int) -> torch.Tensor:
    """``[T, V]`` logits of every position of ``tokens`` at ``loops`` loops."""
    ids = torch.tensor([tokens], dtype=torch.long)
    ctx = FullContext(model.rope, 1, ids.shape[1])
    out: torch.Tensor = model(ids, ctx, [RowSpec(loops=loops, window=loops)], last_only=False).logits
    return out[0].float()


def compare(reference: Engine, other: Engine, n: int, loops: int) -> tuple[float, float, int]:
    """(top-1 agreement, max |dlogit|, positions) along ``reference``'s greedy continuations."""
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    agree, positions, worst = 0, 0, 0.0
    for text in PROMPTS:
        prompt = list(reference.tokenizer.encode(text))
        out = reference.generate(GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=n, loops=loops,
                                                   sampling=greedy))
        tokens = prompt + list(out.tokens)[:-1]
        ref, oth = (logits(e.model, tokens, loops)[len(prompt) - 1:] for e in (reference, other))
        agree += int((ref.argmax(-1) == oth.argmax(-1)).sum())
        positions += ref.shape[0]
        worst = max(worst, float((ref - oth).abs().max()))
    return agree / positions, worst, positions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--weights", nargs="+", default=list(WEIGHT_MODES), choices=WEIGHT_MODES)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = [m for m in args.weights if m == "float" or quant_available(m)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {len(PROMPTS)} prompts x "
          f"{args.tokens} greedy tokens; reference: float32 with plain F.linear\n")
    print("| fixture | loops | weights | quantized linears | top-1 agreement | max abs dlogit | reference logit std |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in FIXTURES:
            path = Path(tmp) / f"{name}.tinyloop"
            convert(CHECKPOINTS / name, path, dtype="float32")

            def engine(mode: str, pack: bool = True, path: Path = path) -> Engine:
                art = load_artifact(path, dtype=torch.float32)
                return Engine(art.model, art.tokenizer, max_seq_len=min(128, art.config.max_position), kv_cache_mb=16,
                              prefix_caching=False, pack_weights=pack, weights=mode)

            reference = engine("float", pack=False)
            spread = float(logits(reference.model, list(reference.tokenizer.encode(PROMPTS[0])), 1).std())
            for loops in sorted({1, reference.default_loops}):
                for mode in modes:
                    other = engine(mode)
                    n_quant = sum(type(m).__name__ == "QuantLinear" for m in other.model.modules())
                    top1, worst, positions = compare(reference, other, args.tokens, loops)
                    print(f"| {name} | {loops} | {mode} | {n_quant if mode != 'float' else '-'} | "
                          f"{100 * top1:.1f}% (n={positions}) | {worst:.3g} | {spread:.3f} |", flush=True)


if __name__ == "__main__":
    main()
