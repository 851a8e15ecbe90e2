"""Python wrappers of the kernels: torch CUDA tensors in, launched on torch's current stream.

Every wrapper checks shapes and dtypes on the host, takes its launch geometry from
``launch.py`` and its module from ``loader.load``; CuPy is imported on first call. Each has a
torch reference of the same signature in ``reference.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tinyloop.cuda import launch, loader
from tinyloop.cuda.reference import STYLE_MODES

__all__ = ["SUFFIX", "KVStoreArg", "kv_write", "kv_write_int4", "residual_rmsnorm", "rms_norm", "rope_", "swiglu",
           "paged_decode_attention"]

SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _i64(x: int) -> np.int64:
    return np.int64(x)


def _run(module: str, kernel: str, dtype: torch.dtype, cfg: launch.Launch, args: tuple[Any, ...],
         device: torch.device) -> None:
    import cupy

    if dtype not in SUFFIX:
        raise TypeError(f"no kernel for {dtype}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = loader.load(module, index).get_function(f"{kernel}_{SUFFIX[dtype]}")
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
        fn(cfg.grid, cfg.block, args, shared_mem=cfg.shared)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a ``[..., H]`` tensor whose last dim is contiguous and whose rows
    are evenly strided."""
    if t.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    flat = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if flat.data_ptr() != t.data_ptr():
        raise ValueError("rows must be a view (evenly strided)")
    return flat.shape[0], flat.stride(0)


def residual_rmsnorm(x: torch.Tensor, a: torch.Tensor, w_in: torch.Tensor | None, w_out: torch.Tensor | None,
                     style: str, eps: float, cast_first: bool,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As ``reference.residual_rmsnorm_ref``; ``out`` receives r (may be ``x``: in place)."""
    mode = STYLE_MODES[style]
    hidden = x.shape[-1]
    res = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    y = None if w_out is None else torch.empty(res.shape, dtype=x.dtype, device=x.device)
    rows, x_stride = _rows(x)
    _, a_stride = _rows(a)
    _, out_stride = _rows(res)
    if y is not None and out_stride != hidden:
        raise ValueError("with a norm output, r must be written contiguously (they share a row stride)")
    args = (_ptr(x), _ptr(a), _ptr(w_in if w_in is not None else w_out), _ptr(w_out), _ptr(res), _ptr(y),
            _i32(hidden), _i64(x_stride), _i64(a_stride), _i64(out_stride), np.float32(eps), _i32(mode),
            _i32(int(cast_first)))
    _run("rmsnorm", "residual_rmsnorm", x.dtype, launch.rmsnorm_launch(rows, hidden), args, x.device)
    return res, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool) -> torch.Tensor:
    """RMSNorm alone (mode 3): ``Backend.rms_norm`` / ``rms_norm_cast_first``."""
    x = x.contiguous()
    y = torch.empty_like(x)
    rows, stride = _rows(x)
    args = (_ptr(x), _ptr(x), _ptr(weight), _ptr(weight), _ptr(y), _ptr(y), _i32(x.shape[-1]), _i64(stride),
            _i64(stride), _i64(stride), np.float32(eps), _i32(3), _i32(int(cast_first)))
    _run("rmsnorm", "residual_rmsnorm", x.dtype, launch.rmsnorm_launch(rows, x.shape[-1]), args, x.device)
    return y


def rope_(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, style: str,
          q_bias: torch.Tensor | None = None, k_bias: torch.Tensor | None = None,
          compute_float32: bool = False, out: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
    """Rotate q ``[N, Hq, D]`` and k ``[N, Hkv, D]`` (None: q only), their biases added first;
    cos/sin ``[N, D]`` float32. In place, or into ``out`` (q's and k's results, same shapes, any
    strides). Token and head strides are free, D must be contiguous."""
    n, hq, d = q.shape
    q_out, k_out = (q, k) if out is None else out
    for x, y in ((q, q_out), (k, k_out)):
        if x is not None and (y is None or y.shape != x.shape or y.dtype != x.dtype):
            raise ValueError("each output must have its input's shape and dtype")
        if x is not None and y is not None and (x.stride(-1) != 1 or y.stride(-1) != 1):
            raise ValueError("head_dim must be contiguous")
    if q_bias is not None and not q_bias.is_contiguous() or k_bias is not None and not k_bias.is_contiguous():
        raise ValueError("biases must be contiguous [H, D]")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()

    def strides(x: torch.Tensor | None) -> tuple[np.int64, np.int64]:
        return (_i64(0), _i64(0)) if x is None else (_i64(x.stride(0)), _i64(x.stride(1)))

    kvh = 0 if k is None else k.shape[1]
    args = (_ptr(q), _ptr(q_out), _ptr(k), _ptr(k_out), _ptr(cos), _ptr(sin), _ptr(q_bias), _ptr(k_bias), _i32(hq),
            _i32(d), *strides(q), *strides(k), *strides(q_out), *strides(k_out),
            _i32(0 if style == "half" else 1), _i32(int(compute_float32)))
    _run("rope", "rope", q.dtype, launch.rope_launch(n, hq, kvh, d), args, q.device)


def swiglu(fc: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``fc = [gate; up]`` ``[..., 2I]`` -> ``[..., I]``."""
    rows, stride = _rows(fc)
    inter = fc.shape[-1] // 2
    out = torch.empty((*fc.shape[:-1], inter), dtype=fc.dtype, device=fc.device)
    args = (_ptr(fc), _ptr(out), _i64(rows), _i32(inter), _i64(stride))
    _run("swiglu", "swiglu", fc.dtype, launch.swiglu_launch(rows, inter), args, fc.device)
    return out


def _check_pool_rows(rows: torch.Tensor, n: int) -> None:
    """The KV writes' pool rows: ``[n]`` int64, any stride (a column of a context's table)."""
    if rows.dtype != torch.int64 or rows.shape != (n,):
        raise ValueError(f"rows must be [{n}] int64")


def kv_write(k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
             rows: torch.Tensor) -> None:
    """``k_store[rows] = k`` and ``v_store[rows] = v`` in one launch: k and v ``[N, Hkv, D]``
    (row and head strides free, D contiguous), the pool ``[pool_rows, Hkv, D]`` contiguous in
    their dtype, rows ``[N]`` int64 (any stride)."""
    n, kvh, d = k.shape
    if v.shape != k.shape or k_store.shape[1:] != k.shape[1:] or v_store.shape != k_store.shape:
        raise ValueError("k and v [N, Hkv, D] and a pool [rows, Hkv, D] for each")
    if len({k.dtype, v.dtype, k_store.dtype, v_store.dtype}) != 1:
        raise TypeError("k, v and the pool must share one dtype")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_store.is_contiguous() and v_store.is_contiguous()):
        raise ValueError("head_dim must be contiguous and the pool contiguous")
    _check_pool_rows(rows, n)
    args = (_ptr(k), _ptr(v), _ptr(k_store), _ptr(v_store), _ptr(rows), _i64(rows.stride(0)), _i32(kvh), _i32(d),
            _i64(k.stride(0)), _i64(k.stride(1)), _i64(v.stride(0)), _i64(v.stride(1)))
    _run("kv_write", "kv_write", k.dtype, launch.kv_write_launch(n, kvh, d), args, k.device)


