"""The GPU check: kernels, engine and server on one NVIDIA device, one table, non-zero on any miss.

    python bench/gpu_check.py              # on a machine with a GPU, CuPy and the NVRTC wheel
    python bench/gpu_check.py --dry-run    # anywhere: the torch references and the plumbing on CPU

Installs nothing. Sections, each a group of rows in the one table (also written to ``$OUT``
as gpu_check.md and gpu_check.json when ``OUT`` is set):

1. compile: every ``tinyloop/cuda/*.cu`` with NVRTC for this device's architecture (a fresh
   cache directory, so it really compiles), seconds each;
2. kernels: each parity case of ``tinyloop.cuda.parity`` (RMSNorm fused with the residual in
   every block style and norm order, RMSNorm alone, RoPE half/interleaved with bias and float32
   compute, SwiGLU, paged decode attention with GQA, gaps and flash-decoding splits) in fp32
   and bf16 against its torch reference; tolerances ``parity.TOLERANCES``;
3. engine: a tiny random model on CUDA through ``Engine`` (plain, a window, chain and tree
   speculation, beam, an exit rule; full and int4 KV) against the same model on the CPU:
   greedy tokens equal, prefill logits within 1e-3; two replicas stepping at once in two
   threads, each on its own stream; the decode step captured as CUDA graphs (torch ops), the
   kernels wired through ``CudaBackend`` and both together (full and int4 KV), each against
   torch eager's tokens; a batch
   sampled on the device against each row alone on the host; the ~100M preset and a small
   model of Huginn's layout (float32) on each of those paths against torch eager on the GPU:
   decode logits teacher-forced on eager's greedy tokens, within 1e-3 of the largest logit,
   top-1 agreement at least 0.9;
4. serve: the bundled demo model loaded by ``load_engine(Settings(device="cuda"))``, torch
   eager and then with ``cuda_kernels`` and ``cuda_graphs``: one request through the in-process
   runtime and one ``POST /v1/completions`` through the HTTP server on 127.0.0.1:0, both against
   the CPU engine's greedy text;
5. decode: tokens/s at batch 1, 8 and 32 for the demo model (loops 4), the ~100M preset (loops
   4 and 8, and batches of 8 and 32 whose rows mix 2, 4 and 8 loops: one graph) and a random
   bf16 model of Huginn-0125's shape (loops 4, 8 and 32), three paths side
   by side: torch eager, the kernels (``CudaBackend``), the kernels with the decode step replayed
   as CUDA graphs (``engine/graphs.py``); with the weight bandwidth each implies (weight bytes
   read per step x steps/s) against the device's HBM peak where known, each path's ratio to
   eager and each batch's to batch 1; and the CUDA kernels one batch-1 decode step launches,
   eager and on the kernels (torch.profiler; a graph replays the kernels').

Bounded: sections past ``--budget`` seconds (default 480) are skipped and reported as skipped.
With ``--dry-run`` every section runs on the CPU with the references standing in for the
kernels (tiny sizes, no timings worth reading): it proves the script, not the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tinyloop.cuda import cupy_available, gpu_available, launch, loader, parity  # noqa: E402
from tinyloop.model.config import ModelConfig  # noqa: E402
from tinyloop.model.presets import PRESETS  # noqa: E402

HBM_PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0}  # GB/s by device name
HUGINN = ModelConfig(vocab_size=65536, hidden=5280, heads=55, kv_heads=55, head_dim=96, intermediate=17920,
                     n_prelude=2, n_core=4, n_coda=2, default_loops=32, max_loops=64, max_position=4096,
                     block_style="sandwich", injection="concat_linear", state_init="randn",
                     rope_style="interleaved", embed_scale=5280 ** 0.5, qk_bias=True, tie_embeddings=False,
                     rope_compute="float32", rope_tables="float32", norm_order="cast_then_weight")


@dataclass
class Report:
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0
    start: float = field(default_factory=time.perf_counter)
    # decode measurements: (model, loops, batch, path) -> (tokens/s, weight GB/s), for the goals
    rates: dict[tuple[str, str, int, str], tuple[float, float]] = field(default_factory=dict)
    peak: float | None = None  # the device's HBM GB/s, where known

    def add(self, section: str, name: str, ok: bool | None, value: str = "", note: str = "") -> None:
        """``ok`` None: a measurement or a skip, not a check."""
        self.rows.append({"section": section, "check": name, "ok": ok, "value": value, "note": note})
        if ok is False:
            self.failures += 1
        mark = "ok" if ok else "FAIL" if ok is False else "-"
        print(f"[{time.perf_counter() - self.start:6.1f}s] {section:<8} {mark:<4} {name:<58} {value} {note}",
              flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def table(self) -> str:
        lines = ["| section | check | result | value | note |", "|---|---|---|---|---|"]
        for r in self.rows:
            mark = "ok" if r["ok"] else "FAIL" if r["ok"] is False else ""
            lines.append(f"| {r['section']} | {r['check']} | {mark} | {r['value']} | {r['note']} |")
        return "\n".join(lines)


def guarded(report: Report, section: str, budget: float, fn: Callable[[], None]) -> None:
    """Run one section unless the budget is spent; an exception is a failure row, not a crash."""
    if report.elapsed() > budget:
        report.add(section, "(section skipped: time budget spent)", None)
        return
    try:
        fn()
    except Exception as exc:  # report and go on: one broken section must not hide the others
        traceback.print_exc()
        report.add(section, f"section raised {type(exc).__name__}", False, str(exc)[:120])


# -- 1. compile -----------------------------------------------------------------------------
def check_compile(report: Report, device: torch.device, dry: bool) -> None:
    arch = loader.arch_for(torch.cuda.get_device_capability(device)) if not dry else "sm_90"
    if not dry and not cupy_available():
        report.add("compile", "CuPy not installed: no kernel compiled (pip install -e '.[cuda]')", False)
        return
    if dry and not cupy_available():
        for name in loader.KERNELS:
            report.add("compile", f"{name}.cu {arch}", None, f"{len(loader.source(name))} chars",
                       "dry run without CuPy: source only")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in loader.KERNELS:
            t = time.perf_counter()
            path = loader.cached_cubin(name, arch, directory=Path(tmp))
            report.add("compile", f"{name}.cu {arch} NVRTC", path.stat().st_size > 0,
                       f"{time.perf_counter() - t:.2f} s", f"{path.stat().st_size} B cubin")


# -- 2. kernels -----------------------------------------------------------------------------
def check_kernels(report: Report, device: torch.device, dry: bool) -> None:
    if not dry and not gpu_available():
        report.add("kernels", "CuPy cannot reach the device: no kernel checked", False)
        return
    for dtype in (torch.float32, torch.bfloat16):
        atol, rtol = parity.TOLERANCES[dtype]
        for case in parity.cases():
            r = parity.run_case(case, device, dtype, kernel=not dry)
            report.add("kernels", f"{case.name} {r.dtype}", r.ok, f"max err {r.max_err:.2e}",
                       f"atol {atol:g} rtol {rtol:g}")


# -- 3. engine ------------------------------------------------------------------------------
def tiny_engine(device: torch.device, kv_mode: str = "full", **options: Any) -> Any:
    from tinyloop.engine.engine import Engine
    from tinyloop.model.presets import init_model
    from tinyloop.tokenizer import default_tokenizer

    model = init_model(PRESETS["tiny"].replace(max_position=256, exit_gate=True), seed=0)
    with torch.no_grad():  # peaked logits: no greedy ties between devices
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return Engine(model.to(device), default_tokenizer(), max_seq_len=256, block_size=8, kv_mode=kv_mode, **options)


def engine_requests() -> list[Any]:
    from tinyloop.requests import GenerationRequest, SamplingParams
    from tinyloop.vocabulary import ExitRule

    greedy = SamplingParams(temperature=0, ignore_eos=True)
    prompt = tuple(range(20, 45))
    return [GenerationRequest(prompt, max_tokens=12, loops=4, sampling=greedy),
            GenerationRequest(prompt, max_tokens=12, loops=4, cache_window=2, sampling=greedy),
            GenerationRequest(prompt, max_tokens=12, mode="speculative", loops=4, sampling=greedy),
            GenerationRequest(prompt, max_tokens=12, mode="tree", loops=4, draft_ahead=2, k_branches=2,
                              sampling=greedy),
            GenerationRequest(prompt, max_tokens=8, mode="beam", num_beams=3, loops=2),
            GenerationRequest(prompt, max_tokens=8, loops=6, sampling=greedy,
                              exit=ExitRule.of("kl", 1e9, min_loops=2, exited_kv="skip"))]


def check_engine(report: Report, device: torch.device, dry: bool) -> None:
    from tinyloop.model.context import PagedContext
    from tinyloop.model.kvcache import SeqKV
    from tinyloop.model.looped import RowSpec

    reqs = engine_requests()
    for mode in ("full", "int4"):
        cpu, dev = tiny_engine(torch.device("cpu"), mode), tiny_engine(device, mode)
        want = [r.tokens for r in cpu.generate_many(reqs)]
        got = [r.tokens for r in dev.generate_many(reqs)]
        report.add("engine", f"tiny {mode} KV: greedy tokens {device.type} = cpu (6 modes)", got == want,
                   f"{sum(map(len, got))} tokens")
        if mode == "full":
            logits = []
            for eng in (cpu, dev):  # one prefill's logits, compared directly
                kv = SeqKV(eng.pool, eng.pool.config.n_prelude + 4 * eng.config.n_core + eng.config.n_coda)
                kv.reserve(25)
                ctx = PagedContext(eng.pool, eng.model.rope, [kv], [0], 25)
                with torch.inference_mode():
                    out = eng.model(torch.arange(20, 45, device=eng.device)[None], ctx, [RowSpec(4, 4)],
                                    last_only=False)
                logits.append(out.logits.float().cpu())
                kv.free()
            err = float((logits[0] - logits[1]).abs().max())
            report.add("engine", f"tiny prefill logits {device.type} vs cpu", err <= 1e-3, f"max err {err:.2e}",
                       "tol 1e-3")
    eager = [r.tokens for r in tiny_engine(device).generate_many(reqs)]
    graphed = tiny_engine(device, cuda_graphs=not dry)
    if dry:  # the graphs' static step, run without capture
        from tinyloop.engine.graphs import DecodeGraphs
        graphed.graphs = DecodeGraphs.of(graphed, capture=False)
    got = [r.tokens for r in graphed.generate_many(reqs)]
    report.add("engine", "tiny fp32 CUDA graphs (torch ops) tokens = eager", got == eager,
               f"{graphed.graphs.replays} replays, {len(graphed.graphs.graphs)} graphs",
               "dry run: the static step, not captured" if dry else f"failed keys {sorted(graphed.graphs.failed)}")
    first = tiny_engine(device, cuda_graphs=not dry)  # both capture their graphs while the other steps
    twin = first.replica()  # its own KV pool, batch, graphs and (on CUDA) stream, on the same weights
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda e: [r.tokens for r in e.generate_many(reqs)], (first, twin)))
    own = dry or (first.stream is not None and twin.stream is not None and first.stream != twin.stream)
    report.add("engine", "two replicas stepping in two threads: tokens = eager", both == [eager, eager] and own,
               "streams " + ("none (cpu)" if first.stream is None else "distinct" if own else "SHARED"))
    check_sampling(report, device)
    check_engine_100m(report, device, dry)
    if dry or not gpu_available():
        report.add("engine", "CudaBackend tokens = torch eager", None, "", "skipped: no kernels")
        return
    eager4 = [r.tokens for r in tiny_engine(device, "int4").generate_many(reqs)]
    for mode, want in (("full", eager), ("int4", eager4)):  # int4: quantized by the KV write kernel
        for graphs in (False, True):
            eng = tiny_engine(device, mode, cuda_kernels=True, cuda_graphs=graphs)
            got = [r.tokens for r in eng.generate_many(reqs)]
            name = "kernels + CUDA graphs" if graphs else "kernels (norms, RoPE, KV write, decode attention)"
            report.add("engine", f"tiny fp32 {mode} KV {name} tokens = eager", got == want,
                       f"{eng.graphs.replays} replays" if graphs else "")


def forced_logits(engine: Any, prompt: list[int], forced: list[int], loops: int, rows: int) -> torch.Tensor:
    """``rows`` sequences of ``prompt`` decoding the ``forced`` tokens: each step's logits
    ``[steps, rows, V]`` on the host (teacher-forced, so every path sees the same inputs)."""
    from tinyloop.requests import GenerationRequest, SamplingParams

    greedy = SamplingParams(temperature=0, ignore_eos=True)
    seqs = [engine.start(GenerationRequest(tuple(prompt), max_tokens=len(forced) + 2, loops=loops, sampling=greedy))
            for _ in range(rows)]
    for s in seqs:
        engine.prefill(s)
    steps = []
    for token in forced:
        for s in seqs:
            s.pending = token
        steps.append(engine.decode(seqs).float().cpu())
    for s in seqs:
        engine.free(s)
    return torch.stack(steps)


def check_engine_100m(report: Report, device: torch.device, dry: bool) -> None:
    """The ~100M preset and a small model of Huginn's layout (q/k bias, interleaved RoPE in
    float32, sandwich norms in the reference order; float32, random weights) on the GPU: decode
    logits with the kernels, with CUDA graphs, and with both, against torch eager's on the same
    device (4 rows, 8 steps teacher-forced on eager's greedy tokens; the dry run: tiny sizes,
    the static step)."""
    from tinyloop.engine.engine import Engine
    from tinyloop.engine.graphs import DecodeGraphs
    from tinyloop.model.backend import TORCH
    from tinyloop.tokenizer import default_tokenizer

    huginn_like = PRESETS["tiny"].replace(qk_bias=True, rope_style="interleaved", rope_compute="float32",
                                          rope_tables="float32", norm_order="cast_then_weight", embed_scale=8.0)
    kernels = None
    if not dry and gpu_available():
        from tinyloop.cuda.backend import CudaBackend
        kernels = CudaBackend()
    for name, config in (("tiny" if dry else "base100m", PRESETS["tiny" if dry else "base100m"]),
                         ("huginn-layout tiny", huginn_like)):
        model = random_model(config, device, torch.float32)
        if config.qk_bias:  # random biases: zero ones would leave the bias add unchecked
            with torch.no_grad():
                g = torch.Generator(device=device).manual_seed(1)
                for pname, p in model.named_parameters():
                    if pname.endswith(("q_bias", "k_bias")):
                        p.normal_(0.0, 0.5, generator=g)
        engine = Engine(model, default_tokenizer(), max_seq_len=256, kv_cache_mb=512)
        prompt, loops = list(range(10, 40)), 4
        first = forced_logits(engine, prompt, [0] * 8, loops, 1)
        forced = [int(t) for t in first[:, 0].argmax(-1)]  # eager's own greedy continuation
        eager = forced_logits(engine, prompt, forced, loops, 4)
        paths = [("graphs (torch ops)", TORCH, DecodeGraphs.of(engine, capture=device.type == "cuda"))]
        if kernels is not None:
            paths += [("kernels", kernels, None),
                      ("kernels + graphs", kernels, DecodeGraphs.of(engine, capture=True))]
        scale = float(eager.abs().max())
        for label, backend, with_graphs in paths:
            engine.model.use_backend(backend)
            engine.graphs = with_graphs
            got = forced_logits(engine, prompt, forced, loops, 4)
            err = float((got - eager).abs().max())
            top1 = float((got.argmax(-1) == eager.argmax(-1)).float().mean())
            report.add("engine", f"{name} fp32 decode logits, {label} vs eager on {device.type}",
                       err <= 1e-3 * max(scale, 1.0) and top1 >= 0.9, f"max err {err:.2e}",
                       f"top-1 agreement {top1:.3f} (>= 0.9); |logits| <= {scale:.2f}; tol 1e-3 x max(|logits|, 1)")
        engine.model.use_backend(TORCH)
        engine.graphs = None


def check_sampling(report: Report, device: torch.device) -> None:
    """A batch sampled where its logits are (``batch_sampling.sample_rows``) against each row
    sampled alone on the host: greedy, penalties, temperature, top-k/p, min-p, seeded draws."""
    from tinyloop.engine.batch_sampling import sample_rows
    from tinyloop.engine.sampling import make_generator, sample_batch, sample_token
    from tinyloop.requests import SamplingParams

    rows, vocab = 32, 65536
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(temperature=0.0 if b % 4 == 0 else 0.7 + 0.05 * b, top_k=(0, 50, 0, 1000)[b % 4],
                             top_p=(1.0, 0.9, 0.95, 1.0)[b % 4], min_p=(0.0, 0.0, 0.05, 0.0)[b % 4],
                             repetition_penalty=1.2 if b % 3 == 0 else 1.0, presence_penalty=0.4 if b % 5 == 0 else 0.0,
                             seed=b) for b in range(rows)]
    history = [list(range(b, b + 20)) for b in range(rows)], [list(range(100 + b, 110 + b)) for b in range(rows)]
    alone = [sample_token(logits[b], params[b], make_generator(b), prompt_tokens=history[0][b],
                          output_tokens=history[1][b]).token_id for b in range(rows)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = logits.to(device)
    got = sample_rows(x, params, [make_generator(b) for b in range(rows)], *history).tolist()
    sync()
    t = time.perf_counter()
    for _ in range(10):
        sample_rows(x, params, [make_generator(b) for b in range(rows)], *history)
    sync()
    same = sum(a == g for a, g in zip(alone, got))
    report.add("engine", f"{rows} rows x {vocab} sampled on {device.type} = each alone on the host", same >= rows - 1,
               f"{same}/{rows} equal", f"{1000 * (time.perf_counter() - t) / 10:.2f} ms a batch; tolerance one row "
               "(another device's reductions round differently)")
    asked = [dataclasses.replace(p, top_logprobs=5) for p in params[:8]]  # sampled and scored on the device
    host = sample_batch(logits[:8], asked, [make_generator(b) for b in range(8)], history[0][:8], history[1][:8])
    dev = sample_batch(x[:8], asked, [make_generator(b) for b in range(8)], history[0][:8], history[1][:8])
    same, err = 0, 0.0
    for h, d in zip(host, dev):
        if h is None or d is None or h.logprob is None or d.logprob is None or h.token_id != d.token_id:
            continue
        same += [i for i, _ in h.logprob.top] == [i for i, _ in d.logprob.top]
        err = max(err, abs(h.logprob.logprob - d.logprob.logprob),
                  *(abs(u - v) for (_, u), (_, v) in zip(h.logprob.top, d.logprob.top)))
    report.add("engine", f"8 logprob rows (top 5) sampled on {device.type} = the host", same >= 7 and err <= 1e-4,
               f"{same}/8 same token and top ids, max logprob err {err:.1e}", "tol 1e-4; one row may differ (rounding)")


# -- 4. serve -------------------------------------------------------------------------------
def check_serve(report: Report, device: torch.device, dry: bool) -> None:
    from tinyloop.requests import GenerationRequest, SamplingParams
    from tinyloop.server import load_engine
    from tinyloop.settings import Settings

    cpu = load_engine(Settings(device="cpu"))
    prompt = "The capital of France is"
    ids = tuple(cpu.tokenizer.encode(prompt))
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    want = cpu.generate(GenerationRequest(ids, max_tokens=16, sampling=greedy))
    paths = [("torch eager", {})]
    if not dry and gpu_available():
        paths.append(("kernels + graphs", {"cuda_kernels": True, "cuda_graphs": True}))
    for label, options in paths:
        settings = Settings(device=device.type, port=0, host="127.0.0.1", **options)
        serve_once(report, device, label, settings, load_engine(settings), prompt, ids, want)


def serve_once(report: Report, device: torch.device, label: str, settings: Any, engine: Any, prompt: str,
               ids: tuple[int, ...], want: Any) -> None:
    import trio

    from tinyloop.requests import GenerationRequest, SamplingParams

    greedy = SamplingParams(temperature=0, ignore_eos=True)

    async def main() -> tuple[Any, int, str]:
        import httpx

        from tinyloop.actors.runtime import open_runtime
        from tinyloop.http.serve import serve_http
        from tinyloop.http.service import ServedModel

        served = ServedModel.from_engine(engine, settings)
        async with trio.open_nursery() as nursery, open_runtime(engine, settings) as rt:
            result = await rt.submit(GenerationRequest(ids, max_tokens=16, sampling=greedy))
            binds = await nursery.start(partial(serve_http, rt, served, settings))
            async with httpx.AsyncClient(base_url=binds[0], timeout=120) as client:
                resp = await client.post("/v1/completions", json={
                    "model": served.id, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True})
            nursery.cancel_scope.cancel()
        text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
        return result, resp.status_code, text

    async def bounded() -> tuple[Any, int, str]:
        with trio.fail_after(300):
            return await main()

    result, status, text = trio.run(bounded)
    report.add("serve", f"demo model runtime.submit on {device.type}, {label}: text = cpu greedy",
               result.tokens == want.tokens, repr(result.text[:30]))
    report.add("serve", f"POST /v1/completions on {device.type}, {label}: 200, text = cpu greedy",
               status == 200 and text == want.text, f"status {status}", repr(text[:30]))


# -- 5. decode speed ------------------------------------------------------------------------
def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> Any:
    """Random weights made on the device (a 4B-parameter CPU init would take minutes)."""
    from tinyloop.model.presets import empty_model

    model = empty_model(config, device).to_empty(device=device)
    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("q_bias", "k_bias")):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.to(dtype).eval()


def weight_bytes_per_step(config: ModelConfig, loops: int, dtype: torch.dtype) -> int:
    """Weight bytes one decode step reads: every layer application's weights, the adapter once
    per loop, the head once (the embedding row is negligible)."""
    c = config
    size = torch.empty((), dtype=dtype).element_size()
    layer = c.hidden * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.hidden + 3 * c.hidden * c.intermediate
    adapter = 2 * c.hidden * c.hidden if c.injection == "concat_linear" else 0
    return size * ((c.n_prelude + c.n_coda + c.n_core * loops) * layer + loops * adapter + c.vocab_size * c.hidden)


def decode_rate(engine: Any, batch: int, loops: int | tuple[int, ...], tokens: int, prompt_len: int,
                sync: Callable[[], None]) -> float:
    """Decode tokens/s of ``batch`` sequences: generate ``tokens`` and 1 token, subtract. A tuple
    of ``loops``: the rows take them in turn (a batch of mixed loop counts)."""
    from tinyloop.requests import GenerationRequest, SamplingParams

    greedy = SamplingParams(temperature=0, ignore_eos=True)

    def run(n: int) -> float:
        cycle = loops if isinstance(loops, tuple) else (loops,)
        reqs = [GenerationRequest(tuple((7 * b + i) % 200 + 10 for i in range(prompt_len)), max_tokens=n,
                                  loops=cycle[b % len(cycle)], sampling=greedy) for b in range(batch)]
        sync()
        t = time.perf_counter()
        engine.generate_many(reqs)
        sync()
        return time.perf_counter() - t
    run(2)  # warm-up: allocator, cuBLAS handles, kernel modules
    wall_n, wall_1 = run(tokens), run(1)
    return batch * (tokens - 1) / max(wall_n - wall_1, 1e-9)


def launches_per_step(engine: Any, loops: int) -> int | None:
    """CUDA kernels in one batch-1 decode step (after a warm-up step), by torch.profiler; None
    where the profiler cannot say."""
    from torch.profiler import ProfilerActivity, profile

    from tinyloop.requests import GenerationRequest, SamplingParams

    try:
        seq = engine.start(GenerationRequest(tuple(range(10, 26)), max_tokens=4, loops=loops,
                                             sampling=SamplingParams(temperature=0)))
        seq.pending = int(engine.prefill(seq).argmax())
        seq.pending = int(engine.decode([seq])[0].argmax())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.decode([seq])
            torch.cuda.synchronize()
        engine.free(seq)
        kinds = ("memcpy", "memset")
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.lower().startswith(kinds))
    except Exception:  # a profiler without CUPTI: the row says n/a
        traceback.print_exc()
        return None


def check_decode(report: Report, device: torch.device, dry: bool, budget: float) -> None:
    """Three paths side by side on one engine: torch eager, the kernels, the kernels with the
    decode step replayed as CUDA graphs (the dry run: torch ops, the graphs' static step)."""
    from tinyloop.engine.engine import Engine
    from tinyloop.engine.graphs import DecodeGraphs
    from tinyloop.model.backend import TORCH
    from tinyloop.server import load_engine
    from tinyloop.settings import Settings
    from tinyloop.tokenizer import default_tokenizer

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = report.peak = next((v for k, v in HBM_PEAK_GBS.items() if k in name), None)
    dtype = torch.bfloat16 if not dry else torch.float32
    demo = load_engine(Settings(device=device.type, dtype="bfloat16" if not dry else None))
    # a tuple of loop counts: a batch whose rows take them in turn (batch 1: the first alone)
    plans: list[tuple[str, Callable[[], Any], list[int | tuple[int, ...]], int]] = [
        ("demo", lambda: demo, [4] if not dry else [4, (2, 4)], 64 if not dry else 4)]
    if not dry:
        plans.append(("base100m", lambda: Engine(random_model(PRESETS["base100m"], device, dtype),
                                                 default_tokenizer(), max_seq_len=256, kv_cache_mb=4096),
                      [4, 8, (2, 4, 8)], 32))
        plans.append(("huginn-shape", lambda: Engine(random_model(HUGINN, device, dtype), default_tokenizer(),
                                                     max_seq_len=128, kv_cache_mb=16384), [4, 8, 32], 8))
    kernels = None
    if not dry and gpu_available():
        from tinyloop.cuda.backend import CudaBackend
        kernels = CudaBackend()
    batches = (1, 8, 32) if not dry else (1, 2)
    for label, make, loop_counts, tokens in plans:
        if report.elapsed() > budget:
            report.add("decode", f"{label} (skipped: time budget spent)", None)
            continue
        engine = make()
        config = engine.config
        graphs = DecodeGraphs.of(engine, capture=device.type == "cuda")
        paths: list[tuple[str, Any, Any]] = [("eager", TORCH, None)]
        if kernels is not None:
            paths += [("kernels", kernels, None), ("kernels+graphs", kernels, graphs)]
        else:
            paths.append(("graphs (torch ops)" if not dry else "static step", TORCH, graphs))
        for loops in loop_counts:
            rates: dict[tuple[str, int], float] = {}
            mixed = isinstance(loops, tuple)
            for batch in batches if not mixed else batches[1:]:
                for pname, backend, with_graphs in paths:
                    shown = "/".join(map(str, loops)) if isinstance(loops, tuple) else str(loops)
                    row = f"{label} {str(engine.dtype)[6:]} loops {shown} batch {batch} {pname}"
                    if report.elapsed() > budget:
                        report.add("decode", row, None, "", "skipped: time")
                        continue
                    engine.model.use_backend(backend)
                    engine.graphs = with_graphs
                    rate = rates[(pname, batch)] = decode_rate(engine, batch, loops, tokens, 16, sync)
                    most = max(loops) if isinstance(loops, tuple) else loops  # weights read a step: the longest row's
                    gbs = weight_bytes_per_step(config, most, engine.dtype) * rate / batch / 1e9
                    note = f"{gbs:.0f} GB/s weights" + (f", {100 * gbs / peak:.0f}% of {peak:.0f}" if peak else "")
                    if pname != "eager" and ("eager", batch) in rates:
                        note += f"; {rate / rates[('eager', batch)]:.2f}x eager"
                    if batch != 1 and (pname, 1) in rates:
                        note += f"; {rate / rates[(pname, 1)]:.1f}x batch 1"
                    report.add("decode", row, None, f"{rate:.1f} tok/s", note)
                    report.rates[(label, shown, batch, pname)] = (rate, gbs)
        if device.type == "cuda" and report.elapsed() <= budget:  # where a batch-1 step's time goes
            for pname, backend, _ in paths[:2]:
                engine.model.use_backend(backend)
                engine.graphs = None
                count = launches_per_step(engine, loop_counts[0] if isinstance(loop_counts[0], int) else 4)
                report.add("decode", f"{label} loops {loop_counts[0]} batch 1 {pname}: kernels a step", None,
                           "n/a" if count is None else str(count), "torch.profiler's CUDA kernels in one decode step "
                           "(a graph replays the kernels path's)")
        engine.model.use_backend(TORCH)
        engine.graphs = None
        del engine, graphs
        if device.type == "cuda":
            torch.cuda.empty_cache()


def check_goals(report: Report) -> None:
    """Issue 14's speed goals against the decode rows, for each model and loop count measured on
    the kernels with CUDA graphs: batch 1 at >= 60% of HBM peak, >= 2x torch eager at batch 1,
    batch 32 >= 15x batch 1. Reported as met or missed (measurements, not parity checks)."""
    best = "kernels+graphs"
    runs = sorted({(m, loops) for m, loops, _, p in report.rates if p == best})
    if not runs:
        report.add("goals", "speed goals", None, "n/a", "no kernels + graphs decode rows (a dry run, or no CuPy)")
        return
    for model, loops in runs:
        one, eager, many = (report.rates.get(k) for k in ((model, loops, 1, best), (model, loops, 1, "eager"),
                                                          (model, loops, 32, best)))
        name = f"{model} loops {loops}"
        if one and report.peak:
            share = one[1] / report.peak
            report.add("goals", f"{name}: batch 1 >= 60% of HBM peak", None,
                       "met" if share >= 0.6 else "missed", f"{100 * share:.0f}%")
        if one and eager:
            report.add("goals", f"{name}: batch 1 >= 2x torch eager", None,
                       "met" if one[0] >= 2 * eager[0] else "missed", f"{one[0] / eager[0]:.2f}x")
        if one and many:
            report.add("goals", f"{name}: batch 32 >= 15x batch 1", None,
                       "met" if many[0] >= 15 * one[0] else "missed", f"{many[0] / one[0]:.1f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU only: references stand in for the kernels")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds after which sections are skipped")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["compile", "kernels", "engine", "serve", "decode", "goals"],
                    help="leave a section out (repeatable)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_check.md/.json (default $OUT)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device. Use --dry-run to check the script on a CPU.", file=sys.stderr)
        return 2
    # Without CuPy the torch-eager sections still run; the kernel sections then fail, loudly.
    torch.manual_seed(0)
    device = torch.device("cpu" if dry else "cuda")
    report = Report()
    env = f"torch {torch.__version__}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env += (f", CUDA {torch.version.cuda}, {props.name} sm_{props.major}{props.minor}, "
                f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
        torch.backends.cuda.matmul.allow_tf32 = False  # parity in fp32 means fp32
    report.add("env", "device", None, env, "DRY RUN on CPU: no GPU result" if dry else "")
    report.add("env", "launch geometry of every parity case", all(c.geometry() is not None for c in parity.cases()),
               f"{len(parity.cases())} cases", f"attention tile {launch.ATTN_THREADS}")
    sections: list[tuple[str, Callable[[], None]]] = [
        ("compile", lambda: check_compile(report, device, dry)),
        ("kernels", lambda: check_kernels(report, device, dry)),
        ("engine", lambda: check_engine(report, device, dry)),
        ("serve", lambda: check_serve(report, device, dry)),
        ("decode", lambda: check_decode(report, device, dry, args.budget)),
        ("goals", lambda: check_goals(report)),
    ]
    for name, fn in sections:
        if name not in args.skip:
            guarded(report, name, args.budget, fn)
    verdict = f"{report.failures} failure(s)" if report.failures else "all checks passed"
    table = report.table()
    print("\n" + table + f"\n\n{verdict} in {report.elapsed():.0f} s{' (DRY RUN)' if dry else ''}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(table + f"\n\n{verdict}\n")
        (out / "gpu_check.json").write_text(json.dumps({"dry_run": dry, "failures": report.failures,
                                                        "rows": report.rows}, indent=1))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
