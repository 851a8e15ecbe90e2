"""Kernel-against-reference parity cases: random inputs, several shapes, stated tolerances.

``bench/gpu_check.py`` and the GPU tests (``tests/cuda``) run every case with the kernel on a
GPU. With ``kernel=False`` (a dry run, on the CPU) the reference stands in for the kernel, so
the inputs, the references, the launch geometry and the comparison are all exercised without
CuPy. Tolerances are elementwise ``|got - want| <= atol + rtol * |want|``: the kernels round
where the references round, so bf16 differs by reduction order only (an ulp, 2**-8 relative).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyloop.cuda import launch
from tinyloop.cuda import reference as ref

__all__ = ["Case", "CaseResult", "TOLERANCES", "cases", "run_case"]

TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
Tensors = tuple[torch.Tensor, ...]
Build = Callable[[torch.device, torch.dtype, bool], tuple[Tensors, Tensors]]


@dataclass(frozen=True)
class Case:
    name: str  # kernel and shape, e.g. "rmsnorm sandwich H=5280 R=32"
    build: Build  # (device, dtype, kernel) -> (got, want)
    geometry: Callable[[], launch.Launch]  # the launch the case makes (host arithmetic)


@dataclass(frozen=True)
class CaseResult:
    name: str
    dtype: str
    max_err: float  # max |got - want|
    ok: bool


def _gen(device: torch.device, seed: int) -> torch.Generator:  # inputs are drawn on the host
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(shape: tuple[int, ...], g: torch.Generator, device: torch.device, dtype: torch.dtype,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device="cpu") * scale).to(device=device, dtype=dtype)


def _rmsnorm_case(style: str, rows: int, hidden: int, cast_first: bool) -> Case:
    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        g = _gen(device, hidden + rows)
        x, a = _randn((rows, hidden), g, device, dtype), _randn((rows, hidden), g, device, dtype, 2.0)
        w_in = _randn((hidden,), g, device, dtype, 0.1) + 1
        w_out = None if style == "post_ln" else _randn((hidden,), g, device, dtype, 0.1) + 1
        want = ref.residual_rmsnorm_ref(x, a, w_in, w_out, style, 1e-6, cast_first)
        if kernel:
            from tinyloop.cuda import kernels
            got = kernels.residual_rmsnorm(x, a, w_in, w_out, style, 1e-6, cast_first)
        else:
            got = ref.residual_rmsnorm_ref(x.clone(), a.clone(), w_in, w_out, style, 1e-6, cast_first)
        return tuple(t for t in got if t is not None), tuple(t for t in want if t is not None)
    order = "cast_first" if cast_first else "weight_f32"
    return Case(f"rmsnorm {style} {order} R={rows} H={hidden}", build, lambda: launch.rmsnorm_launch(rows, hidden))


def _norm_case(rows: int, hidden: int, cast_first: bool) -> Case:
    """RMSNorm alone (``CudaBackend.rms_norm``): the kernel's mode 3."""
    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        g = _gen(device, hidden * 3 + rows)
        x, w = _randn((rows, hidden), g, device, dtype, 3.0), _randn((hidden,), g, device, dtype, 0.1) + 1
        want = (ref.rms_norm_ref(x, w, 1e-5, cast_first),)
        if kernel:
            from tinyloop.cuda import kernels
            return (kernels.rms_norm(x, w, 1e-5, cast_first),), want
        return (ref.rms_norm_ref(x.clone(), w, 1e-5, cast_first),), want
    return Case(f"rmsnorm alone{' cast_first' if cast_first else ''} R={rows} H={hidden}", build,
                lambda: launch.rmsnorm_launch(rows, hidden))


