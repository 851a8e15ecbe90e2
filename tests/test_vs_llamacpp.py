"""bench/vs_llamacpp.py's own pieces: parsing llama.cpp's output (captured from llama-bench and
llama-batched-bench of llama.cpp 0c1e570), the round bookkeeping, the unrolled layer count; with
the ``gguf`` package, the GGUF it writes and llama.cpp's quantisers on our model; with llama.cpp
built in the bench's cache, one tiny model through llama-quantize, llama-bench and
llama-batched-bench. Seconds; no download, no build.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tinyloop.model.presets import PRESETS, init_model

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    bench = str(ROOT / "bench")
    sys.path.insert(0, bench)  # it imports engine_vs_hf, its neighbour, as the bench scripts run
    try:
        spec = importlib.util.spec_from_file_location("vs_llamacpp", ROOT / "bench" / "vs_llamacpp.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks itself up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(bench)


vs = _load()

# llama-bench -m small.gguf -t 2 -p 0 -n 8 -r 1 -o json (stdout)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/tmp/vsl_test.gguf",
    "model_type": "llama ?B all F32",
    "model_size": 43537408,
    "model_n_params": 10884352,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 8,
    "n_depth": 0,
    "test_time": "2026-12-02T07:35:39Z",
    "avg_ns": 348869588,
    "stddev_ns": 0,
    "avg_ts": 22.931205,
    "stddev_ts": 0.000000,
    "samples_ns": [ 348869588 ],
    "samples_ts": [ 22.9312 ]
  }
]
"""

# llama-batched-bench -m small.gguf -t 2 -tb 2 -c 2048 -npp 16 -ntg 8,1 -npl 8 --output-format jsonl (stdout)
BATCHED_JSONL = (
    '{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 8, "pl": 8, "n_kv": 192, '
    '"t_pp": 0.305901, "speed_pp": 418.436035, "t_tg": 0.459188, "speed_tg": 139.376465, "t": 0.765089, '
    '"speed": 250.951187}\n'
    '{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 1, "pl": 8, "n_kv": 136, '
    '"t_pp": 0.311120, "speed_pp": 411.416809, "t_tg": 0.012250, "speed_tg": 653.061218, "t": 0.323370, '
    '"speed": 420.570862}\n')

# llama-batched-bench -m small.gguf -t 1 -tb 1 -c 2048 -npp 16 -ntg 8 -npl 8 (markdown, stdout)
BATCHED_MD = """
llama_batched_bench: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    8 |    192 |    0.058 |  2219.52 |    0.068 |   934.61 |    0.126 |  1522.02 |
"""


def test_parses_llama_bench_json() -> None:
    assert vs.parse_llama_bench(LLAMA_BENCH_JSON) == pytest.approx(22.931205)
    with pytest.raises(ValueError):
        vs.parse_llama_bench("[\n]\n")


def test_parses_batched_bench_jsonl_and_markdown() -> None:
    assert vs.parse_batched_bench(BATCHED_JSONL, tg=8, pl=8) == pytest.approx(139.376465)
    assert vs.parse_batched_bench(BATCHED_JSONL, tg=1) == pytest.approx(653.061218)
    with pytest.raises(ValueError):  # the line of the run asked for was lost (the logger's last line)
        vs.parse_batched_bench(BATCHED_JSONL.splitlines()[1], tg=8, pl=8)
    assert vs.parse_batched_bench(BATCHED_MD, tg=8, pl=8) == pytest.approx(934.61)
    with pytest.raises(ValueError):  # the header alone: the row never came
        vs.parse_batched_bench(BATCHED_MD.rsplit("|    16", 1)[0])


def test_commands_name_the_shapes_and_threads() -> None:
    bins, model = Path("/b"), Path("/m.gguf")
    tg = vs.llama_command(bins, model, "tg1", 2, 64, 16, 512)
    assert tg == ["/b/llama-bench", "-m", "/m.gguf", "-t", "2", "-p", "0", "-n", "64", "-r", "1", "-o", "json"]
    assert vs.llama_command(bins, model, "pp", 2, 64, 16, 512)[5:9] == ["-p", "512", "-n", "0"]
    b8 = vs.llama_command(bins, model, "tg8", 2, 64, 16, 512)
    assert b8[0] == "/b/llama-batched-bench" and b8[b8.index("-npl") + 1] == "8"
    assert b8[b8.index("-npp") + 1] == "16" and b8[b8.index("-ntg") + 1] == "64,1" and b8[b8.index("-tb") + 1] == "2"


