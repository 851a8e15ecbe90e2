"""Decode tokens/s of an Inkling-2 loop model in the engine against transformers' own, one table.

    python bench/inkling2_vs_hf.py [--quick] [--threads N] [--tokens 32] [--prompt 16]
                                   [--batches 1 8] [--repeat 3]

The shape (``SHAPE``): 12 layers, layers 3-8 looped 2 passes, attention-residual blocks of 3,
hidden 512, 8 heads of 64 (2 KV heads), sliding window 128 beside full layers, 8 experts top-2
of width 512, the default tokenizer's vocabulary; random weights (seed 0) made by transformers'
``Inkling2LoopForCausalLM``, saved, and loaded by ``tinyloop.model.inkling2.load_inkling2``, so
both run the same weights, float32, on the same threads, greedy (EOS ignored), a ``--prompt``-token
random prompt. Decode tokens/s as ``engine_vs_hf.py`` measures it (prefill taken out, best of
``--repeat``, the two taking turns). Needs transformers with ``inkling2_loop`` (5.24 or later).
"""

from __future__ import annotations

import argparse
import tempfile
from functools import partial

import torch
from engine_vs_hf import decode_rates, hf_tokens, ours_tokens

from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.model.inkling2 import load_inkling2
from tinyloop.tokenizer import default_tokenizer

# transformers' text-config names
SHAPE = dict(
    hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    swa_num_attention_heads=8, swa_num_key_value_heads=2, swa_head_dim=64, sliding_window_size=128, d_rel=16,
    rel_extent=128, max_position_embeddings=4096, moe_intermediate_size=512, n_routed_experts=8,
    num_experts_per_tok=2, n_layers_per_attn_res_block=3, loop_layer_index_start=3, loop_layer_index_end=9,
    loop_num_passes=2, loop_gate_rank=16, eos_token_id=None, pad_token_id=None, bos_token_id=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 tokens, one repeat")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per sequence")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=3, help="runs per timing, ours and HF in turn; the fastest counts")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeat = 4, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.available():
        kernels.set_threads(torch.get_num_threads())
    try:
        from transformers.models.inkling2_loop import configuration_inkling2_loop, modeling_inkling2_loop
    except ImportError as exc:
        print(f"transformers with inkling2_loop not available ({exc}): nothing to compare. "
              "Install it with: pip install -e '.[bench]'")
        return
    tokenizer = default_tokenizer()
    shape = dict(SHAPE, vocab_size=tokenizer.vocab_size, unpadded_vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    hf = modeling_inkling2_loop.Inkling2LoopForCausalLM(
        configuration_inkling2_loop.Inkling2LoopTextConfig(**shape)).to(torch.float32).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model, config = load_inkling2(folder)
    engine = Engine(model, tokenizer, max_seq_len=args.prompt + args.tokens + 8, kv_cache_mb=512,
                    prefix_caching=False)
    passes = config.passes
    print(f"Inkling-2 loop: {config.n_layers} layers ({config.loop_start}-{config.loop_end - 1} looped, {passes} "
          f"passes), hidden {config.hidden}, {config.experts} experts top-{config.top_k}, vocab {config.vocab_size}; "
          f"float32, greedy, prompt {args.prompt}, {args.tokens} new tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'passes':>6} {'batch':>5} {'ours tok/s':>10} {'HF tok/s':>9} {'ours/HF':>7}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in args.batches:
            prompts = torch.randint(0, config.vocab_size, (batch, args.prompt), generator=gen).tolist()
            runs = [partial(ours_tokens, engine, prompts, loops=passes), partial(hf_tokens, hf, prompts)]
            ours, theirs = decode_rates(runs, batch, args.tokens, args.repeat)
            print(f"{passes:>6} {batch:>5} {ours:>10.1f} {theirs:>9.1f} {ours / theirs:>7.2f}")


if __name__ == "__main__":
    main()