def _rope_case(style: str, tokens: int, hq: int, hkv: int, d: int, bias: bool, f32: bool) -> Case:
    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        g = _gen(device, tokens * d)
        qkv = _randn((tokens, (hq + 2 * hkv) * d), g, device, dtype)  # the fused projection's output
        q = qkv[:, :hq * d].view(tokens, hq, d)  # strided views, as Attention.project makes them
        k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
        pos = torch.randint(0, 4096, (tokens,), generator=g)
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = pos[:, None].double() * inv
        angles = torch.cat([angles, angles], -1) if style == "half" else angles.repeat_interleave(2, -1)
        cos, sin = angles.cos().float().to(device), angles.sin().float().to(device)
        qb = _randn((hq, d), g, device, dtype, 0.1) if bias else None
        kb = _randn((hkv, d), g, device, dtype, 0.1) if bias else None
        want = ref.rope_ref(q, k, cos, sin, style, qb, kb, f32)
        if kernel:
            from tinyloop.cuda import kernels
            kernels.rope_(q, k, cos, sin, style, qb, kb, f32)
            return (q, k), want
        return ref.rope_ref(q.clone(), k.clone(), cos, sin, style, qb, kb, f32), want
    name = f"rope {style}{' bias' if bias else ''}{' f32' if f32 else ''} N={tokens} H={hq}/{hkv} D={d}"
    return Case(name, build, lambda: launch.rope_launch(tokens, hq, hkv, d))


def _backend_rope_case(style: str, f32: bool) -> Case:
    """``CudaBackend.rope_qk`` as ``Attention`` calls it (q and k views of the fused projection,
    ``[R, T, H, D]``, biases, the context's cos/sin ``[R, 1, T, D]``) against the torch backend."""
    r, t, hq, hkv, d = 3, 2, 6, 2, 32

    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        from tinyloop.model.backend import TORCH

        g = _gen(device, 7 + int(f32))
        qkv = _randn((r, t, (hq + 2 * hkv) * d), g, device, dtype)
        q = qkv[..., :hq * d].view(r, t, hq, d)  # strided views, as Attention.project makes them
        k = qkv[..., hq * d:(hq + hkv) * d].view(r, t, hkv, d)
        angles = torch.rand((r, 1, t, d), generator=g) * 6.0
        cos, sin = angles.cos().to(device), angles.sin().to(device)
        qb, kb = _randn((hq, d), g, device, dtype, 0.1), _randn((hkv, d), g, device, dtype, 0.1)
        want = TORCH.rope_qk(q.clone(), k.clone(), cos, sin, style, qb, kb, f32)
        if kernel:
            from tinyloop.cuda.backend import CudaBackend
            return CudaBackend().rope_qk(q, k, cos, sin, style, qb, kb, f32), want
        return TORCH.rope_qk(q, k, cos, sin, style, qb, kb, f32), want
    return Case(f"backend rope_qk {style}{' f32' if f32 else ''} R={r} T={t} H={hq}/{hkv} D={d}", build,
                lambda: launch.rope_launch(r * t, hq, hkv, d))


def _backend_rope_view_case(style: str, fused: bool) -> Case:
    """``CudaBackend.rope`` on x ``[R, H, T, D]``: with ``fused`` the q and k heads of the fused
    projection's output, rotated together as ``Attention`` does without biases (read where they
    lie, the fused projection untouched); else a contiguous x (rotated through a token-major copy).
    Against the torch backend; the projection's V heads are compared too (left as they were)."""
    r, t, hq, hkv, d = 3, 2, 6, 2, 32

    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        from tinyloop.model.backend import TORCH

        g = _gen(device, 11 + int(fused))
        if fused:
            qkv = _randn((r, t, hq + 2 * hkv, d), g, device, dtype).transpose(1, 2)  # [R, H, T, D] view
            x = qkv[:, :hq + hkv]
        else:
            qkv = x = _randn((r, hq, t, d), g, device, dtype)
        angles = torch.rand((r, 1, t, d), generator=g) * 6.0
        cos, sin = angles.cos().to(device), angles.sin().to(device)
        kept = qkv.clone()
        want = TORCH.rope(x.clone(), cos, sin, style)
        if kernel:
            from tinyloop.cuda.backend import CudaBackend
            return (CudaBackend().rope(x, cos, sin, style), qkv), (want, kept)
        return (TORCH.rope(x, cos, sin, style), qkv), (want, kept)
    layout = "fused projection view" if fused else "contiguous"
    return Case(f"backend rope {style} {layout} R={r} T={t} H={hq + hkv} D={d}", build,
                lambda: launch.rope_launch(r * t, hq + hkv, 0, d))


