"""Torch references of the kernels in this package: what each kernel must compute.

They are written with the model's own ops (``TorchBackend``, the ``Block`` order of norms and
adds, ``PagedContext``'s index math), so a kernel that matches its reference matches the
model. ``tests/cuda`` checks them against the model on the CPU; ``bench/gpu_check.py`` checks
each kernel against them on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyloop.model.backend import TORCH
from tinyloop.model.context import PagedContext

__all__ = ["STYLE_MODES", "rms_norm_ref", "residual_rmsnorm_ref", "rope_ref", "swiglu_ref",
           "paged_decode_ref", "tables_of", "decode_index"]

# Block style -> rmsnorm.cu mode: pre_ln 0 (x + a), peri_ln / post_ln 1 (x + N(a)), sandwich 2.
STYLE_MODES = {"pre_ln": 0, "peri_ln": 1, "post_ln": 1, "sandwich": 2}


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool) -> torch.Tensor:
    """``RMSNorm`` in either reference order (``norm_order``)."""
    if cast_first:
        return TORCH.rms_norm_cast_first(x, weight, eps)
    return TORCH.rms_norm(x, weight, eps)


def residual_rmsnorm_ref(x: torch.Tensor, a: torch.Tensor, w_in: torch.Tensor | None, w_out: torch.Tensor | None,
                         style: str, eps: float, cast_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual ``r`` after a sublayer's output ``a`` joins ``x``, and the next norm of it
    ``y = N(r, w_out)`` (None when ``w_out`` is None: post_ln has no pre-norm), per ``Block``:
    pre_ln ``r = x + a``; peri_ln and post_ln ``r = x + N(a, w_in)``; sandwich ``r = N(x + a, w_in)``
    (``Backend.residual_norm``, as the torch backend computes it)."""
    if style not in STYLE_MODES:
        raise ValueError(f"unknown block style {style!r}")
    return TORCH.residual_norm(x, a, w_in, w_out, style, eps, cast_first)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
             q_bias: torch.Tensor | None = None, k_bias: torch.Tensor | None = None,
             compute_float32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[N, Hq, D]`` and k ``[N, Hkv, D]`` (token-major) with their biases added, rotated at
    cos/sin ``[N, D]`` as ``Attention.forward`` does (``Rope.apply``)."""
    def one(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None:
            x = x + bias
        xr = x.permute(1, 0, 2)[None]  # [1, H, N, D]
        if compute_float32 and x.dtype != torch.float32:
            out = TORCH.rope(xr.float(), cos[None], sin[None], style).to(x.dtype)
        else:
            out = TORCH.rope(xr, cos[None], sin[None], style)
        return out[0].permute(1, 0, 2)
    return one(q, q_bias), one(k, k_bias)


def swiglu_ref(fc: torch.Tensor) -> torch.Tensor:
    """``MLP``'s activation: ``silu(gate) * up`` of ``fc = [gate; up]`` ``[..., 2I]``."""
    gate, up = fc.chunk(2, dim=-1)
    return F.silu(gate) * up


def paged_decode_ref(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, tables: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, written: torch.Tensor | None = None,
                     depth: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged pool, as ``PagedContext.attend`` gathers and masks it.

    q ``[R, Hq, D]``; k_store/v_store ``[pool_rows, Hkv, D]``; tables ``[R, MB]`` each row's
    block table for its slot; seq_lens ``[R]`` keys per row; written ``[R, L]`` and depth
    ``[R]`` the gap mask (a key counts where ``written > depth``). Returns ``[R, Hq, D]``."""
    length = int(seq_lens.max())
    pos = torch.arange(length, device=q.device)
    rows = tables[:, pos // block_size] * block_size + pos % block_size  # [R, L] pool rows
    k = k_store[rows].transpose(1, 2).to(q.dtype)  # [R, Hkv, L, D]
    v = v_store[rows].transpose(1, 2).to(q.dtype)
    mask = pos[None, :] < seq_lens[:, None].to(pos.device)  # [R, L]
    if written is not None and depth is not None:
        mask = mask & (written[:, :length] > depth[:, None])
    out = TORCH.attention(q[:, :, None], k, v, mask[:, None, None, :])  # [R, Hq, 1, D]
    return out[:, :, 0]


def tables_of(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block tables ``[R, ceil(L / block_size)]`` behind pool rows ``[R, L]`` laid out as
    ``PagedContext`` lays a slot's keys out (key p of a row at ``table[p // bs] * bs + p % bs``):
    what ``Backend.decode_attention`` is handed, in the form ``paged_attention.cu`` reads."""
    return rows[:, ::block_size] // block_size


def decode_index(ctx: PagedContext, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                   torch.Tensor | None, torch.Tensor | None]:
    """What the kernel reads for a one-token ``ctx`` at ``slots`` (one per row): the block table
    of each row's slot ``[R, MB]``, its key count ``[R]`` (int32), and the gap mask's written
    ``[R, L]`` and depth ``[R]`` (int32; None when no key has a gap): ``PagedContext``'s index
    math (``_flat_index``, ``_mask``) in the form ``paged_attention.cu`` takes."""
    rows = torch.arange(slots.numel(), device=slots.device)
    tables = ctx.tables[rows, slots]  # [R, MB]
    seq_lens = ctx.mask[:, 0, -1].sum(-1).to(torch.int32)  # the new token's row of the causal mask
    gaps = ctx._gaps
    if gaps is None:
        return tables, seq_lens, None, None
    written, coda_start = gaps
    config = ctx.pool.config
    core = (slots >= config.n_prelude) & (slots < coda_start)
    depth = torch.where(core, (slots - config.n_prelude) // config.n_core, -1)
    return tables, seq_lens, written.clamp(max=2**31 - 1).to(torch.int32), depth.to(torch.int32)
