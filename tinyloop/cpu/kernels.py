"""This package's C kernels for the CPU: compiled with the system C compiler on first use, cached
on disk, called through ``ctypes`` (which releases the GIL for the call).

Optional by design: the default install needs no compiler. Where there is no C compiler or the
source does not build, ``load()`` raises ``KernelUnavailable`` (``available()`` is False) and
says why once in the log; ``use_cpu_kernels`` then leaves the model on the torch reference. A
build is a few tenths of a second (plain C, no torch headers) and happens once per source,
compiler, flags and CPU: the shared
object is kept under ``cache_dir()`` in a file named by the SHA-256 of those, so a changed
source, another compiler or another CPU (``-march=native``) builds afresh. Where that directory
cannot be created, each process builds into a temporary directory of its own (left behind).

``TINYLOOP_CC`` names the compiler (only that one then), else ``$CC``, else ``cc``, ``gcc`` or ``clang``
on the PATH.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from tinyloop.model.hostmem import huge_page_bytes

__all__ = ["SOURCE", "FLAGS", "KernelUnavailable", "cache_dir", "compiler", "load", "available", "decode_attention",
           "decode_attention_int4", "rms_norm", "rope", "quantize_int4_rows", "write_rows", "pack_panels",
           "pack_panels_all", "panel_matmul", "serves_rows", "PANEL",
           "PANEL_ROWS", "PANEL_MAX_THREADS", "PANEL_SMALL_WORK", "set_threads", "threads", "task_counts", "loaded",
           "covers_torch", "rows_of", "QUANT_ISAS", "QBLOCK", "quant_isa", "best_quant_isa", "set_quant_isa",
           "quantize_activations", "pack_q8", "pack_q4", "matmul_q8", "matmul_q4", "bf16_native", "bf16_amx",
           "set_bf16_amx", "pack_bf16", "matmul_bf16", "causal_covered", "causal_attention"]

log = logging.getLogger("tinyloop.cpu")

SOURCE = Path(__file__).resolve().parent / "kernels.c"
# Every source the library is built from (SOURCE first), and the header they share.
SOURCES = (SOURCE, SOURCE.with_name("qmatmul.c"), SOURCE.with_name("block.c"), SOURCE.with_name("inkling2.c"))
HEADERS = (SOURCE.with_name("kernels.h"),)
# -march=native: the host's vector units (AVX-512 here); the cache key holds the CPU's flags.
# -fopenmp-simd: the `omp simd` reductions vectorise without -ffast-math (same IEEE maths).
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c11", "-pthread", "-shared", "-fPIC")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES: list[tuple[str, Any, list[Any]]] = [  # kernels.c's entry points
    ("tl_decode_attention", ctypes.c_int, [_P, _I] + [_P] * 5 + [_I] * 6 + [_F]),
    ("tl_decode_attention_int4", ctypes.c_int, [_P, _I] + [_P] * 7 + [_I] * 7 + [_F]),
    ("tl_rms_norm", None, [_P] * 3 + [_I] * 2 + [_F]),
    ("tl_rope", None, [_P, _I, _P, _P, _I, _P] + [_I] * 4 + [ctypes.c_int]),
    ("tl_quantize_int4_rows", None, [_P] * 2 + [_I] + [_P] * 2 + [_I] * 2),
    ("tl_write_rows", ctypes.c_int, [_P, _I, _P, _I, _P] + [_I] * 2),
    ("tl_pack_panels", None, [_P] + [_I] * 3 + [_P]),
    ("tl_panel_matmul", ctypes.c_int, [_P] + [_I] * 2 + [_P, _I] + [_P] * 2),
    ("tl_set_threads", ctypes.c_int, [ctypes.c_int]),
    ("tl_threads", ctypes.c_int, []),
    ("tl_task_counts", None, [_P]),
    # qmatmul.c
    ("tl_quant_isa_best", ctypes.c_int, []),
    ("tl_set_quant_isa", ctypes.c_int, [ctypes.c_int]),
    ("tl_quant_isa", ctypes.c_int, []),
    ("tl_quantize_act", None, [_P] + [_I] * 3 + [_P] * 3),
    ("tl_pack_q8", None, [_P] + [_I] * 3 + [_P]),
    ("tl_pack_q8g", None, [_P, _P] + [_I] * 3 + [_P]),
    ("tl_pack_q4", None, [_P] * 3 + [_I] * 3 + [_P]),
    ("tl_matmul_q8", ctypes.c_int, [_P] + [_I] * 2 + [_P, _I, _P, _I] + [_P] * 2 + [_I]),
    ("tl_matmul_q4", ctypes.c_int, [_P] + [_I] * 2 + [_P] + [_I] * 2 + [_P] * 2 + [_I]),
    ("tl_bf16_native", ctypes.c_int, []),
    ("tl_bf16_amx", ctypes.c_int, []),
    ("tl_set_bf16_amx", ctypes.c_int, [ctypes.c_int]),
    ("tl_pack_bf16", None, [_P] + [_I] * 3 + [_P]),
    ("tl_matmul_bf16", ctypes.c_int, [_P] + [_I] * 2 + [_P, _I] + [_P] * 2),
    # block.c
    ("tl_decode_block", ctypes.c_int, [_P] * 3 + [_I] + [_P] * 2 + [_I] + [_P] * 3 + [_I] + [_P] * 5),
    ("tl_max_rows", None, [_P, _I, _I, _P, _P]),
    ("tl_rope_threaded", None, [_P, _I] + [_P] * 2 + [_I, _P] + [_I] * 4 + [ctypes.c_int]),
    ("tl_swiglu_rows", None, [_P, _I, _I, _P]),
    ("tl_residual_norm", None, [_P] * 4 + [_I] * 3 + [_F] + [_P] * 2),
    ("tl_causal_attention", ctypes.c_int, [_P] * 6 + [_I] * 5 + [_F, _P]),
    ("tl_decode_stack", ctypes.c_int, [_P] + [_I] * 2 + [_P] * 2 + [_I] + [_P] * 2 + [_I] + [_P] * 3 + [_I, _P]),
    ("tl_decode_model", ctypes.c_int, [_P] * 2 + [_I] * 2 + [_P, _I] + [_P] * 4 + [_I] + [_P] * 3 + [_I, _P]),
    ("tl_decode_burst", ctypes.c_int, [_P] + [_I] * 3 + [_P, _I] + [_P] * 5 + [_I, _P, _P, _I, _P, _I, _I, _I, _P, _I]
     + [_F] + [_P] * 2),
    # inkling2.c (``tinyloop.cpu.inkling2``)
    ("tl_ink_attend_states", ctypes.c_int, [_P] + [_I] * 4 + [_P, _I, _F, _P, _I, _F, _P]),
    ("tl_ink_controller", ctypes.c_int, [_P, _I, _P] + [_I] * 4 + [_P] * 3 + [_F, _P, _F, _P, _P]),
    ("tl_ink_short_conv", None, [_P, _I, _P] + [_I] * 6 + [_P, _P, _I, _I, _F, _I, _I, _F, _P, _P]),
    ("tl_ink_decode_attention", ctypes.c_int, [_P, _I, _P, _P, _I, _P, _P, _I, _I, _P, _I, _P, _I, _P, _P, _I, _I]
     + [_P] * 3 + [_I] * 7 + [_F] * 4 + [_P, _P]),
    ("tl_ink_route", ctypes.c_int, [_P] + [_I] * 3 + [_P, _P, _I, _I, _F] + [_P] * 6),
    ("tl_ink_activation", None, [_P, _I, _I, _F, _F, _P]),
    ("tl_ink_combine", None, [_P] * 3 + [_I] * 3 + [_P]),
]
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | str] = {}  # "lib": the loaded library, or "error": why not


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (no compiler, a failed build)."""


