"""Compile and load this package's ``.cu`` kernels with CuPy (NVRTC), cached on disk.

Importable without CuPy or a GPU: CuPy is imported on first use. A kernel's source is
``common.cu`` followed by its own file (``source``); NVRTC compiles it to a cubin for the
device's architecture (``-arch=sm_XY`` from its compute capability) with the CUDA headers found
by ``include_dirs`` (the ``nvidia-cuda-runtime`` wheel, ``CUDA_PATH`` or ``/usr/local/cuda``).
The cubin is kept under ``cache_dir()`` in a file named by the SHA-256 of source, architecture
and options, so a changed kernel, another GPU or other flags compile afresh and nothing else
does. Compiling needs no device (``compile_cubin``); loading does (``load``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["KERNELS", "source", "bundle", "source_path", "arch_for", "compile_options", "cache_key", "cache_dir",
           "include_dirs", "compile_cubin", "cached_cubin", "load"]

HERE = Path(__file__).resolve().parent
KERNELS = ("rmsnorm", "rope", "swiglu", "paged_attention", "kv_write")  # rmsnorm.cu, rope.cu, ...
BASE_OPTIONS = ("--std=c++17", "-default-device")
_HEADER = "cuda_fp16.h"
_modules: dict[tuple[str, int], Any] = {}


def source_path(name: str) -> Path:
    if name not in KERNELS:
        raise ValueError(f"unknown kernel source {name!r}; one of {', '.join(KERNELS)}")
    return HERE / f"{name}.cu"


def source(name: str) -> str:
    """The text NVRTC (or nvcc) compiles for kernel source ``name``: the shared helpers first."""
    return bundle([name])


def bundle(names: Sequence[str]) -> str:
    """``common.cu`` then each named kernel source, in one translation unit; ``#line`` markers
    make compiler messages name the original file and line."""
    parts = [f'#line 1 "common.cu"\n{(HERE / "common.cu").read_text()}']
    parts += [f'#line 1 "{name}.cu"\n{source_path(name).read_text()}' for name in names]
    return "\n".join(parts)


def arch_for(capability: tuple[int, int]) -> str:
    """``sm_90`` for compute capability (9, 0)."""
    major, minor = capability
    return f"sm_{major}{minor}"


def include_dirs() -> list[str]:
    """Directories holding the CUDA headers the kernels include (``cuda_fp16.h``,
    ``cuda_bf16.h``), first found first: ``TINYLOOP_CUDA_INCLUDE``, the NVIDIA runtime wheels
    (``nvidia/cu13/include``, ``nvidia/cuda_runtime/include``), ``$CUDA_PATH/include``,
    ``/usr/local/cuda/include``."""
    candidates: list[Path] = []
    for env in ("TINYLOOP_CUDA_INCLUDE",):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]))
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += [Path(root) / "cu13" / "include", Path(root) / "cuda_runtime" / "include"]
    if os.environ.get("CUDA_PATH"):
        candidates.append(Path(os.environ["CUDA_PATH"]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    out: list[str] = []
    for c in candidates:
        if (c / _HEADER).is_file() and str(c) not in out:
            out.append(str(c))
    return out


def compile_options(arch: str, includes: Sequence[str] | None = None) -> tuple[str, ...]:
    """NVRTC options for ``arch`` (``sm_90``): a cubin for that architecture, with the first
    header directory ``include_dirs`` finds (two CUDA versions' headers must not mix)."""
    dirs = include_dirs()[:1] if includes is None else list(includes)
    return (*BASE_OPTIONS, f"-arch={arch}", *(f"-I{d}" for d in dirs))


def cache_key(text: str, arch: str, options: Sequence[str]) -> str:
    """SHA-256 of the source, the architecture and the options (include paths included)."""
    h = hashlib.sha256()
    for part in (text, arch, *options):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def cache_dir() -> Path:
    """``TINYLOOP_CUDA_CACHE``, else ``$XDG_CACHE_HOME/tinyloop/cuda`` (``~/.cache/...``)."""
    if os.environ.get("TINYLOOP_CUDA_CACHE"):
        return Path(os.environ["TINYLOOP_CUDA_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tinyloop" / "cuda"


def compile_cubin(name: str, arch: str, options: Sequence[str] | None = None) -> bytes:
    """Compile kernel source ``name`` for ``arch`` with NVRTC (no device needed); raises
    RuntimeError with NVRTC's log when it does not compile."""
    from cupy_backends.cuda.libs import nvrtc

    opts = compile_options(arch) if options is None else tuple(options)
    prog = nvrtc.createProgram(source(name), f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{name}.cu does not compile for {arch}:\n{nvrtc.getProgramLog(prog)}") from exc
        cubin: bytes = nvrtc.getCUBIN(prog)
        return cubin
    finally:
        nvrtc.destroyProgram(prog)


def cached_cubin(name: str, arch: str, options: Sequence[str] | None = None,
                 directory: Path | None = None) -> Path:
    """The cubin file of ``name`` for ``arch``: from the cache, or compiled into it (written to
    a temporary file and renamed, so concurrent processes never read half a file)."""
    opts = compile_options(arch) if options is None else tuple(options)
    folder = cache_dir() if directory is None else directory
    path = folder / f"{name}-{arch}-{cache_key(source(name), arch, opts)[:32]}.cubin"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    data = compile_cubin(name, arch, opts)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def load(name: str, device: int | None = None) -> Any:
    """The loaded ``cupy.RawModule`` of kernel source ``name`` on CUDA device ``device`` (the
    current one when None), compiled for its architecture on first use."""
    import cupy

    index = cupy.cuda.runtime.getDevice() if device is None else device
    key = (name, index)
    if key not in _modules:
        with cupy.cuda.Device(index):
            capability = cupy.cuda.Device(index).compute_capability  # "90"
            arch = f"sm_{capability}"
            _modules[key] = cupy.RawModule(path=str(cached_cubin(name, arch)))
    return _modules[key]
