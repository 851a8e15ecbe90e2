"""TinyLoop's engine against llama.cpp on CPU: same shapes, same threads, one table.

    pip install -e '.[bench-peers]'                       # the gguf package (writes the models)
    python bench/vs_llamacpp.py                            # base100m, loops 1 and 4, 4 rounds, 2 threads
    python bench/vs_llamacpp.py --quick                    # smoke run: small preset, loops 1, 1 round
    python bench/vs_llamacpp.py --only tg1 --weights int8 --loops 1 --rounds 1
        [--preset base100m] [--threads 2] [--rounds 4] [--tokens 64] [--prompt 16] [--pp 512]
        [--only tg1,tg8,pp,quality] [--weights float32 int8 int4 bf16] [--quality-prompts 16] [--cache DIR]
        [--llama-cpp-python 0.3.36]

llama.cpp is built once into a cache directory (``--cache``, else ``$TINYLOOP_PEER_CACHE``, else
``~/.cache/tinyloop-peers``): ``pip download --no-binary :all: llama-cpp-python==VERSION`` (its
sdist vendors llama.cpp), extracted there, configured with CMake (Ninja, Release,
``GGML_NATIVE`` less AMX, OpenMP) into ``CACHE/build`` and built for ``llama-bench``, ``llama-quantize``
and ``llama-batched-bench`` only: 12-20 minutes on 2 cores the first time. Every step whose
output exists is skipped; the build's log is ``CACHE/build.log`` (it ends ``BUILD_DONE <rc>``;
a run that finds a build still writing it waits for it). This is a benchmark only: TinyLoop itself
never downloads or needs any of it.

The model: a ``--preset`` of ``tinyloop.model.presets`` (``base100m``: hidden 768, 12 heads of
64, 12 KV heads, MLP 3072, vocab 32768, tied embeddings; 2 prelude + 4 core x loops + 2 coda
layers; ``--quick``: ``small``). llama.cpp runs a Llama with ``n_prelude + n_core * loops +
n_coda`` layers (the loop unrolled, as in ``engine_vs_hf.py``): random weights (normal, std 0.02;
norms 1) written as a GGUF in float32 with the ``gguf`` package (arch ``llama``, no ``output``
tensor: the head is the tied ``token_embd``; a synthetic SentencePiece-style vocabulary so that it
loads: timing uses random token ids), then ``llama-quantize``d to ``q8_0``, ``q4_0``, ``q4_0
--pure`` (without ``--pure`` the tied head stays ``q6_K``), ``bf16`` and ``f16``. The GGUFs stay
in the cache, named by preset, shape and layer count. Ours adds the loop adapter (a 2H x H matmul
per loop) and the sandwich norms: about 3% more work per token at loops 4.

Pairs (TinyLoop ``Engine(weights=...)`` / llama.cpp type): ``float32``/``f32``, ``int8``/``q8_0``,
``int4``/``q4_0`` and ``q4_0 --pure``, ``bf16`` (our model in ``torch.bfloat16``)/``bf16`` and
``f16``. Measurements, ``--threads`` for both (torch's, our C kernels' and llama.cpp's ``-t``):

- ``tg1``, batch-1 decode: ``llama-bench -p 0 -n TOKENS -r 1 -o json`` (its ``avg_ts``); ours
  ``1 * (TOKENS - 1) / (t(TOKENS) - t(1))`` for a ``--prompt``-token random prompt, greedy, EOS
  ignored, prefix caching off (``engine_vs_hf.py``'s decode rate).
- ``tg8``, batch-8 decode: ``llama-batched-bench -npp PROMPT -ntg TOKENS,1 -npl 8 -c 2048
  --output-format jsonl`` (``speed_tg`` of the ``TOKENS`` run; the 1-token run after it only gives
  llama.cpp's logger thread time to write that line: the process exits without flushing it, and a
  run whose line is lost anyway is repeated); ours 8 random prompts, ``8 * (TOKENS - 1) / ...``.
- ``pp``, prefill of ``--pp`` (512) tokens: ``llama-bench -p 512 -n 0 -r 1 -o json``; ours
  512 / the time of one 512-token prompt with ``max_tokens=1`` (prefix caching off).
- GB/s at batch 1: weight bytes a decode step reads x tokens/s. Ours as ``engine_vs_hf.py``
  counts them; llama.cpp's from the GGUF's tensor sizes (``gguf.GGUFReader``): the layers, the
  final norm and the head (the tied ``token_embd``, read whole once per token). Set against the
  machine's copy bandwidth (``engine_vs_hf.copy_bandwidth``, read + write) in the footer: the
  median of a copy timed in each of the tg1 rounds (best of 3), beside the decodes it is set
  against (this machine's memory speed drifts by a quarter over minutes under other load).

Timing runs in interleaved rounds (``--rounds``): in each, every llama.cpp run of a weight mode and
ours take turns (llama.cpp first in even rounds, ours first in odd ones), so a load that comes and
goes on a shared machine hits both; the table gives the median and the min-max over rounds and
the ratio of the medians (TinyLoop / llama.cpp). Each llama.cpp run is a fresh process with its
own warm-up (the model file stays in the page cache); ours are warmed once per shape. llama.cpp's
threads spin at its barriers: while another process holds one of the cores, a ``--threads 2`` run
of it can fall 10-25x (seen on a 2-core VM: base100m q8_0 at 8 tok/s, 205 a minute later), which
the min-max shows; on a busy machine compare with ``--threads 1``.

Quality (``quality`` in ``--only``): top-1 agreement with our float32 model along its greedy
continuations (teacher-forced: one forward over the reference's tokens, ``engine_vs_hf.top1_picks``)
of ``--quality-prompts`` (16) random prompts (their own seed: the same prompts whatever else
runs), the mean, its standard error and the min-max over the prompts, for our ``int8`` / ``int4`` (and ``bf16``)
engines and for llama.cpp's quantisation schemes applied to our own model (its runtime cannot run
a looped model): every ``nn.Linear`` weight and the tied
embedding/head of a float32 copy replaced by ``gguf.quants.dequantize(gguf.quants.quantize(w,
Q8_0 | Q4_0))``, and every product's input by its ``Q8_0`` round trip, as llama.cpp's runtime
quantises activations for both (a "weights only" row shows what that costs). ``q4_0`` without
``--pure`` keeps the head in ``q6_K``, which ``gguf.quants`` cannot quantise: its row keeps the head
and its input float32 (an upper bound). A random-weights model's logits are nearly flat, so one
rounding flips many argmaxes; the same table follows on the bundled demo model (trained, 4.6M
parameters), along its continuations of 8 Python and addition prompts (``DEMO_TEXTS``). With 16
prompts of 64 tokens one position is 0.001 and the standard error of a mean near 0.97 is ~0.005
(8 prompts: ~0.008; two 8-prompt runs of int8 read 0.980 and 0.961 at loops 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from engine_vs_hf import (
    copy_bandwidth,
    greedy_sequence,
    ours_tokens,
    quant_bytes_per_token,
    top1_picks,
    weight_bytes_per_token,
)
from torch import nn

from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.model.config import ModelConfig
from tinyloop.model.looped import LoopedLM
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.tokenizer import Tokenizer, default_tokenizer, gpt2_tokenizer

PRESET = "base100m"
LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ("llama-bench", "llama-quantize", "llama-batched-bench")
MEASURES = {"tg1": "tg b1", "tg8": "tg b8", "pp": "pp"}
# TinyLoop weights -> the llama.cpp types it is set against: (label, llama-quantize type, --pure)
PAIRS: dict[str, list[tuple[str, str, bool]]] = {
    "float32": [("f32", "f32", False)],
    "int8": [("q8_0", "q8_0", False)],
    "int4": [("q4_0", "q4_0", False), ("q4_0 --pure", "q4_0", True)],
    "bf16": [("bf16", "bf16", False), ("f16", "f16", False)],
}
QUALITY_SEED = 1  # the quality table's random prompts
BUILD_STALE_S = 1800  # a build.log untouched this long belongs to no running build
SLOW_FACTOR = 20  # ours bf16 warm-up this many times float32's: the row is "-"


# ---------------------------------------------------------------------------- llama.cpp build


def cache_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("TINYLOOP_PEER_CACHE") or Path.home() / ".cache" / "tinyloop-peers")


def _run_logged(cmd: Sequence[str | Path], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n")
        out.flush()
        code = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"{cmd[0]} failed ({code}); {log}:\n" + "\n".join(tail))


def _wait_for_other_build(log: Path) -> None:
    """A build.log without ``BUILD_DONE`` written to recently: another run is building; wait."""
    while log.exists() and "BUILD_DONE" not in log.read_text(errors="replace")[-200:] \
            and time.time() - log.stat().st_mtime < BUILD_STALE_S:
        print(f"waiting for the llama.cpp build writing {log} ...", flush=True)
        time.sleep(30)


# Built without its AMX kernels (GCC keeps an explicit -mno-* over what -march=native implies): on
# an Intel Xeon with AMX, this llama.cpp's AMX path (its default "repack" buffers) crashed every
# prompt of more than one token and every batched decode (SIGILL at `tilezero`, or SIGSEGV), so
# the build runs its AVX-512 kernels, repacking included, as on a CPU without AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_llama(cache: Path, version: str, jobs: int) -> Path:
    """``CACHE/build/bin`` with ``TARGETS`` built, each step skipped when its output exists."""
    bin_dir, log = cache / "build" / "bin", cache / "build.log"
    _wait_for_other_build(log)
    if all((bin_dir / t).exists() for t in TARGETS):
        print(f"llama.cpp: {bin_dir}")
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    root = cache / f"llama_cpp_python-{version}"
    if not root.exists():
        sdist = cache / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.exists():
            print(f"downloading the llama-cpp-python {version} sdist (llama.cpp's source) ...", flush=True)
            _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                         f"llama-cpp-python=={version}", "-d", cache], log)
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    src = (root / "vendor" / "llama.cpp").resolve()  # a symlinked -S never settles (its .git is relative)
    build = cache / "build"
    print(f"building llama.cpp into {build} (12-20 min on 2 cores; log {log}) ...", flush=True)
    code = 1
    try:
        if not (build / "build.ninja").exists():
            _run_logged(["cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                         "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
                         "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], log)
        _run_logged(["cmake", "--build", build, f"-j{jobs}", "--target", *TARGETS], log)
        code = 0
    finally:
        with log.open("a") as out:
            out.write(f"BUILD_DONE {code}\n")
    print(f"llama.cpp built in {(time.perf_counter() - t0) / 60:.1f} min")
    return bin_dir


def llama_commit(cache: Path, version: str) -> str:
    """The vendored llama.cpp's commit: git, else the build's build-info.cpp."""
    src = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    try:
        done = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    info = cache / "build" / "common" / "build-info.cpp"
    if info.exists():
        for line in info.read_text().splitlines():
            if "LLAMA_COMMIT" in line and '"' in line:
                return line.split('"')[1]
    return "?"


# ---------------------------------------------------------------------------- GGUF models


def n_layers(config: ModelConfig, loops: int) -> int:
    """Layers of the unrolled Llama: prelude, the core once per loop, coda."""
    return config.n_prelude + config.n_core * loops + config.n_coda


def synthetic_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary llama.cpp loads: ``<unk>``, ``<s>``, ``</s>``, the 256 byte
    tokens, then unique filler pieces; tokens, scores, token types."""
    from gguf import TokenType

    if size < 259:
        raise ValueError(f"a llama vocabulary needs at least 259 tokens, got {size}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]
    types += [TokenType.NORMAL] * (size - len(types))
    return tokens, [-float(i) for i in range(size)], [int(t) for t in types]


def llama_tensors(config: ModelConfig, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """The Llama's tensors in numpy shape order ([out, in]; GGUF lists them reversed)."""
    h, hd, ff = config.hidden, config.head_dim, config.intermediate
    q, kv = config.heads * hd, config.kv_heads * hd
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (config.vocab_size, h))]
    for i in range(layers):
        out += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate.weight", (ff, h)), (f"blk.{i}.ffn_up.weight", (ff, h)),
                (f"blk.{i}.ffn_down.weight", (h, ff))]
    return out + [("output_norm.weight", (h,))]