def _backend_kv_write_case(tokens: int, hkv: int, d: int, kv_mode: str = "full") -> Case:
    """``CudaBackend.kv_write`` as a context calls it (K and V views of the fused projection,
    the pool rows a strided column of a table) against the torch backend's: the whole pool, an
    int4 pool's codes and meta (quantized as torch quantizes on the device) included."""
    heads = 2 * hkv

    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        from tinyloop.model.backend import TORCH
        from tinyloop.model.kvstore import KVStore
        from tinyloop.model.presets import PRESETS
        from tinyloop.vocabulary import KVMode

        g = _gen(device, tokens + hkv)
        config = PRESETS["tiny"].replace(heads=heads, kv_heads=hkv, head_dim=d, hidden=heads * d)
        stores = [KVStore(KVMode.parse(kv_mode), config, 4 * tokens, 16, dtype, device) for _ in range(2)]
        qkv = _randn((tokens, heads + 2 * hkv, d), g, device, dtype, 3.0)  # [N, Hq + 2Hkv, D]
        k, v = qkv[:, heads:heads + hkv], qkv[:, heads + hkv:]
        table = torch.stack([torch.randperm(4 * tokens, generator=g)[:tokens]] * 3, dim=1).to(device)  # [N, 3]
        TORCH.kv_write(stores[1], table[:, 1], k=k, v=v)
        if kernel:
            from tinyloop.cuda.backend import CudaBackend
            CudaBackend().kv_write(stores[0], table[:, 1], k=k, v=v)
        else:
            TORCH.kv_write(stores[0], table[:, 1], k=k, v=v)
        got, want = (tuple(t for f in s.fields.values() for t in f.tensors) for s in stores)
        return got, want
    return Case(f"backend kv_write {kv_mode} N={tokens} Hkv={hkv} D={d}", build,
                lambda: launch.kv_write_launch(tokens, hkv, d) if kv_mode == "full"
                else launch.kv_write_int4_launch(tokens, hkv, d // 32))


def _swiglu_case(rows: int, inter: int) -> Case:
    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        fc = _randn((rows, 2 * inter), _gen(device, rows + inter), device, dtype, 3.0)
        want = (ref.swiglu_ref(fc),)
        if kernel:
            from tinyloop.cuda import kernels
            return (kernels.swiglu(fc),), want
        return (ref.swiglu_ref(fc.clone()),), want
    return Case(f"swiglu R={rows} I={inter}", build, lambda: launch.swiglu_launch(rows, inter))


def _paged_case(lens: tuple[int, ...], hq: int, hkv: int, d: int, gaps: bool, splits: int | None) -> Case:
    bs = 16

    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        g = _gen(device, sum(lens) + d)
        r, max_len = len(lens), max(lens)
        mb = -(-max_len // bs)
        pool_blocks = r * mb + 3
        k_store = _randn((pool_blocks * bs, hkv, d), g, device, dtype)
        v_store = _randn((pool_blocks * bs, hkv, d), g, device, dtype)
        perm = torch.randperm(pool_blocks, generator=g)[:r * mb].view(r, mb)  # scattered blocks
        tables = perm.to(device)
        seq_lens = torch.tensor(lens, dtype=torch.int32).to(device)
        q = _randn((r, hq, d), g, device, dtype)
        written = depth = None
        if gaps:  # some keys stopped after 1 or 2 loops; rows attend at loop slot 0, 1 or 2
            w = torch.full((r, max_len), 1 << 30, dtype=torch.int32)
            w[torch.rand((r, max_len), generator=g) < 0.3] = 1
            w[:, 0] = 1 << 30  # every row keeps at least one key
            w[torch.arange(r), torch.tensor(lens) - 1] = 1 << 30  # and its own
            written, depth = w.to(device), torch.arange(r, dtype=torch.int32).remainder(3).to(device)
        want = (ref.paged_decode_ref(q, k_store, v_store, tables, seq_lens, bs, written, depth),)
        if kernel:
            from tinyloop.cuda import kernels
            return (kernels.paged_decode_attention(q, k_store, v_store, tables, seq_lens, bs, written, depth,
                                                   splits),), want
        return (ref.paged_decode_ref(q, k_store, v_store, tables, seq_lens, bs, written, depth),), want
    name = f"paged decode L={','.join(map(str, lens))} H={hq}/{hkv} D={d}{' gaps' if gaps else ''} splits={splits}"
    return Case(name, build, lambda: launch.paged_decode_launch(len(lens), hq, d, splits or 1))


def _backend_decode_case(lens: tuple[int, ...], hq: int, hkv: int, d: int, kv_mode: str = "full",
                         tokens: int = 1, tree: bool = False) -> Case:
    """``CudaBackend.decode_attention`` as the model calls it (a pool, the pool rows of every key,
    each row's key count) against the torch backend's gather + SDPA; ``kv_mode`` int4: the pool
    quantized as the engine writes it, dequantized in the kernel's read; ``tokens`` > 1: a
    chain's verify, token t of a row over one key more than token t - 1; ``tree``: a tree's
    verify, each new token over the row's past keys and its ancestors among the new ones."""
    bs = 16

    def build(device: torch.device, dtype: torch.dtype, kernel: bool) -> tuple[Tensors, Tensors]:
        from tinyloop.model.backend import TORCH
        from tinyloop.model.kvstore import KVStore
        from tinyloop.model.presets import PRESETS
        from tinyloop.vocabulary import KVMode

        g = _gen(device, sum(lens) + hq)
        r, max_len = len(lens), max(lens) + tokens - 1
        mb = -(-max_len // bs)
        blocks = r * mb + 3
        config = PRESETS["tiny"].replace(heads=hq, kv_heads=hkv, head_dim=d, hidden=hq * d)
        store = KVStore(KVMode.parse(kv_mode), config, blocks * bs, bs, dtype, device)
        every = torch.arange(blocks * bs, device=device)
        store.write(every, k=_randn((blocks * bs, hkv, d), g, device, dtype),
                    v=_randn((blocks * bs, hkv, d), g, device, dtype))
        tables = torch.randperm(blocks, generator=g)[:r * mb].view(r, mb)
        pos = torch.arange(max_len)
        rows = (tables[:, pos // bs] * bs + pos % bs).to(device)  # [R, L] as PagedContext lays them out
        n_keys = torch.tensor(lens).to(device)
        seen = n_keys[:, None] + torch.arange(tokens, device=device)  # [R, T] keys each token sees
        mask = (pos.to(device) < seen[:, :, None])[:, None]  # [R, 1, T, L]
        nodes = None
        if tree:  # random trees: node j's parent is an earlier node; each node sees itself and its ancestors
            nodes = torch.zeros((r, tokens, tokens), dtype=torch.bool)
            for b in range(r):
                for j in range(tokens):
                    nodes[b, j, j] = True
                    if j:
                        nodes[b, j] |= nodes[b, int(torch.randint(0, j, (1,), generator=g))]
            nodes = nodes.to(device)
            first = (n_keys - 1)[:, None, None]  # [R, 1, 1] the first new token's key
            new = pos.to(device)[None, None, :] - first  # [R, 1, L] which new token a key is
            ancestor = nodes.gather(2, new.clamp(0, tokens - 1).expand(r, tokens, max_len))  # [R, T, L]
            mask = mask & ((new < 0) | ancestor)[:, None]
        q = _randn((r, hq, tokens, d), g, device, dtype)
        want = (TORCH.decode_attention(store, q, rows, n_keys, mask, nodes),)
        if kernel:
            from tinyloop.cuda.backend import CudaBackend
            return (CudaBackend().decode_attention(store, q, rows, n_keys, mask, nodes),), want
        if tree:  # without the kernel: each token's own keys gathered and attended, one by one
            k_all, v_all = store.read("k", every, dtype), store.read("v", every, dtype)
            out = torch.empty_like(q)
            for b in range(r):
                for t in range(tokens):
                    keys = rows[b][mask[b, 0, t]]  # [K] the pool rows this token sees
                    out[b, :, t] = TORCH.attention(q[b:b + 1, :, t:t + 1], k_all[keys].transpose(0, 1)[None],
                                                   v_all[keys].transpose(0, 1)[None], None)[0, :, 0]
            return (out,), want
        # without the kernel: the reference of the kernel's own form, on the tables behind the rows
        k_all, v_all = store.read("k", every, dtype), store.read("v", every, dtype)
        got = torch.stack([ref.paged_decode_ref(q[:, :, t], k_all, v_all, ref.tables_of(rows, bs), n_keys + t, bs)
                           for t in range(tokens)], dim=2)  # [R, Hq, T, D]
        return (got,), want
    name = (f"backend decode_attention {kv_mode} KV L={','.join(map(str, lens))} H={hq}/{hkv} D={d} T={tokens}"
            f"{' tree' if tree else ''}")
    return Case(name, build, lambda: launch.paged_decode_launch(len(lens) * tokens, hq, d, 1))


def cases() -> list[Case]:
    """Every parity case: the three block styles and post_ln in both norm orders, Huginn's and the
    ~100M preset's widths, RoPE in both styles with and without bias and float32 compute, and
    paged decode attention (GQA and not, gaps, one split and flash-decoding splits), and the
    backend's decode attention as the model calls it, over full and int4 pools, one token a row
    and a chain's verify."""
    out = [_rmsnorm_case(style, rows, hidden, cf)
           for style in ("pre_ln", "peri_ln", "sandwich", "post_ln")
           for rows, hidden, cf in ((1, 768, False), (32, 5280, True), (7, 1000, False))]
    out += [_norm_case(rows, hidden, cf) for rows, hidden, cf in ((4, 768, False), (3, 5280, True))]
    out += [_rope_case(style, tokens, hq, hkv, d, bias, f32)
            for style in ("half", "interleaved")
            for tokens, hq, hkv, d, bias, f32 in ((1, 12, 12, 64, False, False), (33, 55, 55, 96, True, True),
                                                  (5, 8, 2, 128, True, False))]
    out += [_swiglu_case(rows, inter) for rows, inter in ((1, 3072), (33, 17920), (3, 100))]
    out += [_backend_kv_write_case(tokens, hkv, d, mode) for mode in ("full", "int4")
            for tokens, hkv, d in ((1, 12, 64), (33, 55, 96), (5, 2, 128))]
    out += [_backend_rope_case(style, f32) for style in ("half", "interleaved") for f32 in (False, True)]
    out += [_backend_rope_view_case(style, fused) for style in ("half", "interleaved") for fused in (True, False)]
    out += [_paged_case(lens, hq, hkv, d, gaps, splits)
            for lens, hq, hkv, d, gaps, splits in (
                ((1, 37, 200), 12, 12, 64, False, 1),
                ((600, 17, 2048), 8, 2, 128, False, None),
                ((700, 129, 33), 55, 55, 96, True, 1),
                ((1500, 300), 8, 2, 64, True, 4))]
    out += [_backend_decode_case(lens, hq, hkv, d, mode) for lens, hq, hkv, d, mode in (
        ((1, 37, 200), 4, 2, 64, "full"), ((700, 33), 12, 12, 128, "full"),
        ((1, 37, 200), 4, 2, 64, "int4"), ((700, 33), 12, 12, 128, "int4"))]
    out += [_backend_decode_case(lens, hq, hkv, d, mode, tokens) for lens, hq, hkv, d, mode, tokens in (
        ((1, 37, 200), 4, 2, 64, "full", 5), ((300, 9), 12, 12, 128, "int4", 3))]
    out += [_backend_decode_case(lens, hq, hkv, d, mode, tokens, tree=True) for lens, hq, hkv, d, mode, tokens in (
        ((1, 37, 200), 4, 2, 64, "full", 6), ((300, 9), 12, 12, 128, "int4", 4))]
    return out


def run_case(case: Case, device: torch.device, dtype: torch.dtype, kernel: bool = True) -> CaseResult:
    """Build ``case``, compare what the kernel (or, with ``kernel=False``, the reference again)
    gives against the reference in ``dtype``."""
    case.geometry()  # the launch arithmetic accepts the shape
    got, want = case.build(device, dtype, kernel)
    atol, rtol = TOLERANCES[dtype]
    err, ok = 0.0, len(got) == len(want)
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return CaseResult(case.name, str(dtype).removeprefix("torch."), float("inf"), False)
        diff = (g.float() - w.float()).abs()
        err = max(err, float(diff.max()))
        ok = ok and bool((diff <= atol + rtol * w.float().abs()).all()) and bool(torch.isfinite(g.float()).all())
    return CaseResult(case.name, str(dtype).removeprefix("torch."), err, ok)