def cache_dir() -> Path:
    """``TINYLOOP_CPU_CACHE``, else ``$XDG_CACHE_HOME/tinyloop/cpu`` (``~/.cache/...``)."""
    if os.environ.get("TINYLOOP_CPU_CACHE"):
        return Path(os.environ["TINYLOOP_CPU_CACHE"])
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no home directory to find
        base = Path(tempfile.gettempdir())
    return base / "tinyloop" / "cpu"


def compiler() -> str | None:
    """The C compiler to build with, or None where there is none."""
    chosen = os.environ.get("TINYLOOP_CC")
    if chosen:  # named on purpose: that one or none (a fallback would build with another compiler unasked)
        return chosen if shutil.which(chosen) else None
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cc, version, *FLAGS, _cpu_flags()]).encode()).hexdigest()
    target = cache_dir() / f"kernels-{key[:24]}.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only cache: build for this process alone
        target = Path(tempfile.mkdtemp(prefix="tinyloop-cpu-")) / target.name
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # built aside, then renamed: atomic
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                              check=False)
        if done.returncode:
            raise KernelUnavailable(f"{cc} could not build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL:
    """The built library (built on the first call); raises KernelUnavailable, with the reason,
    where it cannot be (the reason is kept: later calls raise it again without retrying)."""
    lib = _state.get("lib")  # loaded: no lock (every kernel call comes through here)
    if lib is not None:
        return lib  # type: ignore[return-value]
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        if "error" in _state:
            raise KernelUnavailable(str(_state["error"]))
        try:
            cc = compiler()
            if cc is None:
                named = os.environ.get("TINYLOOP_CC")
                raise KernelUnavailable(f"no C compiler: TINYLOOP_CC={named} is not on the PATH" if named else
                                        "no C compiler (cc, gcc or clang; or set TINYLOOP_CC)")
            lib = ctypes.CDLL(str(_build(cc)))
            for name, restype, argtypes in _SIGNATURES:
                fn = getattr(lib, name)  # AttributeError: a library without it
                fn.restype, fn.argtypes = restype, argtypes
        except (KernelUnavailable, OSError, AttributeError) as exc:
            _state["error"] = str(exc)
            log.warning("CPU kernels unavailable, the model runs on torch's ops (slower decode): %s", exc)
            raise KernelUnavailable(str(exc)) from exc
        _state["lib"] = lib
        return lib


def loaded() -> bool:
    """Whether the library is loaded already (``load()`` would not build)."""
    return "lib" in _state


def available() -> bool:
    """Whether ``load()`` succeeds (building on the first call)."""
    try:
        load()
    except KernelUnavailable:
        return False
    return True


def set_threads(threads: int) -> int:
    """Run the C kernels' products of several rows and decode attention on ``threads`` threads
    in all: the caller's and ``threads - 1`` helpers (made on first need, kept). The work is
    split into tasks that whichever thread is free claims, so a helper busy elsewhere (the
    server's event loop shares its core) delays nothing; 1 runs everything on the caller's
    thread. Returns the count now in use (fewer where the OS would not make a thread)."""
    if threads < 1:
        raise ValueError(f"kernel threads must be at least 1, not {threads}")
    _threads[0] = int(load().tl_set_threads(threads))
    return _threads[0]


def threads() -> int:
    """The threads the C kernels run on (``set_threads``; 1 until it is called)."""
    return _threads[0]


_threads = [1]
os.register_at_fork(after_in_child=lambda: _threads.__setitem__(0, 1))  # a forked child has no helpers


def task_counts() -> tuple[int, int]:
    """Tasks of the kernel calls split among the threads so far, and how many of them the
    helpers ran (the rest ran on their callers' threads): how much the helpers take part."""
    counts = (ctypes.c_int64 * 2)()
    load().tl_task_counts(counts)
    return counts[0], counts[1]


def _allocated(code: int, out: torch.Tensor, what: str = "decode attention") -> torch.Tensor:
    """``out``, once the kernel says (``code`` 0) it could allocate its scratch memory."""
    if code:
        raise MemoryError(f"{what} could not allocate its scratch memory")
    return out


def rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` ``[n, ...]`` as the kernels read rows: each ``x[i]`` contiguous, the stride between
    them returned (no copy where x is a slice of a batch's larger rows: a layer's q, k or v);
    a contiguous copy where a row is not contiguous."""
    inner = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:]), strict=True):
        if size != 1 and stride != inner:
            x = x.contiguous()
            return x, x[0].numel() if x.shape[0] else 0
        inner *= size
    if x.shape[0] > 1 and x.stride(0) < inner:  # rows that overlap (an expanded tensor)
        x = x.contiguous()
    return x, x.stride(0) if x.shape[0] > 1 else inner


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                     n_keys: torch.Tensor) -> torch.Tensor:
    """Each row's new tokens over keys read in place from the pool (``kernels.c``).

    q ``[R, HQ, T, D]`` float32 (each row's ``[HQ, T, D]`` read in place where contiguous:
    ``rows_of``), k and v ``[N, KVH, D]`` (the pool) float32 and contiguous; rows ``[R, L]``
    and n_keys ``[R]`` int64 on the CPU: row r's token t attends to the pool rows
    ``rows[r, :n_keys[r] + t]``. Returns ``[R, HQ, T, D]``. The caller checks shapes and types
    (``CpuBackend``).
    """
    r, hq, t, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q, ldq = rows_of(q)
    code = load().tl_decode_attention(q.data_ptr(), ldq, k.data_ptr(), v.data_ptr(), rows.data_ptr(),
                                      n_keys.data_ptr(), out.data_ptr(), r, hq, k.shape[1], d, rows.shape[1], t,
                                      d ** -0.5)
    return _allocated(code, out)


def decode_attention_int4(q: torch.Tensor, k: tuple[torch.Tensor, torch.Tensor], v: tuple[torch.Tensor, torch.Tensor],
                          rows: torch.Tensor, n_keys: torch.Tensor, group: int) -> torch.Tensor:
    """``decode_attention`` over a 4-bit pool (``kvstore.Int4Buffer``): k and v each (codes
    ``[N, KVH, D/2]`` uint8, meta ``[N, KVH, D/group, 2]`` float16), contiguous; each key row is
    dequantized as ``dequantize_int4`` does it, then attended to."""
    r, hq, t, d = q.shape
    (k_codes, k_meta), (v_codes, v_meta) = k, v
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q, ldq = rows_of(q)
    code = load().tl_decode_attention_int4(q.data_ptr(), ldq, k_codes.data_ptr(), k_meta.data_ptr(), v_codes.data_ptr(),
                                           v_meta.data_ptr(), rows.data_ptr(), n_keys.data_ptr(), out.data_ptr(),
                                           r, hq, k_codes.shape[1], d, rows.shape[1], t, group, d ** -0.5)
    return _allocated(code, out)


def causal_covered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``causal_attention`` takes these: float32 on the CPU, no gradient, q ``[R, HQ, T, D]``
    over k and v ``[R, KVH, T, D]`` (the same T: a first prefill chunk's own keys), D a multiple of
    16 up to 256 with each token's D values contiguous, HQ a multiple of KVH."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return False
    r, hq, t, d = q.shape
    return (k.shape[0] == r and k.shape[2] == t and k.shape[3] == d and d % 16 == 0 and 0 < d <= 256
            and hq % k.shape[1] == 0 and all(x.dtype is torch.float32 and x.is_cpu and not x.requires_grad
                                              and x.stride(3) == 1 for x in (q, k, v)))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a prefill's first chunk (``kernels.c``): q ``[R, HQ, T, D]`` over k, v
    ``[R, KVH, T, D]`` (``causal_covered``: read in place through their strides), query t over keys
    0..t, scaled by D^-0.5, grouped-query where KVH < HQ. Returns ``[R, HQ, T, D]``, a view of
    ``[R, T, HQ, D]`` memory: ``out.transpose(1, 2).flatten(-2)`` is the output projection's
    input with no copy."""
    r, hq, t, d = q.shape
    out = torch.empty((r, t, hq, d), dtype=torch.float32, device=q.device)
    qs, ks, vs = ((ctypes.c_int64 * 3)(*x.stride()[:3]) for x in (q, k, v))
    code = load().tl_causal_attention(q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs, r, hq, k.shape[1], t, d,
                                      d ** -0.5, out.data_ptr())
    return _allocated(code, out, "causal attention").transpose(1, 2)


# Values past which RoPE's (row, head) pairs are shared among the threads (a prefill chunk's; a
# decode step's few stay on the calling thread)
_ROPE_THREADED = 64 * 1024


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: bool) -> torch.Tensor:
    """``x * cos + rotate(x) * sin`` for float32 x ``[R, H, T, D]`` (each row read in place where
    contiguous: ``rows_of``) and cos, sin ``[R or 1, T, D]`` (or ``[R or 1, 1, T, D]``) float32
    contiguous on the CPU (the caller checks); ``half``: rotate = cat(-x2, x1), else interleaved
    pairs. Torch's result to the bit, as one call instead of five ops. Returns a new
    ``[R, H, T, D]``."""
    r, h, t, d = x.shape
    out = torch.empty((r, h, t, d), dtype=torch.float32, device=x.device)
    x, ldx = rows_of(x)  # (cos and sin may be [R or 1, 1, T, D]: the same memory)
    run = load().tl_rope_threaded if r * h * t * d >= _ROPE_THREADED else load().tl_rope  # (a prefill's: threaded)
    run(x.data_ptr(), ldx, cos.data_ptr(), sin.data_ptr(), cos.shape[0], out.data_ptr(), r, h, t, d, int(half))
    return out


def max_rows(x: torch.Tensor) -> tuple[list[int], list[bool]]:
    """For each row of float32 x ``[B, V]`` (contiguous, on the CPU): the index of its first
    maximum (``argmax``'s), and whether it can be sampled from (no NaN, no +inf, a finite value),
    in one pass (``tl_max_rows``)."""
    b, v = x.shape
    index = torch.empty(b, dtype=torch.int64, device="cpu")
    usable = torch.empty(b, dtype=torch.int8, device="cpu")
    load().tl_max_rows(x.data_ptr(), b, v, index.data_ptr(), usable.data_ptr())
    return index.tolist(), [bool(u) for u in usable.tolist()]


def swiglu(fc: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of float32 ``fc`` = ``[gate; up]`` ``[..., 2I]`` (contiguous, on the
    CPU) -> ``[..., I]``, the rows shared among the kernel threads."""
    two_i = fc.shape[-1]
    out = torch.empty(*fc.shape[:-1], two_i // 2, dtype=torch.float32, device="cpu")
    load().tl_swiglu_rows(fc.data_ptr(), fc.numel() // two_i, two_i // 2, out.data_ptr())
    return out


_STYLE_CODES = {"pre_ln": 0, "sandwich": 1, "peri_ln": 2, "post_ln": 2}


def residual_norm(x: torch.Tensor, a: torch.Tensor, w_in: torch.Tensor | None, w_out: torch.Tensor | None,
                  style: str, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Backend.residual_norm`` of float32 x and a ``[..., H]`` (contiguous, on the CPU; the
    norms' weights ``[H]`` likewise, w_in where the style has one), the rows shared among the
    kernel threads."""
    h = x.shape[-1]
    r = torch.empty_like(x)
    y = None if w_out is None else torch.empty_like(x)
    load().tl_residual_norm(x.data_ptr(), a.data_ptr(), None if w_in is None else w_in.data_ptr(),
                            None if w_out is None else w_out.data_ptr(), x.numel() // h, h, _STYLE_CODES[style], eps,
                            r.data_ptr(), None if y is None else y.data_ptr())
    return r, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (H,), weight, eps)`` for float32 x ``[..., H]`` and weight ``[H]``, both
    contiguous on the CPU (the caller checks)."""
    out = torch.empty_like(x)
    h = x.shape[-1]
    load().tl_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, eps)
    return out


def write_rows(x: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[rows] = x`` for x ``[n, ...]`` float32 (each row read in place where contiguous:
    ``rows_of``) and dst ``[N, ...]`` (the same row shape) float32 contiguous on the CPU, rows
    ``[n]`` int64 contiguous: a float32 pool's K or V write. Raises IndexError, writing nothing,
    where a row is outside ``dst``."""
    n, width = rows.shape[0], dst.stride(0)
    if x.numel() != n * width:
        raise ValueError(f"{n} rows of {width} values to write, got {tuple(x.shape)}")
    x, ldx = rows_of(x if x.dim() > 1 and x.shape[0] == n else x.reshape(n, width))
    if load().tl_write_rows(x.data_ptr(), ldx, rows.data_ptr(), n, dst.data_ptr(), dst.shape[0], width):
        raise IndexError(f"a KV row is outside the pool of {dst.shape[0]} rows")


def quantize_int4_rows(x: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor,
                       group: int) -> None:
    """Store x ``[n, width]`` (float32, contiguous) 4-bit at pool rows ``rows`` ``[n]`` of
    ``codes`` ``[N, ..., W/2]`` and ``meta`` ``[N, ..., W/group, 2]`` (``Int4Buffer``), as
    ``kvstore.quantize_int4`` would compute them."""
    load().tl_quantize_int4_rows(x.data_ptr(), rows.data_ptr(), x.shape[0], codes.data_ptr(), meta.data_ptr(),
                                 x.shape[1], group)


PANEL = 16  # output columns a panel of ``pack_panels`` holds (kernels.c's PANEL)
# Products of at most PANEL_ROWS rows run on the panels (where a weight has them) while the
# kernels run on at least torch's threads (``covers_torch``), or torch runs at most
# PANEL_MAX_THREADS intra-op threads, or at any thread count when they are at most
# PANEL_SMALL_WORK multiply-adds. Measured on two cores, the kernels on one thread: in isolation
# (bench/panel_matmul.py --threads 2) torch's two-thread float32 products of the ~100M preset's
# weights run 1.1-2x faster than the one-thread kernel, but inside a decode step (engines on two
# threads, the threshold switched in one process, RESULTS 2026-12-01 00:45) the kernel beats
# them up to 2^24 multiply-adds: a `small` step of 8 rows 1.14x faster at 2^22 than at 2^20 and
# 1.10x faster again at 2^24, the ~100M preset's one-row step 1.08x and then 1.04x, its 8-row step
# even; the demo model's speculation 1.64-1.70x plain at 2^20, 1.79-1.83x at 2^22. (Quantised
# weights always run on qmatmul.c's kernels: torch's int8 and int4 ones are 2x slower or more.)
PANEL_ROWS = 16
PANEL_MAX_THREADS = 1
PANEL_SMALL_WORK = 1 << 24


def serves_rows(rows: int, n: int, k: int, any_rows: bool = False) -> bool:
    """Whether a product of ``rows`` rows by an ``[n, k]`` float32 weight with panels runs on
    the panel kernel, at torch's and the kernels' present thread counts; ``any_rows``: past
    PANEL_ROWS too, where the kernels cover torch's threads (a weight that has no other fast
    copy: ``cpu_linear.PackedWeight`` without its blocked one)."""
    if rows <= 0:
        return False
    if rows > PANEL_ROWS:
        return any_rows and covers_torch()
    return covers_torch() or rows * n * k <= PANEL_SMALL_WORK or torch.get_num_threads() <= PANEL_MAX_THREADS


def covers_torch() -> bool:
    """Whether the kernels run on at least torch's threads (``set_threads``): then the panels
    serve products of every size (they are as fast as torch's at one thread, and split the
    same way at more)."""
    return _threads[0] >= torch.get_num_threads()


def _panels_numel(weight: torch.Tensor) -> int:
    return -(-weight.shape[0] // PANEL) * PANEL * weight.shape[1]


def _pack_into(weight: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.float32:
        raise TypeError(f"panels hold float32 weights, not {weight.dtype} (quantised ones: pack_q8, pack_q4)")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n, k = weight.shape
    load().tl_pack_panels(weight.data_ptr(), weight.stride(0), n, k, panels.data_ptr())
    return panels


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32 on the CPU; copied first unless its stride along K is 1)
    laid out for ``panel_matmul``: panels of 16 output columns, ``[ceil(N / 16), K, 16]`` flat,
    the last zero-padded."""
    return _pack_into(weight, torch.empty(_panels_numel(weight), dtype=weight.dtype, device=weight.device))


_ALIGN = 64  # each weight's panels start on a cache line


def pack_panels_all(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``pack_panels`` of each weight, all carved out of one buffer on 2 MiB pages where Linux
    gives them (``model.hostmem``: a decode step streams every panel)."""
    sizes = [_panels_numel(w) * w.element_size() for w in weights]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    memory = huge_page_bytes(total)
    return [_pack_into(w, memory[off:off + size].view(w.dtype))
            for w, off, size in zip(weights, offsets, sizes, strict=True)]


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A product's bias as the kernels read it: float32 and contiguous (no copy where it is)."""
    return None if bias is None else bias.detach().float().contiguous()


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for x ``[M, K]`` float32 contiguous on the CPU and W ``[n, K]``
    float32 as ``pack_panels`` laid it out. Bias ``[n]``, or None; returns ``[M, n]``. Fastest
    for a few rows (decode); the caller chooses (``cpu_linear.PackedWeight``)."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    bias = _bias(bias)
    b = None if bias is None else bias.data_ptr()
    code = load().tl_panel_matmul(x.data_ptr(), m, k, panels.data_ptr(), n, b, out.data_ptr())
    return _allocated(code, out, "a panel matrix product")


# Quantised products with integer dot products (qmatmul.c): the activations quantised to int8 per
# block of QBLOCK inputs, int8 or int4 weights in panels of 16 columns.
QBLOCK = 32
QUANT_ISAS = ("portable", "avx2", "avx512vnni")  # qmatmul.c's paths, by level


def best_quant_isa() -> str:
    """The fastest path of the quantised products this CPU's build has."""
    return QUANT_ISAS[load().tl_quant_isa_best()]


def quant_isa() -> str:
    """The path the quantised products run on now."""
    return QUANT_ISAS[load().tl_quant_isa()]


def set_quant_isa(name: str | None) -> str:
    """Run the quantised products on path ``name`` (``QUANT_ISAS``; None: the best this CPU's
    build has). Raises ValueError for a path the build lacks. Returns the path now used."""
    lib = load()
    level = -1 if name is None else QUANT_ISAS.index(name) if name in QUANT_ISAS else -2
    if level == -2 or level > lib.tl_quant_isa_best():
        raise ValueError(f"quantised product path {name!r} is not built here (best: {best_quant_isa()})")
    return QUANT_ISAS[lib.tl_set_quant_isa(level)]


def _padded(k: int) -> int:
    return -(-k // 4) * 4


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the quantised products do to x ``[M, K]`` float32 first: per block of QBLOCK inputs,
    ``d = max|x| / 127`` and ``xq = round(x / d)`` (ties to even). Returns xq ``[M, Kp]`` int8
    (K padded with zeros to a multiple of 4), d and the blocks' sums of xq ``[M, ceil(Kp / 32)]``."""
    x = x.float().contiguous()
    m, k = x.shape
    kp = _padded(k)
    nb = -(-kp // QBLOCK)
    xq = torch.empty(m, kp, dtype=torch.int8)
    d = torch.empty(m, nb, dtype=torch.float32)
    sums = torch.empty(m, nb, dtype=torch.int32)
    load().tl_quantize_act(x.data_ptr(), m, k, kp, xq.data_ptr(), d.data_ptr(), sums.data_ptr())
    return xq, d, sums


def pack_q8(codes: torch.Tensor, scales: torch.Tensor | None = None, group: int = 0) -> torch.Tensor:
    """int8 codes ``[N, K]`` laid out for ``matmul_q8`` (on 2 MiB pages where Linux gives them):
    ``[ceil(N / 16), ceil(K / 4), 16, 4]`` bytes, each code + 128 (``group`` 0: the scales, one
    per output, stay outside). With a ``group`` (a multiple of QBLOCK dividing K) and ``scales``
    ``[N, K / group]``: each panel's scales first, ``[K / group, 16]`` fp16 padded to 64 bytes,
    then its codes so."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"int8 panels need int8 codes [N, K], got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    if group:
        if group < 0 or group % QBLOCK or k % group or scales is None or scales.shape != (n, k // group):
            raise ValueError(f"grouped int8 panels need a group of a multiple of {QBLOCK} inputs dividing K "
                             "and scales [N, K/group]")
        codes, scales = codes.contiguous(), scales.float().contiguous()
        panels = huge_page_bytes(-(-n // PANEL) * (-(-(k // group) * 2 * PANEL // 64) * 64 + k * PANEL))
        load().tl_pack_q8g(codes.data_ptr(), scales.data_ptr(), n, k, group, panels.data_ptr())
        return panels
    if codes.stride(1) != 1:
        codes = codes.contiguous()
    panels = huge_page_bytes(-(-n // PANEL) * _padded(k) * PANEL)
    load().tl_pack_q8(codes.data_ptr(), codes.stride(0), n, k, panels.data_ptr())
    return panels


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """4-bit codes ``[N, K / 2]`` uint8 (two a byte, the even k in the low nibble), ``scales``
    and ``zeros`` ``[K / group, N]`` (W = (code - 8) * scale + zero) laid out for ``matmul_q4``:
    per panel of 16 columns and group, the codes (8 inputs a 64-byte chunk), then the 16 scales
    and the 16 shifts (zero - 8 scale) as fp16. The group must be a multiple of QBLOCK."""
    n, half = codes.shape
    k = 2 * half
    groups = k // group if group > 0 else 0
    scales, zeros = scales.float().contiguous(), zeros.float().contiguous()
    if (codes.dtype != torch.uint8 or group <= 0 or group % QBLOCK or k % group
            or scales.shape != (groups, n) or zeros.shape != (groups, n)):
        raise ValueError(f"int4 panels need uint8 codes [N, K/2], a group of a multiple of {QBLOCK} inputs "
                         "dividing K, and scales and zeros [K/group, N]")
    codes = codes.contiguous()
    panels = huge_page_bytes(-(-n // PANEL) * groups * (group * 8 + 64))
    load().tl_pack_q4(codes.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, k, group, panels.data_ptr())
    return panels


def _terms(terms: int) -> int:
    if terms not in (1, 2):
        raise ValueError(f"activations come in 1 or 2 int8 terms, not {terms}")
    return terms


def matmul_q8(x: torch.Tensor, panels: torch.Tensor, n: int, scales: torch.Tensor | None,
              bias: torch.Tensor | None, terms: int = 1, group: int = 0) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for x ``[M, K]`` float32 contiguous, W the int8 codes ``pack_q8``
    laid out times ``scales`` ``[n]`` (float32, one per output), or with ``group`` the scales per
    group of inputs ``pack_q8`` put in the panels (``scales`` unused); x quantised per block
    (``quantize_activations``), in ``terms`` int8 terms: 2 adds the residual's codes
    (x ~ d1 q1 + d2 q2, ~250x finer), one more row of dot products over the same weight bytes.
    Returns ``[M, n]`` float32."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    bias = _bias(bias)
    if group == 0 and (scales is None or scales.shape != (n,)):
        raise ValueError("int8 panels without a group need a scale per output")
    code = load().tl_matmul_q8(x.data_ptr(), m, k, panels.data_ptr(), n,
                               None if group or scales is None else scales.data_ptr(), group,
                               None if bias is None else bias.data_ptr(), out.data_ptr(), _terms(terms))
    return _allocated(code, out, "a quantised matrix product")


def matmul_q4(x: torch.Tensor, panels: torch.Tensor, n: int, group: int, bias: torch.Tensor | None,
              terms: int = 1) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for x ``[M, K]`` float32 contiguous and the 4-bit W ``pack_q4`` laid
    out; x quantised per block (``quantize_activations``) in ``terms`` int8 terms (as
    ``matmul_q8``). Returns ``[M, n]`` float32."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    bias = _bias(bias)
    code = load().tl_matmul_q4(x.data_ptr(), m, k, panels.data_ptr(), n, group,
                               None if bias is None else bias.data_ptr(), out.data_ptr(), _terms(terms))
    return _allocated(code, out, "a quantised matrix product")


def bf16_native() -> bool:
    """Whether bf16 products run on AVX-512 BF16 here (else, or with the portable path forced by
    ``set_quant_isa``, on portable C: the same sums, slower)."""
    return bool(load().tl_bf16_native())


def bf16_amx() -> bool:
    """Whether bf16 products of 16 rows and more (a prefill's) run on AMX tiles here: an Intel CPU
    with AMX-BF16, the kernels built for it, Linux granting the tile state, not turned off."""
    return bool(load().tl_bf16_amx())


def set_bf16_amx(on: bool) -> bool:
    """Let bf16 products use AMX where it is there (the default), or not (the AVX-512 path: the
    tests run both). Returns ``bf16_amx()``."""
    return bool(load().tl_set_bf16_amx(int(on)))


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight ``[N, K]`` laid out for ``matmul_bf16`` (on 2 MiB pages where Linux
    gives them): ``[ceil(N / 16), ceil(K / 2), 16, 2]`` bfloat16, zero-padded."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"bf16 panels need a bfloat16 weight [N, K], got {weight.dtype} {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n, k = weight.shape
    panels = huge_page_bytes(-(-n // PANEL) * (-(-k // 2) * 2) * PANEL * 2).view(torch.bfloat16)
    load().tl_pack_bf16(weight.data_ptr(), weight.stride(0), n, k, panels.data_ptr())
    return panels


def matmul_bf16(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x.bfloat16() @ W^T (+ bias)`` for x ``[M, K]`` float32 contiguous and the bfloat16 W
    ``pack_bf16`` laid out: x rounded to bfloat16 (as torch rounds it), the products and sums in
    float32. Returns ``[M, n]`` float32."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    bias = _bias(bias)
    code = load().tl_matmul_bf16(x.data_ptr(), m, k, panels.data_ptr(), n, None if bias is None else bias.data_ptr(),
                                 out.data_ptr())
    return _allocated(code, out, "a bf16 matrix product")