def write_gguf(path: Path, config: ModelConfig, layers: int, seed: int = 0) -> None:
    """A float32 Llama GGUF with random weights (std 0.02, norms 1), streamed tensor by tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name(f"tinyloop-peer-{layers}l")
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate)
    writer.add_head_count(config.heads)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, scores, types = synthetic_vocab(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    specs = llama_tensors(config, layers)
    for name, shape in specs:
        writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    tmp = path.with_name(path.name + ".tmp")
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shape in specs:
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            writer.write_tensor_data(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
    writer.close()
    os.replace(tmp, path)


def _slug(label: str) -> str:
    return label.replace(" --", "-")


def gguf_path(cache: Path, preset: str, config: ModelConfig, layers: int, label: str) -> Path:
    dims = (config.vocab_size, config.hidden, config.heads, config.kv_heads, config.head_dim, config.intermediate)
    digest = hashlib.sha1(repr(dims).encode()).hexdigest()[:8]
    return cache / "models" / f"{preset}-{digest}-L{layers}-{_slug(label)}.gguf"


def ensure_gguf(cache: Path, bins: Path, preset: str, config: ModelConfig, layers: int, label: str,
                qtype: str, pure: bool, threads: int) -> Path:
    """The GGUF of ``label`` (written or quantised on first use, reused after)."""
    path = gguf_path(cache, preset, config, layers, label)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    f32 = gguf_path(cache, preset, config, layers, "f32")
    if not f32.exists():
        t0 = time.perf_counter()
        write_gguf(f32, config, layers)
        print(f"  wrote {f32.name} ({f32.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t0:.0f} s)",
              flush=True)
    if label == "f32":
        return f32
    tmp = path.with_name(path.name + ".tmp")
    cmd = [str(bins / "llama-quantize"), *(["--pure"] if pure else []), str(f32), str(tmp), qtype, str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-quantize {qtype} failed ({done.returncode}): {done.stderr[-2000:]}")
    os.replace(tmp, path)
    print(f"  quantised {path.name} ({path.stat().st_size / 2**20:.0f} MiB)", flush=True)
    return path


def gguf_bytes_per_token(path: Path) -> int:
    """Weight bytes a batch-1 decode step reads: every layer, the final norm, the head (``output``,
    else the tied ``token_embd``, read whole for the logits); the input row is negligible."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    head = sizes.get("output.weight", sizes["token_embd.weight"])
    return sum(n for name, n in sizes.items() if name.startswith("blk.")) + sizes["output_norm.weight"] + head


