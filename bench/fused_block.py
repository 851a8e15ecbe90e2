"""Batch-1 decode with a burst of whole steps as one C call (``FusedStep.burst``, the engine's
default for a lone greedy sequence), with the whole step as one C call (``cpu.step.FusedStep``),
with each block's step as one C call (``cpu.block.FusedBlock``, a stack of them one call), and
with the blocks' modules called one by one: same engine, same process, per weights and KV mode.

    python bench/fused_block.py [--preset base100m] [--weights float int8 int4 bf16]
                                [--kv full int4] [--loops 1 4] [--tokens 64] [--rounds 3] [--threads 2]
                                [--layout preset huginn ouro parcae]

``--layout``: the preset's blocks as they are; ``huginn``, with q and k biases (Huginn-0125's
attention); ``ouro``, ``peri_ln`` blocks with three q/k/v projections (Ouro's); ``parcae``,
``0.5 relu(fc)^2`` MLPs, a weightless RMS norm per q/k head after RoPE and value embeddings on
alternate layers (Parcae's blocks; its diagonal injection has no whole-step call).

For each weights mode (``bf16``: the model in bfloat16, which the engine keeps so) and KV mode, one
engine decodes a 16-token random prompt greedily; ``decode_burst`` is the engine's default for the
"burst" runs and 1 for the others, ``use_cpu_kernels(model, fused=...)`` turns the fused steps on
and off, and the whole-step call is dropped for the "blocks" runs, the four taking turns in every
round. Decode tokens/s = (tokens - 1) / (t(tokens) - t(1)), the median over rounds; "fused" is the
step's rate over the modules', "step/blocks" the whole step's over the blocks', "burst/step" the
burst's over the whole step's (one token a step). The
tokens of the runs of a round are compared too: a random model's flat logits can part them after a
few dozen tokens (the fused SwiGLU rounds its exp as C's ``expf`` does, torch as its vectorised exp
does); ``tests/cpu/test_fused_block.py`` checks every fused step against the modules to 2e-5, and
``tests/cpu/test_fused_step.py`` the whole step against the blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tinyloop.cpu import kernels
from tinyloop.cpu.backend import use_cpu_kernels
from tinyloop.engine.engine import Engine
from tinyloop.engine.plain import DEFAULT_DECODE_BURST
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer, gpt2_tokenizer

LAYOUTS: dict[str, dict[str, object]] = {"preset": {}, "huginn": {"qk_bias": True},
                                         "ouro": {"block_style": "peri_ln", "fused_qkv": False},
                                         "parcae": {"mlp": "relu2", "qk_head_norm": True}}


def decode(engine: Engine, prompt: list[int], n: int, loops: int) -> tuple[float, tuple[int, ...]]:
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate_many([GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=n, loops=loops,
                                                  sampling=greedy)])
    return time.perf_counter() - t0, tuple(out[0].tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="base100m", choices=sorted(PRESETS))
    ap.add_argument("--weights", nargs="+", default=["float", "int8", "int4", "bf16"],
                    choices=["float", "int8", "int4", "bf16"])
    ap.add_argument("--kv", nargs="+", default=["full", "int4"], choices=["full", "int4"])
    ap.add_argument("--loops", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch's and the C kernels' threads")
    ap.add_argument("--layout", nargs="+", default=["preset"], choices=sorted(LAYOUTS))
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("the C kernels cannot be built here")
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels.set_threads(torch.get_num_threads())
    base = PRESETS[args.preset]
    tokenizer = gpt2_tokenizer() if base.vocab_size > default_tokenizer().vocab_size else default_tokenizer()
    prompt = torch.randint(0, min(base.vocab_size, tokenizer.vocab_size), (16,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    print(f"{args.preset}, batch 1, {args.tokens} tokens, {args.rounds} rounds, {torch.get_num_threads()} threads")
    print(f"{'layout':>7} {'weights':>7} {'kv':>5} {'loops':>5} {'burst tok/s':>11} {'step':>7} {'blocks':>7} "
          f"{'modules':>7} {'fused':>6} {'step/blocks':>11} {'burst/step':>10} {'same tokens':>11}")
    kinds = ("burst", "step", "blocks", "modules")
    for layout, weights, kv in [(la, w, kv) for la in args.layout for w in args.weights for kv in args.kv]:
        changes = dict(LAYOUTS[layout])
        if layout == "parcae":  # value embeddings on alternate layers, as the released models have
            changes["value_embeds"] = tuple(range(0, base.n_prelude + base.n_core + base.n_coda, 2))
        model = init_model(base.replace(**changes), seed=0)
        if weights == "bf16":
            model = model.to(torch.bfloat16)
        engine = Engine(model, tokenizer, max_seq_len=args.tokens + 32, kv_cache_mb=256, prefix_caching=False,
                        weights="float" if weights == "bf16" else weights, kv_mode=None if kv == "full" else kv)
        for loops in args.loops:
            rates: dict[str, list[float]] = {kind: [] for kind in kinds}
            same = True
            for round_ in range(args.rounds):
                outs = {}
                for kind in kinds[round_ % 4:] + kinds[:round_ % 4]:
                    engine.decode_burst = DEFAULT_DECODE_BURST if kind == "burst" else 1
                    use_cpu_kernels(engine.model, True, fused=kind != "modules")
                    if kind == "blocks":
                        engine.model.fused_step = None
                    decode(engine, prompt, 2, loops)  # warm
                    one, _ = decode(engine, prompt, 1, loops)
                    full, outs[kind] = decode(engine, prompt, args.tokens, loops)
                    rates[kind].append((args.tokens - 1) / max(full - one, 1e-9))
                same = same and len(set(outs.values())) == 1
            use_cpu_kernels(engine.model, True)
            engine.decode_burst = DEFAULT_DECODE_BURST
            burst, step, blocks, modules = (statistics.median(rates[kind]) for kind in kinds)
            print(f"{layout:>7} {weights:>7} {kv:>5} {loops:>5} {burst:>11.1f} {step:>7.1f} {blocks:>7.1f} "
                  f"{modules:>7.1f} {step / modules:>6.2f} {step / blocks:>11.2f} {burst / step:>10.2f} "
                  f"{'yes' if same else 'no':>11}")


if __name__ == "__main__":
    main()