def test_median_spread_and_turns() -> None:
    assert vs.spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    assert vs.fmt_spread([3.0, 1.0, 2.0]) == "2.0 [1.0-3.0]"
    assert vs.fmt_spread([]) == "-"
    runs = ["q4_0", "q4_0 --pure", "ours"]
    assert vs.round_order(runs, 0) == runs  # llama.cpp first
    assert vs.round_order(runs, 1) == ["ours", "q4_0", "q4_0 --pure"]  # then ours first
    timings = vs.Timings()
    for rate in (5.0, 7.0, 6.0):
        timings.run("ours", "int8", lambda rate=rate: rate)
    timings.run("llama", "q8_0", lambda: 1 / 0)
    timings.run("llama", "q8_0", lambda: 1.0)  # a failed side stays failed
    assert timings.median("ours", "int8") == 6.0 and timings.cell("ours", "int8") == "6.0 [5.0-7.0]"
    assert timings.median("llama", "q8_0") is None and timings.cell("llama", "q8_0") == "-"


def test_gbs_fractions_use_the_copy_timed_in_the_same_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    speeds = iter([10e9, 30e9, 20e9])  # the memory's speed drifts from round to round
    monkeypatch.setattr(vs, "copy_bandwidth", lambda mb, repeat: next(speeds))
    args = argparse.Namespace(rounds=3, weights=[], threads=1, tokens=4, prompt=4, pp=8, copy_mb=1)
    bench = vs.Bench(args, "tiny", PRESETS["tiny"], Path("/c"), Path("/b"), 100, bandwidth=99e9)
    timings = bench.rounds({}, {}, "tg1", [[1, 2]], 1)
    assert timings.median("copy", "copy") == 20e9  # the median of the rounds', not the start's 99
    assert vs.Bench(args, "tiny", PRESETS["tiny"], Path("/c"), Path("/b"), 100, bandwidth=99e9) \
        .rounds({}, {}, "pp", [[1, 2]], 1).median("copy", "copy") is None  # timed for tg1 only
    assert vs._frac(14.0, 20e9) == "0.70"


def test_unrolled_layers() -> None:
    base = PRESETS["base100m"]
    assert [vs.n_layers(base, n) for n in (1, 4)] == [8, 20]
    assert vs.n_layers(PRESETS["small"], 1) == 10


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert vs.cache_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("TINYLOOP_PEER_CACHE", str(tmp_path / "env"))
    assert vs.cache_dir(None) == tmp_path / "env"
    monkeypatch.delenv("TINYLOOP_PEER_CACHE")
    assert vs.cache_dir(None) == Path.home() / ".cache" / "tinyloop-peers"


def _tiny_gguf(tmp_path: Path) -> tuple[Path, int]:
    config = PRESETS["tiny"]
    layers = vs.n_layers(config, 2)
    path = tmp_path / "tiny-f32.gguf"
    vs.write_gguf(path, config, layers)
    return path, layers


