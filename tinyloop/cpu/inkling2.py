"""The Inkling-2 loop model's per-token steps in C (``inkling2.c``, built into the kernels'
library): the attention residual, the cross-pass controller, the short convolution, the decode
attention after its projections, and the experts' routing, activation and recombination.

``tinyloop.model.inkling2`` calls them in the engine's decode steps where the engine put the model
on its CPU backend (the library built), the tensors are float32 and the model is within the
kernels' scratch (``fits``); each function here is the torch code it replaces there, which
the tests check it against on random shapes. Every tensor is float32 on the CPU; a row-strided
input (a slice of a wider projection's output) is read in place. The callers check shapes.
Every tensor whose address a kernel gets is held by a name until the call returns (a temporary's
``.contiguous().data_ptr()`` would be freed first).
"""

from __future__ import annotations

import torch

from tinyloop.cpu import kernels

__all__ = ["fits", "attend_states", "controller", "short_conv", "decode_attention", "route", "activation",
           "combine", "MAX_STATES", "MAX_EXPERTS", "MAX_TOP_K", "MAX_RANK", "MAX_DIM"]

# What the kernels' fixed scratch holds (``inkling2.c``'s INK_MAX_*): a model beyond any runs on torch
MAX_STATES = 64  # block states an attention residual mixes
MAX_EXPERTS = 1024
MAX_TOP_K = 64
MAX_RANK = 256  # a controller's rank
MAX_DIM = 1024  # a head's width, and the relative bias's


def fits(states: int, experts: int, top_k: int, rank: int, dims: tuple[int, ...]) -> bool:
    """Whether a model whose attention residuals mix up to ``states`` states, with ``experts``
    experts, ``top_k`` a token, controllers of ``rank`` and head and relative widths ``dims``
    is within what the kernels hold."""
    return states <= MAX_STATES and experts <= MAX_EXPERTS and top_k <= MAX_TOP_K and rank <= MAX_RANK and all(
        d <= MAX_DIM for d in dims)


