"""Transformer building blocks: RMSNorm, RoPE, attention with pluggable KV, SwiGLU MLP, Block.

Attention does not own a cache: it hands its q, k, v to an ``AttentionContext`` (see
``tinyloop.model.context``) which writes K and V where the sequence keeps them and attends. It
hands over its input h and itself too: a context in h-mode stores h and calls back
``Attention.kv_from_h`` to recompute the keys' K and V with this layer's projection. RMSNorm,
SwiGLU and RoPE run on the module's kernel backend (``backend.py``; ``LoopedLM.use_backend``).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tinyloop.model.backend import TORCH, Backend
from tinyloop.model.config import VALUE_GATE_CHANNELS, ModelConfig

__all__ = ["RMSNorm", "Rope", "Attention", "MLP", "Block", "AttentionContext", "HookFree"]


class HookFree(nn.Module):
    """A module called straight through to ``forward``, without ``nn.Module.__call__``'s hook
    machinery: that costs about as much as a small op (1-2 us), and a decode step calls a dozen
    modules per layer. Forward hooks registered on these modules do not run."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class AttentionContext(Protocol):
    """Where attention finds positions, past keys and values for the rows of one forward."""

    def rope(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the new positions of ``rows``: ``[R, 1, T, D]`` each (``Rope.apply``'s)."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None, slots: torch.Tensor | int,
               h: torch.Tensor | None = None, layer: Attention | None = None) -> torch.Tensor:
        """Store k, v (or h) in ``slots`` (one per row, or one int for all) and attend; q ``[R, Hq, T, D]``, k/v
        ``[R, Hkv, T, D]`` after RoPE, h ``[R, T, H]`` the attention input, ``layer`` the
        attention whose projection recomputes K, V from stored h."""
        ...


class RMSNorm(HookFree):
    backend: Backend = TORCH

    def __init__(self, dim: int, eps: float, cast_first: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.cast_first = cast_first  # the reference order: cast to x's dtype, then the weight
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast_first:
            return self.backend.rms_norm_cast_first(x, self.weight, self.eps)
        return self.backend.rms_norm(x, self.weight, self.eps)


class Rope:
    """RoPE tables up to ``max_position``; ``half`` rotates halves, ``interleaved`` adjacent pairs.

    The tables (``cos``, ``sin``: ``[max_position, head_dim]`` float32 each) are built on first
    use, on ``device``: a model built only to be checked against a file, or to be loaded onto
    another device, never pays for them on the host.
    """

    backend: Backend = TORCH

    def __init__(self, head_dim: int, max_position: int, theta: float, style: str,
                 tables: str = "float64", compute: str = "input",
                 llama3: tuple[float, float, float, int] | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.style = style
        self.compute_float32 = compute == "float32"
        self.head_dim, self.max_position, self.theta, self.llama3 = head_dim, max_position, theta, llama3
        self.table_dtype = tables
        self.device = torch.device(device)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    @property
    def built(self) -> bool:
        """Whether the tables exist yet."""
        return self._cos is not None

    @property
    def cos(self) -> torch.Tensor:
        return self.build()[0]

    @property
    def sin(self) -> torch.Tensor:
        return self.build()[1]

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables, made now if not yet (a server makes them at load, not inside its first
        request)."""
        if self._cos is None or self._sin is None:
            self._cos, self._sin = self._make()
        return self._cos, self._sin

    def _make(self) -> tuple[torch.Tensor, torch.Tensor]:
        # The references build their tables in float32: at position 4k an fp64 table's cos
        # differs by 3.6e-4, at 64k by 4.7e-3, so a converted model builds them as its reference.
        width = torch.float64 if self.table_dtype == "float64" else torch.float32
        d = self.head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=width, device=self.device) / d))
        if self.llama3 is not None:
            inv = llama3_frequencies(inv, *self.llama3)
        angles = torch.outer(torch.arange(self.max_position, dtype=width, device=self.device), inv)  # [P, D/2]
        return self._widen(angles.cos().float()), self._widen(angles.sin().float())  # [P, D] each

    def _widen(self, half: torch.Tensor) -> torch.Tensor:
        """``[P, D/2]`` -> ``[P, D]`` in the style's layout."""
        if self.style == "half":
            return torch.cat([half, half], dim=-1)
        return half.repeat_interleave(2, dim=-1)

    def to(self, device: torch.device | str) -> None:
        """Move the tables (when built) to ``device``; later builds happen there."""
        self.device = torch.device(device)
        if self._cos is not None and self._sin is not None:
            self._cos, self._sin = self._cos.to(self.device), self._sin.to(self.device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.build()
        flat = positions.reshape(-1)  # index_select: a fraction of advanced indexing's cost per call
        shape = (*positions.shape, cos.shape[-1])
        return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[R, H, T, D]``; cos/sin ``[R, T, D]`` or ``[R, 1, T, D]``."""
        if self.compute_float32 and x.dtype != torch.float32:
            return self.backend.rope(x.float(), cos, sin, self.style).to(x.dtype)
        return self.backend.rope(x, cos, sin, self.style)

    def apply_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_bias: torch.Tensor | None, k_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[R, T, Hq, D]`` and k ``[R, T, Hkv, D]`` from the projection, their biases added,
        rotated: ``[R, H, T, D]`` each (``Backend.rope_qk``: one kernel for both on a GPU)."""
        return self.backend.rope_qk(q, k, cos, sin, self.style, q_bias, k_bias, self.compute_float32)


def llama3_frequencies(inv: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_max_position: int) -> torch.Tensor:
    """Llama-3's RoPE scaling of the inverse frequencies ``inv``: wavelengths longer than
    ``original / low_freq_factor`` are divided by ``factor``, shorter than ``original /
    high_freq_factor`` kept, those between interpolated smoothly (in ``inv``'s dtype)."""
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_for(config: ModelConfig, device: torch.device | str = "cpu") -> Rope:
    """The RoPE of a config, with the numerics and the frequency scaling it names (its tables
    built on ``device`` when first used)."""
    llama3 = None
    if config.rope_scaling == "llama3":
        llama3 = (config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
                  config.rope_original_max_position)
    return Rope(config.head_dim, config.max_position, config.rope_theta, config.rope_style,
                tables=config.rope_tables, compute=config.rope_compute, llama3=llama3, device=device)


class Attention(HookFree):
    """Self-attention over the context's KV. ``value_embed``: this layer adds a gated per-token
    value embedding to v (Parcae: ``v += 2 sigmoid(value_gate(x[..., :32])) * value_table[token]``,
    the tokens handed in by the caller as ``ids``)."""

    def __init__(self, config: ModelConfig, value_embed: bool = False) -> None:
        super().__init__()
        self.config = config
        q_dim, kv_dim = config.q_dim, config.kv_dim
        if config.fused_qkv:
            self.qkv = nn.Linear(config.hidden, q_dim + 2 * kv_dim, bias=False)
        else:
            self.q = nn.Linear(config.hidden, q_dim, bias=False)
            self.k = nn.Linear(config.hidden, kv_dim, bias=False)
            self.v = nn.Linear(config.hidden, kv_dim, bias=False)
        if config.qk_bias:
            self.q_bias = nn.Parameter(torch.zeros(config.heads, config.head_dim))
            self.k_bias = nn.Parameter(torch.zeros(config.kv_heads, config.head_dim))
        if config.qk_norm:
            cast_first = config.norm_order == "cast_then_weight"
            self.q_norm = RMSNorm(q_dim, config.norm_eps, cast_first)
            self.k_norm = RMSNorm(kv_dim, config.norm_eps, cast_first)
        self.o = nn.Linear(q_dim, config.hidden, bias=False)
        self.value_embed = value_embed
        if value_embed:
            self.value_table = nn.Embedding(config.vocab_size, kv_dim)
            self.value_gate = nn.Linear(VALUE_GATE_CHANNELS, config.kv_heads, bias=False)
            # a few hundred weights: quantising them saves nothing, and a float gate lets the fused
            # C step (cpu/block.py) add the value embedding itself
            self.value_gate.keep_float = True  # type: ignore[assignment]
        # q and k straight from the fused projection: RoPE rotates both in one call
        self.rope_qk_together = (config.fused_qkv and not config.qk_norm and not config.qk_bias
                                 and not value_embed)

    def project(self, x: torch.Tensor, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[R, T, H]`` -> q ``[R, T, Hq, D]``, k and v ``[R, T, Hkv, D]`` (before RoPE; with
        ``bias=False`` q and k without their biases, which ``Rope.apply_qk`` adds)."""
        c = self.config
        if c.fused_qkv:
            q, k, v = self.qkv(x).split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.unflatten(-1, (c.heads, c.head_dim))
        k = k.unflatten(-1, (c.kv_heads, c.head_dim))
        v = v.unflatten(-1, (c.kv_heads, c.head_dim))
        if c.qk_bias and bias:
            q = q + self.q_bias
            k = k + self.k_bias
        return q, k, v

    def _add_value_embed(self, v: torch.Tensor, x: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """v ``[R, T, Hkv, D]`` plus the gated value embedding of each token ``ids`` ``[R, T]``."""
        if ids is None:
            raise ValueError("this layer adds value embeddings: its caller must hand in the rows' tokens (ids)")
        gate = 2 * torch.sigmoid(self.value_gate(x[..., :VALUE_GATE_CHANNELS]))  # [R, T, Hkv]
        out: torch.Tensor = v + gate.unsqueeze(-1) * self.value_table(ids).view(v.shape)
        return out

    def kv_from_h(self, h: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h ``[..., H]`` -> k, v ``[..., Hkv, D]`` before RoPE (k with its bias): h-mode's
        recompute, in ``dtype`` (default: the weights'); equal to ``project``'s k and v."""
        c = self.config
        weight = self._kv_weight(dtype)  # [2 * kv_dim, H]
        kv = F.linear(h.to(weight.dtype), weight)  # [..., 2 * kv_dim]
        if c.qk_norm:
            kv = torch.cat([self.k_norm(kv[..., :c.kv_dim]), kv[..., c.kv_dim:]], dim=-1)
        k, v = kv.reshape(*kv.shape[:-1], 2, c.kv_heads, c.head_dim).unbind(-3)
        if c.qk_bias:
            k = k + self.k_bias.to(k.dtype)
        return k, v

    def _kv_weight(self, dtype: torch.dtype | None) -> torch.Tensor:
        """``[W_k; W_v]`` ``[2 * kv_dim, H]`` in ``dtype``: a view of the fused weight, else a
        copy per call. Not cached: the copy costs as much as projecting ~20 keys' h and a cache
        could go stale when the weights change in place."""
        c = self.config
        if c.fused_qkv:
            weight = self.qkv.weight[c.q_dim:]
        else:
            weight = torch.cat([self.k.weight, self.v.weight])
        return weight if dtype is None else weight.to(dtype)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, rope: Rope,
                rows: torch.Tensor | None, slots: torch.Tensor | int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[R, T, H]`` (the normed attention input); ``ids`` ``[R, T]``: the rows' tokens,
        needed (and only read) when the layer adds value embeddings."""
        cos, sin = ctx.rope(rows)
        if self.rope_qk_together:
            c = self.config
            heads = c.heads + c.kv_heads
            qkv = self.qkv(x).unflatten(-1, (heads + c.kv_heads, c.head_dim)).transpose(1, 2)  # [R, Hq+2Hkv, T, D]
            qk = rope.apply(qkv[:, :heads], cos, sin)  # [R, Hq+Hkv, T, D]
            q, k, v = qk[:, :c.heads], qk[:, c.heads:], qkv[:, heads:]
        else:
            q, k, v = self.project(x, bias=False)
            biased = self.config.qk_bias
            q, k = rope.apply_qk(q, k, cos, sin, self.q_bias if biased else None, self.k_bias if biased else None)
            if self.value_embed:
                v = self._add_value_embed(v, x, ids)
            v = v.transpose(1, 2)  # [R, Hkv, T, D], as q and k
        if self.config.qk_head_norm:  # Parcae: weightless, per head, after RoPE (eps: the dtype's)
            q, k = F.rms_norm(q, (q.shape[-1],)), F.rms_norm(k, (k.shape[-1],))
        out = ctx.attend(q, k, v, rows, slots, x, self)  # [R, Hq, T, D]
        y: torch.Tensor = self.o(out.transpose(1, 2).flatten(-2))  # [R, T, H]
        return y


class MLP(HookFree):
    """SwiGLU with one fused input projection: ``fc`` = [gate; up], then ``proj``; the activation
    on the module's kernel backend. ``relu2`` (Parcae): ``proj(0.5 * relu(fc(x))^2)``, no gate."""

    backend: Backend = TORCH

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.relu2 = config.mlp == "relu2"
        width = config.intermediate if self.relu2 else 2 * config.intermediate
        self.fc = nn.Linear(config.hidden, width, bias=False)
        self.proj = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.relu2:
            y: torch.Tensor = self.proj(F.relu(self.fc(x)).square().mul(0.5))
            return y
        y = self.proj(self.backend.swiglu(self.fc(x)))
        return y


class FusedStep(Protocol):
    """A block's step run natively (``cpu.block.FusedBlock``): ``Block.run``'s result, or None
    for a call it does not cover (the block then runs its modules)."""

    def run(self, x: torch.Tensor, ctx: AttentionContext, rows: torch.Tensor | None, slots: torch.Tensor | int,
            normed: torch.Tensor | None, then: RMSNorm | None,
            ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        ...

    def run_stack(self, blocks: nn.ModuleList, x: torch.Tensor, ctx: AttentionContext,
                  slot0: int) -> torch.Tensor | None:
        """Every row of x through ``blocks`` (this one first), block i at slot ``slot0 + i``, in
        one native call: the stack's output, or None where the call is not covered."""
        ...


class Block(HookFree):
    """One transformer layer in one of four norm placements.

    ``pre_ln``:   x = x + attn(n1(x));      x = x + mlp(n3(x))
    ``peri_ln``:  x = x + n2(attn(n1(x)));  x = x + n4(mlp(n3(x)))   (Ouro)
    ``sandwich``: x = n2(x + attn(n1(x)));  x = n4(x + mlp(n3(x)))   (Huginn)
    ``post_ln``:  x = x + n2(attn(x));      x = x + n4(mlp(x))       (OLMo-2; no n1, n3)

    Each residual add runs with its norms in one backend call (``Backend.residual_norm``: the
    sublayer's own norm n2 or n4, and after the attention the MLP's input norm n3; after the MLP,
    in a stack, the next block's n1: ``run``).
    """

    backend: Backend = TORCH
    # the whole decode step in one native call where the backend covers it (``cpu.block``)
    fused: FusedStep | None = None

    def __init__(self, config: ModelConfig, value_embed: bool = False) -> None:
        super().__init__()
        self.style = config.block_style
        self.eps = eps = config.norm_eps
        self.cast_first = cast_first = config.norm_order == "cast_then_weight"
        if self.style != "post_ln":
            self.attn_norm = RMSNorm(config.hidden, eps, cast_first)
            self.mlp_norm = RMSNorm(config.hidden, eps, cast_first)
        if self.style != "pre_ln":
            self.attn_post_norm = RMSNorm(config.hidden, eps, cast_first)
            self.mlp_post_norm = RMSNorm(config.hidden, eps, cast_first)
        self.attn = Attention(config, value_embed)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, rope: Rope,
                rows: torch.Tensor | None, slots: torch.Tensor | int, ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(x, ctx, rope, rows, slots, ids=ids)[0]

    def run(self, x: torch.Tensor, ctx: AttentionContext, rope: Rope, rows: torch.Tensor | None,
            slots: torch.Tensor | int, normed: torch.Tensor | None = None,
            then: RMSNorm | None = None, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` in a stack of blocks: ``normed`` is this block's input norm n1(x) when the
        block before made it, and ``then`` the next block's input norm, applied to the output in
        the last residual's backend call; ``ids`` the rows' tokens (value embeddings: ``Attention``).
        Returns the output and ``then`` of it (None without)."""
        if self.fused is not None and (done := self.fused.run(x, ctx, rows, slots, normed, then, ids)) is not None:
            return done
        join, style, eps, cast_first = self.backend.residual_norm, self.style, self.eps, self.cast_first
        post = style != "pre_ln"
        h: torch.Tensor | None
        if style == "post_ln":
            x, _ = join(x, self.attn(x, ctx, rope, rows, slots, ids), self.attn_post_norm.weight, None, style, eps,
                        cast_first)
            h = x
        else:
            a = self.attn(self.attn_norm(x) if normed is None else normed, ctx, rope, rows, slots, ids)
            x, h = join(x, a, self.attn_post_norm.weight if post else None, self.mlp_norm.weight, style, eps,
                        cast_first)
        assert h is not None  # (the next norm is asked for: it comes back)
        return join(x, self.mlp(h), self.mlp_post_norm.weight if post else None,
                    None if then is None else then.weight, style, eps, cast_first)