# ---------------------------------------------------------------------------- llama.cpp timing


def parse_llama_bench(stdout: str) -> float:
    """``avg_ts`` of ``llama-bench -o json`` (a JSON array, one object per test; one test here)."""
    tests = json.loads(stdout)
    if not tests:
        raise ValueError("llama-bench printed no test")
    return float(tests[0]["avg_ts"])


def parse_batched_bench(text: str, tg: int | None = None, pl: int | None = None) -> float:
    """Batch decode tokens/s of ``llama-batched-bench``: ``speed_tg`` of its first ``--output-format
    jsonl`` line with these ``tg`` and ``pl`` (any, when None), else the ``S_TG t/s`` column of
    such a row of its markdown table."""
    header: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            if tg in (None, row["tg"]) and pl in (None, row["pl"]):
                return float(row["speed_tg"])
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if "S_TG t/s" in cells:
                header = cells
            elif header and len(cells) == len(header) and cells[0].isdigit():
                got = dict(zip(header, cells))
                if tg in (None, int(got["TG"])) and pl in (None, int(got["B"])):
                    return float(got["S_TG t/s"])
    raise ValueError(f"no speed_tg line and no S_TG t/s row (tg {tg}, batch {pl}) in llama-batched-bench's output")


def llama_command(bins: Path, model: Path, measure: str, threads: int, tokens: int, prompt: int,
                  pp: int) -> list[str]:
    """tg8: ``-ntg TOKENS,1``: the second, one-token run (milliseconds) gives llama.cpp's logger thread
    time to write the first one's line before the process exits (it may not flush at exit)."""
    t = str(threads)
    if measure == "tg8":
        return [str(bins / "llama-batched-bench"), "-m", str(model), "-t", t, "-tb", t, "-c", "2048",
                "-npp", str(prompt), "-ntg", f"{tokens},1", "-npl", "8", "--output-format", "jsonl"]
    p, n = ("0", str(tokens)) if measure == "tg1" else (str(pp), "0")
    return [str(bins / "llama-bench"), "-m", str(model), "-t", t, "-p", p, "-n", n, "-r", "1", "-o", "json"]


