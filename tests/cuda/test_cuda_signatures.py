"""Every wrapper in ``tinyloop/cuda/kernels.py`` launches its kernel with the arguments the
``.cu`` source declares: as many, in order, each of the declared kind (a pointer as a 64-bit
address, ``int`` as int32, ``long long`` as int64, ``float`` as float32). CuPy passes a raw
kernel's arguments by position with no check of its own, so a missing or mistyped argument
would shift every later one on a GPU. Runs without CuPy or a GPU: the launches are captured
(CPU tensors stand in for the device's; only their addresses are taken). Where nvcc is
installed the compiled entry points are checked too: their parameters' PTX types and sizes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tinyloop.cuda import kernels, loader

KINDS = {"pointer": np.uint64, "int": np.int32, "long long": np.int64, "float": np.float32}
PTX_TYPES = {np.uint64: ("u64", "b64", "s64"), np.int64: ("u64", "b64", "s64"), np.int32: ("u32", "b32", "s32"),
             np.float32: ("f32",)}
NVCC = shutil.which("nvcc")


def declared(module: str, kernel: str) -> list[str]:
    """The parameter kinds of ``kernel``'s ``extern "C"`` entry point in ``module``'s source."""
    text = loader.source(module).replace("\\\n", " ")
    found = re.search(rf'extern "C" __global__ void (?:__launch_bounds__\(\w+\) )?{kernel}_##SUFFIX\(([^)]*)\)', text)
    assert found, f"{kernel} not in {module}.cu"
    kinds = []
    for param in (p.strip() for p in found.group(1).split(",")):
        words = " ".join(param.split()[:-1])  # the type without the name
        kinds.append("pointer" if "*" in param else words.replace("const ", ""))
    return kinds


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, tuple[Any, ...]]]:
    seen: list[tuple[str, str, tuple[Any, ...]]] = []
    monkeypatch.setattr(kernels, "_run", lambda module, kernel, dtype, cfg, args, device:
                        seen.append((module, kernel, args)))
    return seen


_ptx: dict[str, list[str]] = {}


def compiled(kernel: str, tmp: Path) -> list[str]:
    """The parameter types of ``kernel``'s fp32 entry as nvcc compiles it (``.param .u64`` ...)."""
    if not _ptx:
        (tmp / "all.cu").write_text(loader.bundle(loader.KERNELS))
        done = subprocess.run([str(NVCC), "-arch=sm_90", "-ptx", "-o", str(tmp / "all.ptx"), str(tmp / "all.cu")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        for name, params in re.findall(r"\.entry (\w+)\(([^)]*)\)", (tmp / "all.ptx").read_text()):
            _ptx[name] = re.findall(r"\.param \.(\w+)", params)
    return _ptx[f"{kernel}_f32"]


def check(launches: list[tuple[str, str, tuple[Any, ...]]], names: list[str], ptx_dir: Path | None = None) -> None:
    """Each captured launch against its source's declaration, and with ``ptx_dir`` (nvcc
    installed) against the compiled entry's parameters."""
    assert [k for _, k, _ in launches] == names
    for module, kernel, args in launches:
        kinds = declared(module, kernel)
        assert len(args) == len(kinds), f"{kernel}: {len(args)} arguments for {len(kinds)} parameters"
        for i, (arg, kind) in enumerate(zip(args, kinds)):
            assert type(arg) is KINDS[kind], f"{kernel} argument {i}: {type(arg).__name__} for a {kind}"
        if ptx_dir is not None:
            params = compiled(kernel, ptx_dir)
            assert len(params) == len(args), f"{kernel}: {len(args)} arguments for {len(params)} compiled"
            for i, (arg, ptx) in enumerate(zip(args, params)):
                assert ptx in PTX_TYPES[type(arg)], f"{kernel} argument {i}: {type(arg).__name__} for .{ptx}"
    launches.clear()


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """Where nvcc's PTX of every kernel goes (None without nvcc: the source check alone)."""
    return tmp_path_factory.mktemp("ptx") if NVCC else None


def test_the_parser_reads_every_parameter() -> None:
    assert declared("swiglu", "swiglu") == ["pointer", "pointer", "long long", "int", "long long"]


def test_norm_rope_swiglu_and_kv_write_wrappers(launches: list[tuple[str, str, tuple[Any, ...]]],
                                                 ptx_dir: Path | None) -> None:
    x, a, w = torch.randn(3, 64), torch.randn(3, 64), torch.ones(64)
    kernels.residual_rmsnorm(x, a, w, w, "sandwich", 1e-6, False)
    kernels.residual_rmsnorm(x, a, w, None, "post_ln", 1e-6, True)
    kernels.rms_norm(x, w, 1e-6, cast_first=False)
    check(launches, ["residual_rmsnorm"] * 3, ptx_dir)
    qkv = torch.randn(4, 10, 32)
    q, k = qkv[:, :6], qkv[:, 6:8]
    cos, sin = torch.randn(4, 32), torch.randn(4, 32)
    kernels.rope_(q, k, cos, sin, "half", torch.randn(6, 32), torch.randn(2, 32), compute_float32=True)
    kernels.rope_(q, None, cos, sin, "interleaved")
    kernels.rope_(q, k, cos, sin, "half", out=(torch.empty(4, 6, 32), torch.empty(4, 2, 32)))
    kernels.swiglu(torch.randn(5, 2 * 48))
    v = qkv[:, 8:]
    rows = torch.tensor([[1, 0], [4, 0], [8, 0], [2, 0]])[:, 0]  # a strided column, as a context's table
    kernels.kv_write(k, v, torch.zeros(9, 2, 32), torch.zeros(9, 2, 32), rows)
    int4 = [(torch.zeros(9, 2, 16, dtype=torch.uint8), torch.zeros(9, 2, 2, 2, dtype=torch.float16)) for _ in "kv"]
    kernels.kv_write_int4(k, v, int4[0], int4[1], rows, group=16)
    check(launches, ["rope"] * 3 + ["swiglu", "kv_write", "kv_write_int4"], ptx_dir)


@pytest.mark.parametrize("pool", ["plain", "int4"])
def test_paged_attention_wrappers(pool: str, launches: list[tuple[str, str, tuple[Any, ...]]],
                                  ptx_dir: Path | None) -> None:
    rows, hq, hkv, d, bs = 2, 4, 2, 64, 16
    if pool == "plain":
        k_store: kernels.KVStoreArg = torch.randn(64, hkv, d)
        v_store: kernels.KVStoreArg = torch.randn(64, hkv, d)
    else:
        codes, meta = (64, hkv, d // 2), (64, hkv, d // 32, 2)  # group 32
        k_store = (torch.zeros(codes, dtype=torch.uint8), torch.zeros(meta, dtype=torch.float16))
        v_store = (torch.zeros(codes, dtype=torch.uint8), torch.zeros(meta, dtype=torch.float16))
    tables = torch.tensor([[0, 1], [2, 3]])
    lens = torch.tensor([5, 20])
    name = "paged_decode" if pool == "plain" else "paged_decode_int4"
    kernels.paged_decode_attention(torch.randn(rows, hq, d), k_store, v_store, tables, lens, bs, splits=1, max_len=32)
    kernels.paged_decode_attention(torch.randn(rows, hq, d), k_store, v_store, tables, lens, bs, splits=2, max_len=32)
    tree = torch.ones(rows, 3, 3, dtype=torch.bool)
    kernels.paged_decode_attention(torch.randn(rows, hq, 3, d), k_store, v_store, tables, lens, bs, splits=1,
                                   max_len=32, tree=tree)
    check(launches, [name, name, "paged_decode_combine", name], ptx_dir)
