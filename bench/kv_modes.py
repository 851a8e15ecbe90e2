"""KV cache modes: bytes per token, capacity, fidelity and decode speed, one table each.

    python bench/kv_modes.py [--threads N] [--tokens 64] [--tps-tokens 16] [--large base100m]

1. Bytes per token at the ~100M preset (``base100m``, default loops, cache_window 1, 2, loops),
   measured on an allocated pool that holds exactly one 2k-token sequence (the formula of
   ``tinyloop.vocabulary`` is checked against it), the cut against full fp16, and how many
   2k-token sequences fit in a 1 GiB KV budget.
2. Fidelity on the ``small`` preset (random init): the full-precision (float32, full mode) greedy
   continuation of ``--tokens`` tokens is fed to each mode (teacher forcing) and its top-1 is
   compared at every step; also the greedy tokens a mode reproduces before its first divergence
   and the largest logit difference. Random models have flat logits (near-ties), so agreement
   here is a floor, not what a trained model sees.
3. Decode tokens/s per mode, one sequence (1 / the median decode step), on ``small`` (during 2,
   context 32..96) and on ``base100m`` (context 128..128+tps-tokens).

``--large`` names the preset tables 1 and 3 use in place of ``base100m`` (the smoke run passes
``small``: the same code paths without building a 100M-parameter model).

On a shared machine pass ``--threads 1``: torch's default threads spin against other processes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from tinyloop.engine.engine import Engine
from tinyloop.model.config import ModelConfig
from tinyloop.model.kvcache import KVPool, SeqKV, slot_count
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer
from tinyloop.vocabulary import KVMode

SEQ_LEN = 2048
BUDGET = 2**30
BLOCK = 16
# (label, mode, pool dtype): full in fp16 and in the model dtype (float32), then the modes.
BYTE_ROWS = [
    ("full fp16", "full", torch.float16),
    ("full fp32", "full", torch.float32),
    ("int4", "int4", torch.float32),
    ("h-mode fp16", "h-mode", torch.float16),
    ("h-mode fp32", "h-mode", torch.float32),
    ("h-mode-fp16-qkv", "h-mode-fp16-qkv", torch.float32),
    ("h-mode+int4", "h-mode+int4", torch.float32),
    ("h-mode-fp16-qkv+int4", "h-mode-fp16-qkv+int4", torch.float32),
]
DECODE_MODES = ["full", "int4", "h-mode", "h-mode-fp16-qkv", "h-mode+int4", "h-mode-fp16-qkv+int4"]


def measured_bytes_per_token(config: ModelConfig, mode: str, dtype: torch.dtype, loops: int,
                             window: int) -> int:
    """Allocate a pool holding exactly one SEQ_LEN-token sequence; its bytes / SEQ_LEN."""
    slots = slot_count(config, loops, window)
    pool = KVPool(config, slots * (SEQ_LEN // BLOCK), BLOCK, dtype=dtype, mode=mode)
    SeqKV(pool, slots).reserve(SEQ_LEN)
    assert pool.free_blocks == 0
    null_block = pool.store.nbytes // (pool.num_blocks + 1)  # the pool's padding block, no token's
    measured = (pool.store.nbytes - null_block) // SEQ_LEN
    elem = torch.empty((), dtype=dtype).element_size()
    assert measured == KVMode.parse(mode).bytes_per_token(config, loops, window, elem)
    return measured


def bytes_table(name: str) -> None:
    config = PRESETS[name]
    loops = config.default_loops
    windows = sorted({1, min(2, loops), loops})
    print(f"KV bytes per token, {name} (hidden {config.hidden}, {config.kv_heads} of "
          f"{config.heads} heads as KV heads, head_dim {config.head_dim}), loops {loops}, "
          f"int4 groups of 32 with fp16 scale + min")
    head = " ".join(f"{'B/tok W=' + str(w):>11}" for w in windows)
    fits = " ".join(f"{'seqs W=' + str(w):>10}" for w in windows)
    print(f"{'mode':<22} {head} {'cut vs full fp16':>16} {fits}   (2k-token sequences in 1 GiB)")
    full16 = {w: measured_bytes_per_token(config, "full", torch.float16, loops, w) for w in windows}
    for label, mode, dtype in BYTE_ROWS:
        per = {w: measured_bytes_per_token(config, mode, dtype, loops, w) for w in windows}
        cut = 1 - per[loops] / full16[loops]
        seqs = [_sequences_in_budget(per[w] // slot_count(config, loops, w), slot_count(config, loops, w))
                for w in windows]
        print(f"{label:<22} " + " ".join(f"{per[w]:>11,}" for w in windows)
              + f" {cut:>16.1%} " + " ".join(f"{n:>10,}" for n in seqs))


def _sequences_in_budget(slot_bytes: int, slots: int) -> int:
    """Whole 2k-token sequences a 1 GiB pool of BLOCK-token blocks holds."""
    blocks = BUDGET // (slot_bytes * BLOCK)
    return blocks // (slots * -(-SEQ_LEN // BLOCK))


@dataclass
class Run:
    top1: list[int]
    logits: torch.Tensor  # [steps, V]
    step_seconds: list[float]  # one per decode step

    @property
    def tokens_per_s(self) -> float:
        """1 / the median step: robust to other processes' bursts on a shared machine."""
        return 1.0 / statistics.median(self.step_seconds)