def llama_rate(cmd: list[str], attempts: int = 3) -> float:
    """Tokens/s of one llama.cpp run. llama-batched-bench prints through llama.cpp's logger, a
    thread its process exits without flushing (its ``common_log_main``): a run whose line never
    came is run again."""
    for attempt in range(attempts):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"{Path(cmd[0]).name} exited {done.returncode}: {done.stderr[-1500:]}")
        try:
            if Path(cmd[0]).name == "llama-batched-bench":
                tg = int(cmd[cmd.index("-ntg") + 1].split(",")[0])
                return parse_batched_bench(done.stdout + "\n" + done.stderr, tg=tg, pl=8)
            return parse_llama_bench(done.stdout)
        except ValueError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- TinyLoop timing


def ours_rate(engine: Engine, measure: str, prompts: list[list[int]], tokens: int, loops: int) -> float:
    """tg: batch * (tokens - 1) / (t(tokens) - t(1)) (engine_vs_hf's decode rate, one sample);
    pp: prompt tokens / the time to a first token."""
    def timed(n: int) -> float:
        t0 = time.perf_counter()
        ours_tokens(engine, prompts, n, loops)
        return time.perf_counter() - t0

    if measure == "pp":
        return len(prompts[0]) / timed(1)
    one = timed(1)
    return len(prompts) * (tokens - 1) / max(timed(tokens) - one, 1e-9)


def make_engine(config: ModelConfig, tokenizer: Tokenizer, mode: str, max_seq_len: int) -> Engine:
    """An engine as ``engine_vs_hf.py`` builds them (prefix caching off); ``bf16``: the model in
    ``torch.bfloat16``, whose weights the engine keeps bfloat16 (``quant.bf16_weights_on_cpu``)."""
    model = init_model(config, seed=0)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    weights = mode if mode in ("int8", "int4") else "float"
    return Engine(model, tokenizer, max_seq_len=max_seq_len, kv_cache_mb=256, prefix_caching=False,
                  weights=weights)


def ours_bytes_per_token(mode: str, config: ModelConfig, engine: Engine, loops: int) -> int:
    if engine.weights != "float":  # int8, int4, and bf16 where the engine chose it
        return quant_bytes_per_token(engine.model, loops)
    total = weight_bytes_per_token(config, engine.model, loops)  # counts the head as float32
    return total - config.vocab_size * config.hidden * (4 - engine.model.head_weight.element_size())


def pick_tokenizer(config: ModelConfig) -> Tokenizer:
    """The GPT-2 tokenizer when the vocabulary is bigger than the default's (timing uses random ids
    below the tokenizer's size either way; the model keeps its full vocabulary and head)."""
    tokenizer = default_tokenizer()
    if config.vocab_size > tokenizer.vocab_size:
        try:
            return gpt2_tokenizer()
        except Exception as exc:
            print(f"(GPT-2 tokenizer unavailable: {exc}; the default one, prompts drawn from its "
                  f"{tokenizer.vocab_size} ids, the head still {config.vocab_size} wide)")
    return tokenizer


