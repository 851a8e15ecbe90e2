"""bfloat16 weights on CPU: an Ouro-1.4B-shaped checkpoint converted, loaded and run, against float32.

No published checkpoint can be downloaded here, so one is synthesized: the Ouro-1.4B layout and
sizes (hidden 2048, 24 layers, 16 heads, 16 KV heads, head_dim 128, intermediate 5632, vocab
49152, 4 loops, rope_theta 1e6, 65536 positions, untied head) with random bf16 weights, written
shard by shard (sharded safetensors + index) by a child process, and the tiny Ouro fixture's
byte-level tokenizer (259 ids: the engine masks the checkpoint's other 48893 rows, as for any
padded vocabulary). Then, each in its own child so each peak RSS is its own:

1. ``tinyloop convert --dtype bfloat16`` (seconds, peak RSS);
2. the artifact loaded by ``tinyloop.server.load_engine`` as bfloat16, then (a separate child) as
   float32; for loops 1 and 4 (default exit: the last step): prefill of a 64-token prompt,
   greedy decode of 8 tokens; load seconds, RSS after load, peak RSS, prefill and decode
   tokens/s, and whether every logit over the tokenizer's ids was finite.

One table, and the bf16 / fp32 speed ratios of the same run::

    python bench/bf16_cpu.py --scratch /work/scratch-bench      # the 1.4B shape: ~2.8 GB checkpoint
    python bench/bf16_cpu.py --layers 2 --scratch DIR            # same widths, 2 layers: minutes
    python bench/bf16_cpu.py --quick                             # narrow and shallow: a smoke run

The scratch directory (default: the system's temp dir) holds the checkpoint and the artifact
(~5.6 GB at the default shape) and is removed at the end.
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
from typing import Any

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "checkpoints" / "ouro-tiny"
OURO_1_4B = {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
             "head_dim": 128, "intermediate_size": 5632, "vocab_size": 49152, "total_ut_steps": 4,
             "rope_theta": 1e6, "max_position_embeddings": 65536}
QUICK = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "head_dim": 64, "intermediate_size": 704, "vocab_size": 4096}
PROMPT_TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
               "    for _ in range(n):\n        a, b = b, a + b\n    return a\n")


def layer_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One Ouro layer's tensors by their suffix."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out: dict[str, tuple[int, ...]] = {f"{n}.weight": (h,) for n in (
        "input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")}
    return out | {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                  "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                  "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                  "mlp.down_proj.weight": (h, inter)}


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith(".bias"):  # the exit gate's
        return torch.zeros(shape, dtype=torch.bfloat16)
    if len(shape) == 1:  # norm weights
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


def write_checkpoint(root: Path, cfg: dict[str, Any], layers_per_shard: int) -> int:
    """config, tokenizer and random bf16 weights, one shard in memory at a time; total bytes."""
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(cfg, torch_dtype="bfloat16", layer_types=["full_attention"] * cfg["num_hidden_layers"])
    (root / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURE / name, root / name)
    h, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    groups: list[dict[str, tuple[int, ...]]] = [
        {"model.embed_tokens.weight": (vocab, h)},
        {"lm_head.weight": (vocab, h), "model.norm.weight": (h,), "model.early_exit_gate.weight": (1, h),
         "model.early_exit_gate.bias": (1,)}]
    for first in range(0, n, layers_per_shard):
        groups.append({f"model.layers.{i}.{k}": s for i in range(first, min(n, first + layers_per_shard))
                       for k, s in layer_shapes(cfg).items()})
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _random(name, shape, gen) for name, shape in group.items()}
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(tensors, shard)
        del tensors
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def _rss_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak so far) of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def greedy(engine: Any, prompt: tuple[int, ...], loops: int,
           tokens: int) -> tuple[float, float, float, list[int], bool]:
    """Prefill ``prompt``, then decode ``tokens`` greedy tokens: (start, prefilled, decoded) clock
    readings, the tokens, and whether every logit over the tokenizer's ids was finite."""
    from tinyloop.requests import GenerationRequest

    vocab = engine.tokenizer.vocab_size
    seq = engine.start(GenerationRequest(prompt_tokens=prompt, loops=loops, max_tokens=tokens + 1))
    try:
        t0 = time.perf_counter()
        logits = engine.prefill(seq)
        t1 = time.perf_counter()
        finite = bool(torch.isfinite(logits[:vocab]).all())
        out = []
        for _ in range(tokens):
            seq.pending = int(logits[:vocab].float().argmax())
            out.append(seq.pending)
            logits = engine.decode([seq])[0]
            finite &= bool(torch.isfinite(logits[:vocab]).all())
        t2 = time.perf_counter()
    finally:
        engine.free(seq)
    return t0, t1, t2, out, finite