def kv_write_int4(k: torch.Tensor, v: torch.Tensor, k_store: tuple[torch.Tensor, torch.Tensor],
                  v_store: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, group: int) -> None:
    """``kvstore.Int4Buffer.write`` of k and v ``[N, Hkv, D]`` (row and head strides free, D
    contiguous) at pool ``rows`` ``[N]`` int64, in one launch: each (codes ``[rows, Hkv, D/2]``
    uint8, meta ``[rows, Hkv, D/group, 2]`` fp16) pair contiguous."""
    n, kvh, d = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v: [N, Hkv, D] of one dtype, head_dim contiguous")
    if group < 2 or group % 2 or d % group:
        raise ValueError(f"an int4 group is an even divisor of head_dim {d}, got {group}")
    for codes, meta in (k_store, v_store):
        if (codes.dtype != torch.uint8 or meta.dtype != torch.float16 or codes.shape[1:] != (kvh, d // 2)
                or meta.shape[1:] != (kvh, d // group, 2) or not (codes.is_contiguous() and meta.is_contiguous())):
            raise ValueError("an int4 pool: contiguous uint8 codes [rows, Hkv, D/2] and fp16 meta [rows, Hkv, G, 2]")
    _check_pool_rows(rows, n)
    args = (_ptr(k), _ptr(v), _ptr(k_store[0]), _ptr(k_store[1]), _ptr(v_store[0]), _ptr(v_store[1]), _ptr(rows),
            _i64(rows.stride(0)), _i32(kvh), _i32(d), _i32(group), _i64(k.stride(0)), _i64(k.stride(1)),
            _i64(v.stride(0)), _i64(v.stride(1)))
    _run("kv_write", "kv_write_int4", k.dtype, launch.kv_write_int4_launch(n, kvh, d // group), args, k.device)


KVStoreArg = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A pool field as the attention kernel reads it: K or V ``[pool_rows, Hkv, D]`` in q's dtype, or
an int4 pool's (codes ``[pool_rows, Hkv, D/2]`` uint8, meta ``[pool_rows, Hkv, D/group, 2]`` fp16)."""


def paged_decode_attention(q: torch.Tensor, k_store: KVStoreArg, v_store: KVStoreArg, tables: torch.Tensor,
                           seq_lens: torch.Tensor, block_size: int, written: torch.Tensor | None = None,
                           depth: torch.Tensor | None = None, splits: int | None = None,
                           max_len: int | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """As ``reference.paged_decode_ref`` (an int4 pool dequantized in the read, as
    ``kvstore.dequantize_int4`` then a cast to q's dtype): q ``[R, Hq, D]`` -> ``[R, Hq, D]``, or
    ``[R, Hq, T, D]`` -> ``[R, Hq, T, D]`` with token t of row r over its first ``seq_lens[r] +
    t`` keys (a speculative chain's verify); ``tree`` ``[R, T, T]`` bool (a tree's verify): token t
    sees the row's new token j (key ``seq_lens[r] - 1 + j``) only where ``tree[r, t, j]``. ``splits`` (default from
    ``launch.decode_splits``) > 1 runs flash-decoding with a combine pass. ``max_len``: a bound on
    ``seq_lens`` that sizes the splits (splits past a row's length do nothing); without it
    ``seq_lens`` is read on the host, a synchronisation. ``tables`` may be a strided view (rows
    evenly spaced, each row's entries contiguous): a slot's column of a ``[R, S, MB]`` table is
    read in place."""
    tokens = q.shape[2] if q.dim() == 4 else 1
    r, hq, d = q.shape[0], q.shape[1], q.shape[-1]
    token_stride = q.stride(2) if q.dim() == 4 else 0
    stores: tuple[Any, ...]
    if isinstance(k_store, tuple) and isinstance(v_store, tuple):
        (k_codes, k_meta), (v_codes, v_meta) = k_store, v_store
        fields = [k_codes, k_meta, v_codes, v_meta]
        if k_codes.dtype != torch.uint8 or k_meta.dtype != torch.float16 or k_codes.shape[-1] * 2 != d:
            raise ValueError("an int4 pool: uint8 codes of D/2 bytes a head and fp16 (scale, minimum) meta")
        kvh, kernel = k_codes.shape[1], "paged_decode_int4"
        stores = (_ptr(k_codes), _ptr(k_meta), _ptr(v_codes), _ptr(v_meta), _i32(d // k_meta.shape[2]))
    elif isinstance(k_store, torch.Tensor) and isinstance(v_store, torch.Tensor):
        fields = [k_store, v_store]
        kvh, kernel, stores = k_store.shape[1], "paged_decode", (_ptr(k_store), _ptr(v_store))
    else:
        raise TypeError("K and V must both be plain tensors or both int4 (codes, meta) pairs")
    if q.stride(-1) != 1 or not all(t.is_contiguous() for t in fields):
        raise ValueError("q's head_dim and the K/V pool must be contiguous")
    if tables.dtype != torch.int64 or tables.stride(-1) != 1:
        tables = tables.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if max_len is None:
        max_len = int(seq_lens.max())  # a host read: sizes the splits
    queries = r * tokens  # one block row per (row, token)
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = launch.decode_splits(queries, hq, max_len, sms)
    per = launch.keys_per_split(max_len, splits)
    out = torch.empty((queries, hq, d), dtype=q.dtype, device=q.device)
    acc = ml = None
    if splits > 1:
        acc = torch.empty((queries, hq, splits, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((queries, hq, splits, 2), dtype=torch.float32, device=q.device)
    if tree is not None:
        if tree.shape != (r, tokens, tokens):
            raise ValueError(f"a tree mask is [rows, tokens, tokens] = {(r, tokens, tokens)}, got {tuple(tree.shape)}")
        tree = tree.to(torch.uint8).contiguous()
    if written is not None:
        written = written.to(torch.int32).contiguous()
        depth = None if depth is None else depth.to(torch.int32).contiguous()
    args = (_ptr(q), *stores, _ptr(tables), _ptr(seq_lens), _ptr(written), _ptr(depth), _ptr(tree),
            _ptr(out), _ptr(acc), _ptr(ml), _i32(hq), _i32(kvh), _i32(d), _i32(block_size),
            _i32(tables.stride(0)), _i32(0 if written is None else written.shape[1]), _i64(q.stride(0)),
            _i64(q.stride(1)), _i32(tokens), _i64(token_stride), _i32(per), np.float32(1.0 / math.sqrt(d)))
    _run("paged_attention", kernel, q.dtype, launch.paged_decode_launch(queries, hq, d, splits), args, q.device)
    if splits > 1:
        _run("paged_attention", "paged_decode_combine", q.dtype, launch.paged_combine_launch(queries, hq, d),
             (_ptr(acc), _ptr(ml), _ptr(out), _i32(hq), _i32(d), _i32(splits)), q.device)
    return out if q.dim() == 3 else out.view(r, tokens, hq, d).transpose(1, 2)