# ---------------------------------------------------------------------------- rounds and table


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """Median, min, max."""
    return statistics.median(samples), min(samples), max(samples)


def fmt_spread(samples: Sequence[float] | None) -> str:
    if not samples:
        return "-"
    med, lo, hi = spread(samples)
    return f"{med:.1f} [{lo:.1f}-{hi:.1f}]"


def round_order(runs: list[Any], round_index: int) -> list[Any]:
    """llama.cpp's runs then ours in even rounds, ours first in odd ones (``runs`` lists ours last)."""
    return runs if round_index % 2 == 0 else [runs[-1], *runs[:-1]]


def measure_prompts(measure: str, gen: torch.Generator, vocab: int, prompt: int, pp: int) -> list[list[int]]:
    batch, length = {"tg1": (1, prompt), "tg8": (8, prompt), "pp": (1, pp)}[measure]
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def llama_q_model(model: LoopedLM, qtype: str, head: bool, activations: bool = False) -> LoopedLM:
    """Our float32 ``model``, changed in place: llama.cpp's ``qtype`` (``Q8_0``/``Q4_0``) round trip on
    every ``nn.Linear`` weight (blocks of 32 along a row, as llama.cpp's) and, with ``head``, on the
    tied embedding/head (llama.cpp's ``token_embd``: input rows and logits alike). With
    ``activations``, each of those products' inputs goes through the ``Q8_0`` round trip too, as
    llama.cpp's runtime does (``Q8_0`` is the ``vec_dot_type`` of both): forward pre-hooks on the
    linears and a wrapped ``head``, so the model must run its modules (no C kernels)."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    q8 = GGMLQuantizationType.Q8_0

    def round_trip(w: torch.Tensor, as_: GGMLQuantizationType = kind) -> torch.Tensor:
        flat = w.detach().float().reshape(-1, w.shape[-1]).numpy()
        return torch.from_numpy(quants.dequantize(quants.quantize(flat, as_), as_)).view(w.shape)

    def quantise_input(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (round_trip(args[0], q8), *args[1:])

    with torch.no_grad():
        for m in model.modules():
            if type(m) is nn.Linear and m.weight.shape[-1] % 32 == 0 and m.out_features > 1:
                m.weight.copy_(round_trip(m.weight))
                if activations:
                    m.register_forward_pre_hook(quantise_input)
        if head:
            model.head_weight.copy_(round_trip(model.head_weight))
            if activations:
                plain_head = model.head
                model.head = lambda x: plain_head(round_trip(x, q8))  # type: ignore[method-assign]
    return model


# The bundled demo model's prompts for the trained-model quality table: Python source and addition
# lines, what it was trained on (tinyloop/data/MODEL_CARD.md).
DEMO = Path(__file__).resolve().parents[1] / "tinyloop" / "data" / "demo.tinyloop"
DEMO_TEXTS = ("def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main(argv):\n",
              "class Stack:\n    def __init__(self):\n", "    for key, value in sorted(items.items()):\n",
              "12345+67890=", "def read_config(path):\n    \"\"\"Read",
              "    try:\n        return self._cache[name]\n    except KeyError:\n",
              "with open(filename, 'rb') as f:\n")


@dataclass
class Continuations:
    """A float32 reference's greedy continuations of ``prompts`` at each loops, and its argmax along
    them: what every other model's top-1 is set against (teacher-forced)."""

    prompts: list[list[int]]
    sequences: dict[tuple[int, int], torch.Tensor]  # (loops, prompt index) -> tokens
    picks: dict[tuple[int, int], torch.Tensor]

    @classmethod
    def of(cls, reference: Engine, prompts: list[list[int]], tokens: int, loops_list: list[int]) -> Continuations:
        sequences = {(loops, i): greedy_sequence(reference, p, tokens, loops)
                     for loops in loops_list for i, p in enumerate(prompts)}
        picks = {(loops, i): top1_picks(reference.model, seq, len(prompts[i]), loops)
                 for (loops, i), seq in sequences.items()}
        return cls(prompts, sequences, picks)

    def agreement(self, model: LoopedLM, loops: int) -> list[float]:
        """Per prompt, the share of positions where ``model``'s argmax is the reference's."""
        return [float((top1_picks(model, self.sequences[loops, i], len(p), loops) == self.picks[loops, i])
                      .float().mean()) for i, p in enumerate(self.prompts)]


def quality_rows(cont: Continuations, others: list[tuple[str, Callable[[], LoopedLM]]],
                 loops_list: list[int]) -> list[str]:
    """One row per (loops, model): mean top-1 over the prompts, its standard error (the prompts'
    spread / sqrt(prompts)) and the min-max of the prompts'."""
    rows = []
    for label, build in others:
        try:
            other: LoopedLM | str = build()
        except Exception as exc:  # a row, not the run
            other = f"{type(exc).__name__}: {exc}"
        for loops in loops_list:
            if isinstance(other, str):
                rows.append(f"{loops:>5} | {label:<48} | - ({other})")
                continue
            try:
                got = cont.agreement(other, loops)
                err = statistics.stdev(got) / len(got) ** 0.5 if len(got) > 1 else 0.0
                top1 = f"{statistics.fmean(got):.3f} ± {err:.3f} ({min(got):.3f}-{max(got):.3f})"
            except Exception as exc:  # a row, not the run
                top1 = f"- ({type(exc).__name__}: {exc})"
            rows.append(f"{loops:>5} | {label:<48} | {top1}")
        del other
    return rows