def run_engine(artifact: Path, dtype: str, loops_list: list[int], prompt_len: int, tokens: int,
               threads: int | None) -> dict[str, Any]:
    """Load ``artifact`` as ``dtype``; per loop count, prefill and greedy decode, timed."""
    from tinyloop.server import load_engine
    from tinyloop.settings import Settings

    if threads:
        torch.set_num_threads(threads)
    max_seq = prompt_len + tokens + 1
    start = time.perf_counter()
    # no prefix caching: the warm-up's prompt would serve the timed prefill
    engine = load_engine(Settings(model_path=str(artifact), dtype=dtype, max_seq_len=max_seq, prefix_caching=False))
    load_s = time.perf_counter() - start
    load_rss, load_peak = _rss_mib("VmRSS"), _rss_mib("VmHWM")
    text = (PROMPT_TEXT * (1 + prompt_len // len(PROMPT_TEXT)))
    prompt = tuple(engine.tokenizer.encode(text)[:prompt_len])
    assert len(prompt) == prompt_len, len(prompt)
    rows = []
    for loops in loops_list:
        greedy(engine, prompt, loops, 2)  # warm-up: the first call of a shape builds its bf16 kernels
        t0, t1, t2, out, finite = greedy(engine, prompt, loops, tokens)
        rows.append({"loops": loops, "prefill_tps": prompt_len / (t1 - t0), "decode_tps": tokens / (t2 - t1),
                     "finite": finite, "tokens": out})
    return {"dtype": str(engine.dtype).removeprefix("torch."), "load_s": load_s, "load_rss": load_rss,
            "load_peak": load_peak, "peak": _rss_mib("VmHWM"), "threads": torch.get_num_threads(), "rows": rows}


def child(argv: list[str]) -> tuple[str, float, float]:
    """Run ``python argv`` in the project root; (its stdout, peak RSS MiB, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"the child failed ({proc.returncode}): {argv}")
    return out, usage.ru_maxrss / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=OURO_1_4B["num_hidden_layers"],
                        help="layers (default 24, Ouro-1.4B's; fewer for a quick run at the same widths)")
    parser.add_argument("--quick", action="store_true", help="narrow and shallow: a smoke run")
    parser.add_argument("--loops", default="1,4", help="loop counts, comma-separated")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens decoded")
    parser.add_argument("--no-fp32", action="store_true", help="skip the float32 comparison")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--scratch", default=None, help="where the temporary checkpoint and artifact go")
    parser.add_argument("--write", metavar="DIR", help=argparse.SUPPRESS)  # the writer child
    parser.add_argument("--run", metavar="ARTIFACT", help=argparse.SUPPRESS)  # an engine child
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = OURO_1_4B | (QUICK if args.quick else {}) | {"num_hidden_layers": 2 if args.quick else args.layers}
    loops = [int(x) for x in args.loops.split(",")]
    if args.write:
        print(write_checkpoint(Path(args.write), cfg, layers_per_shard=4))
        return
    if args.run:
        print(json.dumps(run_engine(Path(args.run), args.dtype, loops, args.prompt, args.tokens, args.threads)))
        return
    if args.scratch:
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    passed = [a for a in sys.argv[1:] if a != "--no-fp32"]
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="bf16-cpu-") as tmp:
        hf, artifact = Path(tmp) / "ouro-synthetic", Path(tmp) / "ouro-synthetic.tinyloop"
        hf.mkdir()
        out, write_peak, write_s = child([__file__, *passed, "--write", str(hf)])
        ckpt_bytes = int(out.split()[-1])
        _, conv_peak, conv_s = child(["-c", "import sys; from tinyloop.cli import main; sys.exit(main(sys.argv[1:]))",
                                      "convert", str(hf), str(artifact), "--dtype", "bfloat16"])
        art_bytes = artifact.stat().st_size
        runs = {}
        for dtype in ("bfloat16",) if args.no_fp32 else ("bfloat16", "float32"):
            out, peak, _ = child([__file__, *passed, "--run", str(artifact), "--dtype", dtype])
            runs[dtype] = json.loads(out.splitlines()[-1]) | {"peak": peak}
    mib = 2**20
    params = ckpt_bytes // 2
    print(f"synthetic Ouro checkpoint (random bf16): hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
          f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads, intermediate {cfg['intermediate_size']}, "
          f"vocab {cfg['vocab_size']} (tokenizer 259 ids), {params / 1e9:.2f}B parameters; "
          f"torch {torch.__version__}, {runs['bfloat16']['threads']} threads")
    print(f"written: {ckpt_bytes / mib:.0f} MiB in {write_s:.0f} s (writer peak RSS {write_peak:.0f} MiB); "
          f"convert --dtype bfloat16: {conv_s:.1f} s, peak RSS {conv_peak:.0f} MiB, artifact {art_bytes / mib:.0f} MiB")
    print(f"prompt {args.prompt} tokens, {args.tokens} greedy tokens decoded; exit: last step")
    print(f"{'dtype':>9} {'load s':>7} {'RSS MiB':>8} {'load peak':>9} {'peak MiB':>8} {'loops':>5} "
          f"{'prefill tok/s':>13} {'decode tok/s':>12} {'finite':>6}")
    for dtype, run in runs.items():
        for row in run["rows"]:
            print(f"{dtype:>9} {run['load_s']:>7.1f} {run['load_rss']:>8.0f} {run['load_peak']:>9.0f} "
                  f"{run['peak']:>8.0f} {row['loops']:>5} {row['prefill_tps']:>13.1f} {row['decode_tps']:>12.2f} "
                  f"{'yes' if row['finite'] else 'NO':>6}")
    if "float32" in runs:
        for bf, fp in zip(runs["bfloat16"]["rows"], runs["float32"]["rows"]):
            same = sum(a == b for a, b in zip(bf["tokens"], fp["tokens"]))
            print(f"loops {bf['loops']}: bf16 / fp32 speed: prefill {bf['prefill_tps'] / fp['prefill_tps']:.2f}x, "
                  f"decode {bf['decode_tps'] / fp['decode_tps']:.2f}x; greedy tokens equal {same}/{len(bf['tokens'])}")
    print("RSS MiB: resident after load; load peak: the peak while loading; peak MiB: the child's peak")


if __name__ == "__main__":
    main()