def forced(engine: Engine, prompt: list[int], tokens: list[int], loops: int) -> Run:
    """Prefill ``prompt``, then decode feeding ``tokens``; top-1 and logits at every step."""
    req = GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=len(tokens) + 1, loops=loops,
                            sampling=SamplingParams(temperature=0, ignore_eos=True))
    seq = engine.start(req)
    try:
        outs = [engine.prefill(seq)]
        steps = []
        for tok in tokens[:-1]:
            seq.pending = tok
            t0 = time.perf_counter()
            outs.append(engine.decode([seq])[0])
            steps.append(time.perf_counter() - t0)
    finally:
        engine.free(seq)
    logits = torch.stack(outs).float()
    return Run(logits.argmax(-1).tolist(), logits, steps)


def greedy(engine: Engine, prompt: list[int], n: int, loops: int) -> list[int]:
    req = GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=n, loops=loops,
                            sampling=SamplingParams(temperature=0, ignore_eos=True))
    return engine.generate(req).tokens


def fidelity_table(n_tokens: int, tps_tokens: int, cpu_kernels: bool = True, large: str = "base100m") -> None:
    tok = default_tokenizer()
    small = init_model(PRESETS["small"], seed=0)
    big = init_model(PRESETS[large], seed=0)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 4096, (32,), generator=gen).tolist()
    loops = PRESETS["small"].default_loops
    ref_engine = Engine(small, tok, kv_cache_mb=64, block_size=BLOCK, cpu_kernels=cpu_kernels)
    ref_tokens = greedy(ref_engine, prompt, n_tokens, loops)
    ref = forced(ref_engine, prompt, ref_tokens, loops)
    big_prompt = torch.randint(0, big.config.vocab_size, (128,), generator=gen).tolist()
    print(f"\nFidelity vs full-precision (float32, full) greedy decoding, small preset, random init, "
          f"loops {loops}, {n_tokens} tokens after a 32-token prompt; decode speed, one sequence; "
          f"decode attention {ref_engine.model.backend.name}")
    print(f"{'mode':<22} {'top-1 agree':>11} {'same greedy':>11} {'max |dlogit|':>12} "
          f"{'logit std':>9} {'tok/s small':>11} {'tok/s ' + large:>14}")
    for mode in DECODE_MODES:
        engine = Engine(small, tok, kv_cache_mb=64, block_size=BLOCK, kv_mode=mode, cpu_kernels=cpu_kernels)
        run = forced(engine, prompt, ref_tokens, loops)
        agree = sum(a == b for a, b in zip(run.top1, ref.top1)) / len(ref.top1)
        own = greedy(engine, prompt, n_tokens, loops)
        same = next((i for i, (a, b) in enumerate(zip(own, ref_tokens)) if a != b), n_tokens)
        diff = float((run.logits - ref.logits).abs().max())
        tps_small = run.tokens_per_s
        big_engine = Engine(big, tok, kv_cache_mb=256, block_size=BLOCK, kv_mode=mode, cpu_kernels=cpu_kernels)
        big_run = forced(big_engine, big_prompt, big_prompt[:tps_tokens + 1], big.config.default_loops)
        tps_big = big_run.tokens_per_s
        print(f"{mode:<22} {agree:>11.1%} {same:>7}/{n_tokens:<3} {diff:>12.4f} "
              f"{float(ref.logits.std()):>9.3f} {tps_small:>11.1f} {tps_big:>14.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens for fidelity")
    parser.add_argument("--tps-tokens", type=int, default=16, help="decode steps timed on the large preset")
    parser.add_argument("--large", default="base100m", choices=sorted(PRESETS),
                        help="the preset of the bytes table and the last speed column")
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                        help="decode attention on torch ops, not the C kernel (TINYLOOP_CPU_KERNELS=0)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with torch.inference_mode():
        bytes_table(args.large)
        fidelity_table(args.tokens, args.tps_tokens, args.cpu_kernels, args.large)
    print(f"\n({time.perf_counter() - t0:.0f} s, {torch.get_num_threads()} torch threads)")


if __name__ == "__main__":
    main()
