"""The CUDA package without a GPU: launch arithmetic, the compile cache, imports, package data."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from tinyloop.cuda import launch, loader, parity

ROOT = Path(__file__).resolve().parents[2]


def test_block_threads_are_whole_warps_within_the_limit() -> None:
    assert [launch.block_threads(n) for n in (1, 32, 33, 768, 1024, 5280)] == [32, 32, 64, 768, 1024, 1024]
    assert launch.block_threads(300, cap=256) == 256
    with pytest.raises(ValueError):
        launch.block_threads(0)


def test_rmsnorm_rope_swiglu_geometry() -> None:
    assert launch.rmsnorm_launch(32, 5280) == launch.Launch((32, 1, 1), (1024, 1, 1), 0)
    assert launch.rmsnorm_launch(1, 768).block == (768, 1, 1)
    # Huginn: 55 q heads and 55 kv heads of 96: a block per (token, head), a thread per pair
    assert launch.rope_launch(7, 55, 55, 96) == launch.Launch((7, 110, 1), (64, 1, 1), 0)
    with pytest.raises(ValueError):
        launch.rope_launch(1, 4, 4, 63)
    # the KV write: a block per (token, head, K or V), a thread per element of the head
    assert launch.kv_write_launch(3, 55, 96) == launch.Launch((3, 55, 2), (96, 1, 1), 0)
    with pytest.raises(ValueError):
        launch.kv_write_launch(0, 4, 64)
    # int4: a block per (token, K or V), a thread per group of the token's heads (55 x 3 of 32)
    assert launch.kv_write_int4_launch(3, 55, 3) == launch.Launch((3, 2, 1), (192, 1, 1), 0)
    assert launch.kv_write_int4_launch(1, 128, 4).block == (256, 1, 1)  # 512 groups: a stride loop
    small = launch.swiglu_launch(1, 17920)
    assert small.grid == (70, 1, 1) and small.block == (256, 1, 1)  # 17920 / 256 = 70 blocks
    assert launch.swiglu_launch(10**6, 17920).grid[0] == launch.SWIGLU_MAX_BLOCKS  # grid-stride beyond


def test_paged_decode_geometry_and_shared_memory() -> None:
    cfg = launch.paged_decode_launch(32, 55, 96, 3)
    assert cfg.grid == (32, 55, 3) and cfg.block == (launch.ATTN_THREADS, 1, 1)
    assert cfg.shared == 4 * (96 + 128) + 4 * 128  # q and p floats, the tile's pool rows
    assert launch.paged_decode_launch(1, 1, 512, 1).shared <= launch.SHARED_LIMIT
    with pytest.raises(ValueError, match="head_dim"):
        launch.paged_decode_launch(1, 1, 513, 1)
    assert launch.paged_combine_launch(2, 8, 96).block == (96, 1, 1)


def test_splits_fill_the_device_without_short_splits() -> None:
    sms = 132  # H100/H200
    assert launch.decode_splits(1, 12, 4096, sms) == 16  # 12 blocks -> 22 wanted, 4096 keys allow 16
    assert launch.decode_splits(1, 12, 300, sms) == 1  # too short to split
    assert launch.decode_splits(32, 55, 100_000, sms) == 1  # 1760 blocks already fill it
    for max_len, splits in ((1, 1), (129, 2), (4096, 16), (5000, 7)):
        per = launch.keys_per_split(max_len, splits)
        assert per % launch.ATTN_THREADS == 0 and per * splits >= max_len


def test_kernel_constants_match_the_sources() -> None:
    text = loader.source("paged_attention")
    assert f"#define TL_ATTN_THREADS {launch.ATTN_THREADS}" in text
    assert f"#define TL_ATTN_MAX_PER_THREAD {launch.ATTN_MAX_PER_THREAD}" in text


def test_every_kernel_instantiates_each_dtype() -> None:
    names = {"rmsnorm": ["residual_rmsnorm"], "rope": ["rope"], "swiglu": ["swiglu"],
             "paged_attention": ["paged_decode", "paged_decode_combine"], "kv_write": ["kv_write", "kv_write_int4"]}
    assert set(names) == set(loader.KERNELS)
    for source, kernels in names.items():
        text = loader.source_path(source).read_text()
        assert "TL_INSTANTIATE(" in text
        for kernel in kernels:
            assert re.search(rf"void (__launch_bounds__\(\w+\) )?{kernel}_##SUFFIX\(", text), kernel


def test_cache_key_follows_source_arch_and_options() -> None:
    base = loader.cache_key("src", "sm_90", ("-a",))
    assert base == loader.cache_key("src", "sm_90", ("-a",))
    assert len({base, loader.cache_key("src2", "sm_90", ("-a",)), loader.cache_key("src", "sm_80", ("-a",)),
                loader.cache_key("src", "sm_90", ("-b",)), loader.cache_key("src", "sm_90", ("-a", ""))}) == 5
    assert loader.arch_for((9, 0)) == "sm_90"
    opts = loader.compile_options("sm_90", ["/inc"])
    assert "-arch=sm_90" in opts and "-I/inc" in opts


def test_cached_cubin_compiles_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []

    def fake_compile(name: str, arch: str, options: object = None) -> bytes:
        calls.append((name, arch))
        return b"cubin:" + name.encode()
    monkeypatch.setattr(loader, "compile_cubin", fake_compile)
    a = loader.cached_cubin("swiglu", "sm_90", ("-x",), directory=tmp_path)
    b = loader.cached_cubin("swiglu", "sm_90", ("-x",), directory=tmp_path)
    c = loader.cached_cubin("swiglu", "sm_80", ("-x",), directory=tmp_path)
    assert a == b != c and a.read_bytes() == b"cubin:swiglu"
    assert calls == [("swiglu", "sm_90"), ("swiglu", "sm_80")]
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".cubin"]  # no temporary left


def test_cache_dir_and_include_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYLOOP_CUDA_CACHE", str(tmp_path / "c"))
    assert loader.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TINYLOOP_CUDA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert loader.cache_dir() == tmp_path / "tinyloop" / "cuda"
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "cuda_fp16.h").write_text("")
    monkeypatch.setenv("TINYLOOP_CUDA_INCLUDE", str(tmp_path / "inc"))
    assert loader.include_dirs()[0] == str(tmp_path / "inc")
    with pytest.raises(ValueError, match="unknown kernel"):
        loader.source("nope")


def test_importing_the_package_imports_no_cupy() -> None:
    code = ("import sys, tinyloop.cuda, tinyloop.cuda.loader, tinyloop.cuda.kernels, tinyloop.cuda.parity; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_package_data_names_the_kernel_sources() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tinyloop"]
    assert "cuda/*.cu" in data
    sources = sorted(p.stem for p in (ROOT / "tinyloop" / "cuda").glob("*.cu"))
    assert sources == sorted(["common", *loader.KERNELS])


def test_parity_cases_run_on_references_without_a_gpu() -> None:
    """The dry run's path: every case's inputs, references, geometry and comparison (fp32 only
    and the smaller cases here; ``bench/gpu_check.py --dry-run`` runs them all)."""
    cases = parity.cases()
    assert {c.name.split()[0] for c in cases} == {"rmsnorm", "rope", "swiglu", "paged", "backend"}
    for case in cases:
        case.geometry()
    quick = [c for c in cases if "5280" not in c.name and "17920" not in c.name and "2048" not in c.name]
    for case in quick[::3] + [c for c in cases if c.name.startswith("backend")]:
        result = parity.run_case(case, torch.device("cpu"), torch.float32, kernel=False)
        # a verify's tokens: one SDPA call against one a token, rounded a little apart
        assert result.ok and (result.max_err == 0.0 or " T=1 " not in case.name), result


def _gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_writes_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The device script imports and runs on a CPU (the cheap sections; the full dry run takes
    about half a minute: ``python bench/gpu_check.py --dry-run``)."""
    gpu_check = _gpu_check()
    skip = [a for s in ("kernels", "engine", "serve", "decode") for a in ("--skip", s)]
    assert gpu_check.main(["--dry-run", *skip, "--out", str(tmp_path)]) == 0
    assert "all checks passed" in capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["failures"] == 0
    assert (tmp_path / "gpu_check.md").read_text().startswith("| section | check |")