def llama_rows(make_float: Callable[[], LoopedLM], modes: list[str]) -> list[tuple[str, Callable[[], LoopedLM]]]:
    """llama.cpp's schemes on our float32 model, for the modes set against them."""
    def theirs(qtype: str, head: bool, activations: bool = True) -> Callable[[], LoopedLM]:
        return lambda: llama_q_model(make_float().eval(), qtype, head=head, activations=activations)

    rows: list[tuple[str, Callable[[], LoopedLM]]] = []
    if "int8" in modes:
        rows += [("llama.cpp q8_0 (weights and activations)", theirs("Q8_0", True)),
                 ("llama.cpp q8_0 weights only", theirs("Q8_0", True, activations=False))]
    if "int4" in modes:
        rows += [("llama.cpp q4_0 --pure (weights and activations)", theirs("Q4_0", True)),
                 ("llama.cpp q4_0 layers, head f32 (its q6_K)", theirs("Q4_0", False))]
    return rows


def bench_quality(config: ModelConfig, tokenizer: Tokenizer, modes: list[str], engines: dict[str, Engine | str],
                  loops_list: list[int], tokens: int, prompt: int, n_prompts: int,
                  gen: torch.Generator) -> list[str]:
    """The bench's random-weights model: ours quantised and llama.cpp's schemes, ``n_prompts`` random prompts."""
    ref = engines.get("float32")
    reference = ref if isinstance(ref, Engine) else make_engine(config, tokenizer, "float32", prompt + tokens + 8)
    vocab = min(tokenizer.vocab_size, config.vocab_size)
    prompts = torch.randint(0, vocab, (n_prompts, prompt), generator=gen).tolist()
    cont = Continuations.of(reference, prompts, tokens, loops_list)

    def ours(mode: str) -> LoopedLM:
        engine = engines[mode]
        if isinstance(engine, str):
            raise RuntimeError(engine)
        return engine.model

    others = [(f"TinyLoop {m}", partial(ours, m)) for m in ("int8", "int4", "bf16") if m in modes]
    return quality_rows(cont, others + llama_rows(partial(init_model, config, seed=0), modes), loops_list)


def demo_quality(modes: list[str], loops_list: list[int], tokens: int) -> list[str]:
    """The bundled demo model (trained): ours quantised and llama.cpp's schemes on ``DEMO_TEXTS``."""
    from tinyloop.model.artifact import load_artifact

    reference = Engine.load(DEMO, prefix_caching=False)
    prompts = [reference.tokenizer.encode(t) for t in DEMO_TEXTS]
    cont = Continuations.of(reference, prompts, tokens, loops_list)

    def ours(mode: str) -> LoopedLM:
        if mode == "bf16":
            return Engine.load(DEMO, dtype=torch.bfloat16, prefix_caching=False).model
        return Engine.load(DEMO, weights=mode, prefix_caching=False).model

    others = [(f"TinyLoop {m}", partial(ours, m)) for m in ("int8", "int4", "bf16") if m in modes]
    return quality_rows(cont, others + llama_rows(lambda: load_artifact(DEMO).model, modes), loops_list)