def test_gguf_is_an_unrolled_tied_llama(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    config = PRESETS["tiny"]
    path, layers = _tiny_gguf(tmp_path)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 1 + 9 * layers + 1 and "output.weight" not in tensors  # the head is token_embd
    assert list(tensors["token_embd.weight"].shape) == [config.hidden, config.vocab_size]
    assert list(tensors[f"blk.{layers - 1}.ffn_down.weight"].shape) == [config.intermediate, config.hidden]
    assert list(tensors["blk.0.attn_k.weight"].shape) == [config.hidden, config.kv_heads * config.head_dim]
    block = reader.get_field("llama.block_count")
    assert int(block.parts[block.data[0]][0]) == layers
    per_layer = 4 * (2 * config.hidden + 2 * config.hidden * config.heads * config.head_dim
                     + 2 * config.hidden * config.kv_heads * config.head_dim + 3 * config.hidden * config.intermediate)
    head = 4 * config.vocab_size * config.hidden  # token_embd as the output matrix
    assert vs.gguf_bytes_per_token(path) == layers * per_layer + 4 * config.hidden + head
    tokens, scores, types = vs.synthetic_vocab(config.vocab_size)
    assert len(set(tokens)) == len(tokens) == len(scores) == config.vocab_size
    assert tokens[3 + 0x0A] == "<0x0A>" and types[3 + 0x0A] == int(gguf.TokenType.BYTE)


def test_llama_quantisers_on_our_model() -> None:
    pytest.importorskip("gguf")
    config = PRESETS["tiny"]
    ref = init_model(config, seed=0)
    for head in (True, False):
        model = vs.llama_q_model(init_model(config, seed=0), "Q4_0", head=head)
        for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            if a.ndim == 1 or (name == "embed.weight" and not head):
                assert torch.equal(a, b), name
            else:  # every matrix rounded: changed, within a q4_0 step of its block's largest weight
                assert not torch.equal(a, b) and (a - b).abs().max() < a.abs().max() / 4, name


def test_llama_activation_round_trip_reaches_every_product() -> None:
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    config = PRESETS["tiny"]
    weights_only = vs.llama_q_model(init_model(config, seed=0), "Q8_0", head=True)
    both = vs.llama_q_model(init_model(config, seed=0), "Q8_0", head=True, activations=True)
    linears = [m for m in both.modules() if type(m) is torch.nn.Linear and m.out_features > 1]
    assert linears and all(len(m._forward_pre_hooks) == 1 for m in linears)
    for a, b in zip(weights_only.parameters(), both.parameters()):
        assert torch.equal(a, b)  # the same rounded weights: only the inputs differ
    x = torch.randn(3, config.hidden, generator=torch.Generator().manual_seed(0))
    q8 = gguf.GGMLQuantizationType.Q8_0
    rounded = torch.from_numpy(quants.dequantize(quants.quantize(x.numpy(), q8), q8))
    assert not torch.equal(rounded, x)
    assert torch.equal(both.head(x), weights_only.head(rounded))
    layer = linears[0]
    wide = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(1))
    wide_q = torch.from_numpy(quants.dequantize(quants.quantize(wide.numpy(), q8), q8))
    assert torch.equal(layer(wide), torch.nn.functional.linear(wide_q, layer.weight, layer.bias))


def test_continuations_count_argmax_agreement() -> None:
    config = PRESETS["tiny"]
    tokenizer = vs.pick_tokenizer(config)
    reference = vs.make_engine(config, tokenizer, "float32", 64)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    cont = vs.Continuations.of(reference, prompts, 6, [1, 2])
    assert cont.sequences[2, 1].shape == (1, 3 + 6 - 1) and cont.picks[2, 1].shape == (6,)
    assert cont.agreement(reference.model, 1) == [1.0, 1.0]  # itself
    other = init_model(config, seed=0)
    plain_head = other.head
    other.head = lambda x: -plain_head(x)  # the argmax becomes the argmin: no position agrees
    assert cont.agreement(other, 2) == [0.0, 0.0]
    rows = vs.quality_rows(cont, [("same", lambda: reference.model), ("broken", lambda: 1 / 0)], [1])
    assert rows[0].endswith("| 1.000 ± 0.000 (1.000-1.000)") and "ZeroDivisionError" in rows[1]
    first_only = init_model(config, seed=0)  # agrees along prompt 0's tokens, never along prompt 1's
    first_only.head = lambda x: plain_head(x) * (1 if x.shape[1] == 3 + 6 - 1 + 1 else -1)
    halves = cont.agreement(first_only, 1)
    mean, err = sum(halves) / 2, abs(halves[0] - halves[1]) / 2  # stdev of two / sqrt(2)
    row = vs.quality_rows(cont, [("half", lambda: first_only)], [1])[0]
    assert row.endswith(f"| {mean:.3f} ± {err:.3f} ({min(halves):.3f}-{max(halves):.3f})") and err > 0.1


def test_tiny_model_through_llama_cpp(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    bins = vs.cache_dir(None) / "build" / "bin"
    if not all((bins / t).exists() for t in vs.TARGETS):
        pytest.skip(f"llama.cpp is not built in {bins} (python bench/vs_llamacpp.py --quick builds it)")
    path, _ = _tiny_gguf(tmp_path)
    pure = tmp_path / "tiny-q4_0-pure.gguf"
    subprocess.run([str(bins / "llama-quantize"), "--pure", str(path), str(pure), "q4_0", "1"], check=True,
                   capture_output=True, timeout=60)
    assert vs.gguf_bytes_per_token(pure) < vs.gguf_bytes_per_token(path) / 5
    for measure in ("tg1", "tg8"):
        assert vs.llama_rate(vs.llama_command(bins, pure, measure, 1, 4, 8, 32)) > 0