def test_gpu_check_weight_bytes_per_decode_step() -> None:
    gpu_check = _gpu_check()
    c = gpu_check.HUGINN
    layer = 5280 * 3 * 5280 + 5280 * 5280 + 3 * 5280 * 17920  # qkv, o, fc (gate and up), proj
    want = 2 * ((2 + 2 + 4 * 32) * layer + 32 * 2 * 5280 * 5280 + 65536 * 5280)
    assert gpu_check.weight_bytes_per_step(c, 32, torch.bfloat16) == want
    assert 100e9 < want < 110e9  # "about 100 GB per token at batch 1" (issue 14)


def test_gpu_check_reports_the_speed_goals_met_or_missed() -> None:
    """Issue 14's goals read off the decode rows: a fast path meets them, a slow one misses
    them, and neither counts as a parity failure."""
    gpu_check = _gpu_check()
    report = gpu_check.Report(peak=4800.0)
    rates = {("huginn-shape", "32", 1, "eager"): (10.0, 1000.0),
             ("huginn-shape", "32", 1, "kernels+graphs"): (30.0, 3100.0),
             ("huginn-shape", "32", 32, "kernels+graphs"): (600.0, 1900.0),
             ("base100m", "4", 1, "eager"): (500.0, 170.0), ("base100m", "4", 1, "kernels+graphs"): (800.0, 270.0),
             ("base100m", "4", 32, "kernels+graphs"): (8000.0, 85.0)}
    report.rates.update(rates)
    gpu_check.check_goals(report)
    got = {r["check"]: (r["value"], r["note"]) for r in report.rows}
    assert got["huginn-shape loops 32: batch 1 >= 60% of HBM peak"] == ("met", "65%")
    assert got["huginn-shape loops 32: batch 1 >= 2x torch eager"] == ("met", "3.00x")
    assert got["huginn-shape loops 32: batch 32 >= 15x batch 1"] == ("met", "20.0x")
    assert got["base100m loops 4: batch 1 >= 60% of HBM peak"] == ("missed", "6%")
    assert got["base100m loops 4: batch 1 >= 2x torch eager"] == ("missed", "1.60x")
    assert got["base100m loops 4: batch 32 >= 15x batch 1"][0] == "missed"
    assert report.failures == 0
    empty = gpu_check.Report()
    gpu_check.check_goals(empty)
    assert [r["value"] for r in empty.rows] == ["n/a"]