class Timings:
    """Per (side, key) the tokens/s of each round."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], list[float]] = {}
        self.failed: dict[tuple[str, str], str] = {}

    def run(self, side: str, key: str, fn: Callable[[], float]) -> None:
        if (side, key) in self.failed:
            return
        try:
            self.samples.setdefault((side, key), []).append(fn())
        except Exception as exc:  # a row, not the run
            self.failed[(side, key)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"

    def cell(self, side: str, key: str) -> str:
        if (side, key) in self.failed:
            return "-"
        return fmt_spread(self.samples.get((side, key)))

    def median(self, side: str, key: str) -> float | None:
        got = self.samples.get((side, key))
        return None if not got or (side, key) in self.failed else statistics.median(got)


@dataclass
class Bench:
    """One run's settings and what its tables collect."""

    args: argparse.Namespace
    preset: str
    config: ModelConfig
    cache: Path
    bins: Path
    vocab: int
    bandwidth: float
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    notes: list[str] = field(default_factory=list)
    gbs_notes: list[str] = field(default_factory=list)

    def llama_models(self, loops: int) -> dict[str, Path | str]:
        """Each llama.cpp type's GGUF at this loop count (or why there is none)."""
        models: dict[str, Path | str] = {}
        for mode in self.args.weights:
            for label, qtype, pure in PAIRS[mode]:
                try:
                    models[label] = ensure_gguf(self.cache, self.bins, self.preset, self.config,
                                                n_layers(self.config, loops), label, qtype, pure, self.args.threads)
                except Exception as exc:  # a row, not the run
                    models[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    self.notes.append(f"loops {loops} llama.cpp {label}: {models[label]}")
        return models

    def rounds(self, live: dict[str, Engine], models: dict[str, Path | str], measure: str,
               prompts: list[list[int]], loops: int) -> Timings:
        """``--rounds`` rounds; in each, per weight mode, llama.cpp's types and ours take turns."""
        a = self.args
        timings = Timings()
        for r in range(a.rounds):
            if measure == "tg1":  # the memory's speed in this round, for the GB/s fractions
                timings.run("copy", "copy", partial(copy_bandwidth, a.copy_mb, 3))
            for mode in a.weights:
                runs: list[tuple[str, str, Callable[[], float]]] = [
                    ("llama", label, partial(llama_rate, llama_command(self.bins, model, measure, a.threads,
                                                                       a.tokens, a.prompt, a.pp)))
                    for label, _, _ in PAIRS[mode] if isinstance(model := models[label], Path)]
                if mode in live:
                    runs = round_order(runs + [("ours", mode, partial(ours_rate, live[mode], measure, prompts,
                                                                      a.tokens, loops))], r)
                for side, key, fn in runs:
                    timings.run(side, key, fn)
        for (side, key), why in timings.failed.items():
            self.notes.append(f"loops {loops} {measure} {side} {key}: {why}")
        return timings

    def rows(self, timings: Timings, live: dict[str, Engine], models: dict[str, Path | str], measure: str,
             loops: int) -> list[str]:
        out = []
        copy = timings.median("copy", "copy") or self.bandwidth
        for mode in self.args.weights:
            ours_bpt = ours_bytes_per_token(mode, self.config, live[mode], loops) if mode in live else 0
            for label, _, _ in PAIRS[mode]:
                mine, theirs = timings.median("ours", mode), timings.median("llama", label)
                ratio = f"{mine / theirs:>5.2f}" if mine and theirs else f"{'-':>5}"
                gbs = ""
                model = models[label]
                if measure == "tg1":
                    g_ours = ours_bpt * mine / 1e9 if mine else None
                    g_llama = gguf_bytes_per_token(model) * theirs / 1e9 if theirs and isinstance(model, Path) \
                        else None
                    gbs = f"{_num(g_ours)} / {_num(g_llama)}"
                    self.gbs_notes.append(f"loops {loops} {mode} {_num(g_ours)} ({_frac(g_ours, copy)}) "
                                          f"vs {label} {_num(g_llama)} ({_frac(g_llama, copy)}); "
                                          f"copy {copy / 1e9:.1f} GB/s")
                out.append(f"{loops:>5} | {MEASURES[measure]:<7} | {mode:<8} | {label:<11} | "
                           f"{timings.cell('ours', mode) if mode in live else '-':>22} | "
                           f"{timings.cell('llama', label):>22} | {ratio} | {gbs}")
        return out

    def warm_up(self, engines: dict[str, Engine | str], measure: str, prompts: list[list[int]],
                loops: int) -> dict[str, Engine]:
        """Warm every engine on this measure's shape; the ones that run (an engine that failed to
        build, errs here, or is ``SLOW_FACTOR`` x slower than float32 is left out, with a note)."""
        live: dict[str, Engine] = {}
        took: dict[str, float] = {}
        for mode in self.args.weights:
            engine = engines[mode]
            if isinstance(engine, str):
                self.notes.append(f"TinyLoop {mode}: {engine}")
                continue
            t0 = time.perf_counter()
            try:
                ours_tokens(engine, prompts, 1 if measure == "pp" else 2, loops)
            except Exception as exc:  # a row, not the run
                self.notes.append(f"TinyLoop {mode} {measure}: {type(exc).__name__}: {exc}")
                continue
            took[mode] = time.perf_counter() - t0
            if mode == "bf16" and "float32" in took and took[mode] > SLOW_FACTOR * took["float32"]:
                self.notes.append(f"TinyLoop bf16 {measure}: warm-up {took[mode]:.1f} s, over {SLOW_FACTOR}x "
                                  f"float32's {took['float32']:.2f} s: not timed")
                continue
            live[mode] = engine
        return live

    def table(self, engines: dict[str, Engine | str], loops_list: list[int], measures: list[str]) -> None:
        print(f"{'loops':>5} | {'measure':<7} | {'TinyLoop':<8} | {'llama.cpp':<11} | {'TinyLoop tok/s':>22} | "
              f"{'llama.cpp tok/s':>22} | {'ratio':>5} | GB/s ours / llama", flush=True)
        for loops in loops_list:
            models = self.llama_models(loops)
            for measure in measures:
                prompts = measure_prompts(measure, self.gen, self.vocab, self.args.prompt, self.args.pp)
                live = self.warm_up(engines, measure, prompts, loops)
                timings = self.rounds(live, models, measure, prompts, loops)
                print("\n".join(self.rows(timings, live, models, measure, loops)), flush=True)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _frac(x: float | None, bandwidth: float) -> str:
    return "-" if x is None else f"{x * 1e9 / bandwidth:.2f}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small preset, loops 1, 1 round, 8 tokens")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help=f"the model's shape (default: {PRESET}; --quick: small)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds; medians and min-max over them")
    ap.add_argument("--loops", type=int, nargs="+", default=None, help="default: 1 and 4 (--quick: 1)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sequence (tg)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (tg)")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens of the prefill measure")
    ap.add_argument("--quality-prompts", type=int, default=16, help="random prompts of the quality table")
    ap.add_argument("--only", default="tg1,tg8,pp,quality", help="comma-separated subset of tg1,tg8,pp,quality")
    ap.add_argument("--weights", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--cache", default=None, help="llama.cpp's source, build and GGUFs "
                    "(default: $TINYLOOP_PEER_CACHE or ~/.cache/tinyloop-peers)")
    ap.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON, help="the sdist vendoring llama.cpp")
    ap.add_argument("--copy-mb", type=int, default=512, help="tensor size for the copy bandwidth")
    args = ap.parse_args()
    args.only = {s.strip() for s in args.only.split(",") if s.strip()}
    if unknown := args.only - {*MEASURES, "quality"}:
        ap.error(f"--only: unknown {', '.join(sorted(unknown))}")
    if args.quick:
        args.rounds, args.tokens, args.copy_mb, args.quality_prompts = 1, 8, 128, 2
    args.loops = args.loops or ([1] if args.quick else [1, 4])
    args.preset = args.preset or ("small" if args.quick else PRESET)
    return args