def _done(code: int, what: str) -> None:
    if code:
        raise ValueError(f"{what} is beyond the Inkling-2 kernels' scratch (inkling2.c's INK_MAX_*): "
                         "run such a model on torch (``fits``)")


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` ``[..., C]`` as rows of C floats a fixed stride apart (in place where it can be)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[-1] > 1 and flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, (flat.stride(0) if flat.shape[0] > 1 else flat.shape[-1])


def attend_states(states: torch.Tensor, queries: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
                  weight_eps: float = 0.0) -> torch.Tensor:
    """``_attend_states(queries, states)`` (states ``[..., N, H]``, queries ``[Q, H]``: ``[..., Q,
    H]``), then ``_weighted_rms`` of query q's mix by ``weight[q]`` (``[Q, H]`` or ``[H]`` for all)."""
    *lead, n, h = states.shape
    states = states.contiguous()
    queries = queries.contiguous()
    out = states.new_empty(*lead, queries.shape[0], h)
    ld_w = 0
    if weight is not None:
        weight = weight.contiguous()
        ld_w = h if weight.dim() == 2 else 0
    rows = states.numel() // (n * h) if n * h else 0
    code = kernels.load().tl_ink_attend_states(states.data_ptr(), n * h, rows, n, h, queries.data_ptr(),
                                               queries.shape[0], eps, None if weight is None else weight.data_ptr(),
                                               ld_w, weight_eps, out.data_ptr())
    _done(code, f"an attention residual over {n} states")
    return out


def controller(h: torch.Tensor, message: torch.Tensor, down: torch.Tensor, forget_t: torch.Tensor,
               gain_t: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
               weight_eps: float = 0.0) -> torch.Tensor:
    """``_Controller`` (``down`` ``[rank, 2H]``; ``forget_t`` and ``gain_t`` its ``[H, rank]``
    weights transposed, ``[rank, H]``) of h and message ``[..., H]``, then ``_weighted_rms`` by
    ``weight`` ``[H]`` where given."""
    hr, ld_h = _rows(h)
    mr, ld_m = _rows(message)
    # (each contiguous copy held by a name: a temporary would be freed before the call reads it)
    down, forget_t, gain_t = down.contiguous(), forget_t.contiguous(), gain_t.contiguous()
    weight = None if weight is None else weight.contiguous()
    rank, width = forget_t.shape[0], h.shape[-1]
    out = torch.empty(h.shape, dtype=torch.float32)
    gains = torch.empty(width, dtype=torch.float32)
    code = kernels.load().tl_ink_controller(hr.data_ptr(), ld_h, mr.data_ptr(), ld_m, hr.shape[0], width, rank,
                                            down.data_ptr(), forget_t.data_ptr(), gain_t.data_ptr(), eps,
                                            None if weight is None else weight.data_ptr(), weight_eps,
                                            gains.data_ptr(), out.data_ptr())
    _done(code, f"a controller of rank {rank}")
    return out


def short_conv(x: torch.Tensor, tail: torch.Tensor, taps: torch.Tensor, denominator: float,
               dynamic: torch.Tensor | None = None, heads: int = 0, post: str | None = None, group: int = 0,
               post_value: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``_ShortConv`` of x ``[R, T, C]`` after ``tail`` ``[R, K-1, >= C]`` (its earlier inputs, the
    oldest first) with ``taps`` ``[K, C]`` and ``dynamic`` ``[R, T, heads * K]`` per-token taps;
    then ``post``: "clip" each ``group`` channels to L2 norm ``post_value``, or "rms" them with
    eps ``post_value``; then plus ``residual`` ``[R, T, C]``."""
    r, t, c = x.shape
    k = taps.shape[0]
    x = x if x.stride(-1) == 1 and (t == 1 or x.stride(1) == c) else x.contiguous()
    tail = tail if tail.stride(-1) == 1 else tail.contiguous()
    if dynamic is not None and (dynamic.stride(-1) != 1 or (t > 1 and dynamic.stride(1) != dynamic.shape[-1])):
        dynamic = dynamic.contiguous()
    if residual is not None:
        residual = residual.contiguous()
        if x.stride(0) != t * c:
            x = x.contiguous()
    taps = taps.contiguous()
    out = torch.empty(r, t, c, dtype=torch.float32)
    kernels.load().tl_ink_short_conv(
        x.data_ptr(), x.stride(0) if r > 1 else t * c, tail.data_ptr(), tail.stride(0) if r > 1 else 0,
        tail.stride(1) if k > 2 else tail.shape[-1], r, t, c, k, taps.data_ptr(),
        None if dynamic is None else dynamic.data_ptr(), 0 if dynamic is None or r == 1 else dynamic.stride(0), heads,
        denominator, {None: 0, "clip": 1, "rms": 2}[post], group or c, post_value,
        None if residual is None else residual.data_ptr(), out.data_ptr())
    return out


def decode_attention(q: torch.Tensor, q_scale: torch.Tensor, rel: torch.Tensor, rel_scale: torch.Tensor,
                     rel_proj: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, key_positions: torch.Tensor, visible: torch.Tensor,
                     positions: torch.Tensor, kv_heads: int, window: int, log_scale: tuple[float, float] | None,
                     qk_clip: float, rel_clip: float) -> torch.Tensor:
    """``_Attention``'s maths after its projections for one new token a row: q ``[R, HQ * D]``,
    rel ``[R, HQ * DR]``, sink ``[R, HQ]``, gate ``[R, HQ * D]`` (the projections' outputs),
    keys and values ``[R, L, KVH * D]``, key_positions ``[R, L]``, visible ``[R, L]`` (bool),
    positions ``[R]``; ``window`` 0 for none, ``log_scale`` (alpha, floor) on full layers. Returns
    the gated mix ``[R, HQ * D]`` (before the output projection)."""
    hq, d = q_scale.shape
    dr, extent = rel_proj.shape
    r, n_keys = key_positions.shape
    qr, ld_q = _rows(q)
    relr, ld_rel = _rows(rel)
    sinkr, ld_sink = _rows(sink)
    gater, ld_gate = _rows(gate)
    if keys.stride(-1) != 1 or values.stride() != keys.stride():  # (the kernel reads both with one stride)
        keys, values = keys.contiguous(), values.contiguous()
    key_positions = key_positions.contiguous()
    visible = visible.contiguous()
    positions = positions.contiguous()
    q_scale, rel_scale, rel_proj = q_scale.contiguous(), rel_scale.contiguous(), rel_proj.contiguous()
    out = torch.empty(r, hq * d, dtype=torch.float32)
    scratch = torch.empty(max(n_keys, 1), dtype=torch.float32)
    alpha, floor = log_scale if log_scale is not None else (0.0, 1.0)
    code = kernels.load().tl_ink_decode_attention(
        qr.data_ptr(), ld_q, q_scale.data_ptr(), relr.data_ptr(), ld_rel, rel_scale.data_ptr(), rel_proj.data_ptr(),
        dr, extent, sinkr.data_ptr(), ld_sink,
        gater.data_ptr(), ld_gate, keys.data_ptr(), values.data_ptr(), keys.stride(0) if r > 1 else 0,
        keys.stride(1) if n_keys > 1 else keys.shape[-1], key_positions.data_ptr(), visible.data_ptr(),
        positions.data_ptr(), r, n_keys, hq, kv_heads, d, window, int(log_scale is not None), alpha, float(floor),
        qk_clip, rel_clip, scratch.data_ptr(), out.data_ptr())
    _done(code, f"an attention of head width {d} and relative width {dr}")
    return out


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_MoE.route`` of the tokens x ``[N, H]`` by ``router`` ``[E, H]`` and ``bias`` ``[E]``, then
    grouped by expert (tokens in order within one): each pair's token row ``[N * k, H]``, its
    token's index ``[N * k]``, its weight ``[N * k]``, and the pairs per expert ``[E]``."""
    xr, ld = _rows(x)
    n, h = xr.shape
    e = router.shape[0]
    picked = torch.empty(n * top_k, h, dtype=torch.float32)
    tokens = torch.empty(n * top_k, dtype=torch.int64)
    weights = torch.empty(n * top_k, dtype=torch.float32)
    counts = torch.empty(e, dtype=torch.int64)
    scratch = torch.empty(n * top_k, dtype=torch.int64)
    weight_scratch = torch.empty(n * top_k, dtype=torch.float32)
    router, bias = router.contiguous(), bias.contiguous()
    code = kernels.load().tl_ink_route(xr.data_ptr(), ld, n, h, router.data_ptr(), bias.data_ptr(), e, top_k, scale,
                                       picked.data_ptr(), tokens.data_ptr(), weights.data_ptr(), counts.data_ptr(),
                                       scratch.data_ptr(), weight_scratch.data_ptr())
    _done(code, f"routing to {top_k} of {e} experts")
    return picked, tokens, weights, counts


def activation(gate_up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """``_MoE._activation`` of ``gate_up`` ``[M, 2I]``: ``[M, I]``."""
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    kernels.load().tl_ink_activation(gate_up.data_ptr(), m, two_i // 2, gate_cap, up_cap, out.data_ptr())
    return out


def combine(down: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, H]``: each row of ``down`` ``[M, H]`` times its weight, summed into its token's row."""
    down = down.contiguous()
    out = torch.empty(n, down.shape[1], dtype=torch.float32)
    kernels.load().tl_ink_combine(down.data_ptr(), tokens.data_ptr(), weights.data_ptr(), down.shape[0], n,
                                  down.shape[1], out.data_ptr())
    return out
