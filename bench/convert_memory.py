"""Peak memory of ``tinyloop convert`` on a synthetic sharded Huginn-layout checkpoint (~1 GB).

The converter streams: it reads one tensor, writes its converted copy, and lets both go. This
writes a random checkpoint in the Huginn-0125 layout (the tiny test fixture's config, widened),
sharded like the hub's, then converts it in a child process and reports that child's peak RSS
against the checkpoint's size and its largest tensor. One table::

    python bench/convert_memory.py            # ~1.1 GB fp32 checkpoint
    python bench/convert_memory.py --quick    # ~70 MB, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "checkpoints" / "huginn-tiny"


def shapes(h: int, heads: int, inter: int, vocab: int, layers: dict[str, int],
           block: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Huginn checkpoint of these sizes, by its checkpoint name."""
    out: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (vocab, h), "lm_head.weight": (vocab, h),
        "transformer.adapter.weight": (h, 2 * h), "transformer.ln_f.weight": (h,),
        "freqs_cis": (1, block, 1, h // heads // 2, 2),
    }
    for part, n in layers.items():
        for i in range(n):
            p = f"transformer.{part}.{i}."
            out |= {p + "attn.Wqkv.weight": (3 * h, h), p + "attn.proj.weight": (h, h),
                    p + "attn.qk_bias": (2, 1, heads, h // heads), p + "mlp.fc.weight": (2 * inter, h),
                    p + "mlp.proj.weight": (h, inter)}
            out |= {p + f"norm_{k}.weight": (h,) for k in range(1, 5)}
    return out


def write_checkpoint(root: Path, h: int, heads: int, inter: int, vocab: int, shards: int) -> tuple[int, int]:
    """Write config, tokenizer and sharded weights; (total bytes, largest tensor's bytes)."""
    layers = {"prelude": 2, "core_block": 4, "coda": 2}
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(n_embd=h, n_heads=heads, num_key_value_heads=heads, head_dim=h // heads,
                  intermediate_size=inter, vocab_size=vocab, padded_vocab_size=vocab,
                  n_layers_in_prelude=layers["prelude"], n_layers_in_recurrent_block=layers["core_block"],
                  n_layers_in_coda=layers["coda"], n_layers=sum(layers.values()))
    (root / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURE / name, root / name)
    names = shapes(h, heads, inter, vocab, layers, config["block_size"])
    gen = torch.Generator().manual_seed(0)
    groups = [list(names)[i::shards] for i in range(shards)]
    weight_map, total, largest = {}, 0, 0
    embedding = torch.randn(names["transformer.wte.weight"], generator=gen) * 0.02
    for k, group in enumerate(groups):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for name in group:
            t = embedding if name in ("transformer.wte.weight", "lm_head.weight") else (
                torch.randn(names[name], generator=gen) * 0.02)
            tensors[name] = t.clone() if name == "lm_head.weight" else t  # tied: equal, stored twice
            weight_map[name] = shard
            total += t.numel() * 4
            largest = max(largest, t.numel() * 4)
        save_file(tensors, str(root / shard))
        del tensors
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total, largest


def peak_rss_mib(code: str) -> tuple[float, float]:
    """Run ``code`` in a child Python; (its peak RSS in MiB, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the child failed: {code}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~70 MB checkpoint")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--write", metavar="DIR", help=argparse.SUPPRESS)  # the writer child
    args = parser.parse_args()
    hidden, vocab = (256, 16384) if args.quick else (args.hidden, args.vocab)
    if args.write:
        print(json.dumps(write_checkpoint(Path(args.write), hidden, 16, 4 * hidden, vocab, args.shards)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "huginn-synthetic"
        hf.mkdir()
        # Written by a child: a child forked from a parent holding the tensors would count the
        # parent's pages in its own peak RSS.
        written = subprocess.run([sys.executable, __file__, "--write", str(hf), "--hidden", str(hidden),
                                  "--vocab", str(vocab), "--shards", str(args.shards)],
                                 check=True, capture_output=True, text=True)
        total, largest = json.loads(written.stdout.splitlines()[-1])
        baseline, _ = peak_rss_mib("import torch, tinyloop.convert")
        peak, seconds = peak_rss_mib(
            f"from tinyloop.convert import convert; convert({str(hf)!r}, {str(Path(tmp) / 'out.tinyloop')!r})")
        out_bytes = (Path(tmp) / "out.tinyloop").stat().st_size
    mib = 2**20
    print(f"synthetic Huginn-layout checkpoint: hidden {hidden}, vocab {vocab}, 2+4+2 layers, "
          f"{args.shards} shards, fp32; torch {torch.__version__}")
    print(f"{'checkpoint MiB':>14} {'largest tensor MiB':>18} {'artifact MiB':>12} {'baseline RSS MiB':>16} "
          f"{'peak RSS MiB':>12} {'above baseline':>14} {'/ largest':>9} {'seconds':>7}")
    above = peak - baseline
    print(f"{total / mib:>14.0f} {largest / mib:>18.0f} {out_bytes / mib:>12.0f} {baseline:>16.0f} "
          f"{peak:>12.0f} {above:>14.0f} {above / (largest / mib):>9.2f} {seconds:>7.1f}")
    print("baseline: a child that only imports torch and the converter; 'above baseline' / the largest "
          "tensor near 2 means one tensor read and its converted copy at a time")


if __name__ == "__main__":
    main()