def main() -> None:
    args = parse_args()
    config = PRESETS[args.preset]
    torch.set_num_threads(args.threads)
    if kernels.available():  # the same threads as torch's (engine_vs_hf.py)
        kernels.set_threads(torch.get_num_threads())
    t_start = time.perf_counter()
    cache = cache_dir(args.cache)
    bins = build_llama(cache, args.llama_cpp_python, jobs=args.threads)
    tokenizer = pick_tokenizer(config)
    measures = [m for m in MEASURES if m in args.only]
    max_seq = max(args.pp if "pp" in args.only else 0, args.prompt + args.tokens) + 8
    engines: dict[str, Engine | str] = {}
    for mode in args.weights:
        try:
            engines[mode] = make_engine(config, tokenizer, mode, max_seq)
        except Exception as exc:  # bf16 may not run: a row, not the run
            engines[mode] = f"{type(exc).__name__}: {exc}"
    layer_note = ", ".join(f"loops {n}: {n_layers(config, n)}" for n in args.loops)
    print(f"{args.preset}: {config.n_prelude}+{config.n_core}xloops+{config.n_coda} layers (llama.cpp: "
          f"{layer_note}), hidden {config.hidden}, vocab {config.vocab_size}; {args.threads} threads, "
          f"{args.rounds} rounds, tg {args.prompt}+{args.tokens} tokens, pp {args.pp}; llama.cpp "
          f"{llama_commit(cache, args.llama_cpp_python)} (llama-cpp-python {args.llama_cpp_python}), "
          f"torch {torch.__version__}", flush=True)
    bench = Bench(args, args.preset, config, cache, bins, min(tokenizer.vocab_size, config.vocab_size),
                  copy_bandwidth(args.copy_mb, 5))
    with torch.inference_mode():
        if measures:
            bench.table(engines, args.loops, measures)
        if bench.notes:
            print("\n".join(f"- {n}" for n in dict.fromkeys(bench.notes)))
        qmodes = [m for m in args.weights if m in ("int8", "int4", "bf16")]
        if "quality" in args.only and qmodes:
            header = f"{'loops':>5} | {'weights':<48} | top-1 mean ± standard error (min-max over prompts)"
            print(f"\nquality: top-1 agreement with our float32 along its greedy continuations of {args.tokens} "
                  f"tokens (teacher-forced), {args.quality_prompts} random prompts; llama.cpp cannot run our "
                  f"looped model, so its quantisers are applied to our weights\n{header}")
            gen = torch.Generator().manual_seed(QUALITY_SEED)
            print("\n".join(bench_quality(config, tokenizer, qmodes, engines, args.loops, args.tokens, args.prompt,
                                         args.quality_prompts, gen)), flush=True)
            print(f"\nquality on the bundled demo model (trained, {DEMO.name}), the same measure along its "
                  f"continuations of {len(DEMO_TEXTS)} Python and addition prompts\n{header}")
            print("\n".join(demo_quality(qmodes, args.loops, args.tokens)))
    print(f"\ncopy bandwidth ({args.copy_mb} MiB tensor, read + write) at the start: {bench.bandwidth / 1e9:.1f} GB/s")
    if bench.gbs_notes:
        print("batch-1 GB/s of weights read (fraction of the copy bandwidth timed in the same rounds):\n"
              + "\n".join(f"  {n}" for n in dict.fromkeys(bench.gbs_notes)))
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
