"""Inkling-2 loop (``model_type`` ``inkling2_loop``, text config ``inkling2_loop_text``): its text
stack as a torch model, checked against the reference (transformers 5.24
``modeling_inkling2_loop.py``) to within 1e-5 in the logits (this model's float32 noise floor is
~5e-6: one ulp on the embeddings moves its logits by ~8e-6). Two forwards over the same layers: the
reference path (``model(ids, passes)``, ``step`` over an ``Inkling2Cache``) and the engine's
(``serve``: rows of a batch at their own pass counts, K, V and the convolutions' inputs in the
engine's paged pool, ``_PagedMemory``). The vision tower is not modelled.

How it maps onto a looped transformer
-------------------------------------
Layers ``[0, loop_start)`` are the prelude, ``[loop_start, loop_end)`` the looped core (the
checkpoint's "middle cycle"; both ends are multiples of ``n_layers_per_attn_res_block``, and
``loop_start > 0``), ``[loop_end, num_hidden_layers)`` the coda. The residual stream is cut into
blocks of ``n_layers_per_attn_res_block`` layers: a boundary layer appends its input to the block
states and starts a new residual (its output is its attention plus MLP output, without its input).
Every layer reads its attention input and its MLP input through learned queries that attend, per
token, over the RMS-normalised block states plus the running partial block ("attention
residuals"; full-attention layers use three queries, for q, k and v; layer 0 reads its input as
is). The final norm reads the same way through ``final_query``.

Pass 1 runs the core once on the prelude's output. Every later pass *restarts* from the prelude's
output hidden state and block states: it does not continue from the previous pass's output. What
carries over is a message: for core layer ``j``, four learned queries (q, k, v, MLP:
``q_mlp_messages[j]``, ``kv_messages[j]``; the checkpoint's ``middle_cycle_cross_pass_queries``
and ``..._kv_queries``) attend over the previous pass's final hidden state and the block states
it appended at core boundaries after the first (the first is the prelude's output again), and a
low-rank controller per input (``gates.{q,k,v,mlp}``, the checkpoint's ``controllers.{attn,k,v,
mlp}``: ``(1 - tanh(forget(z))) * h + tanh(gain(z)) * message`` with ``z = down([rms(h);
rms(message)])``) mixes it into the layer's q/k/v attention inputs (before their norms) and its
MLP input. Pass 1 has no message and never uses the controllers. The coda and the head see only
the last pass's hidden state and block states.

KV: each pass has its own copy of every core layer's cache (pass p attends to the keys pass p
wrote for earlier tokens), so a core layer holds ``passes`` K/V sets and prelude and coda layers
one: ``num_hidden_layers + (passes - 1) * (loop_end - loop_start)`` layer instances. Sliding
layers (``hybrid_sliding``) attend to the last ``sliding_window_size`` tokens, self included, and
keep the last ``window - 1`` K/V; full layers (``hybrid``) keep all. Attention adds a per-token
sink logit (``sink``: one per head, projected from the query's input, its value zero), a
hidden-state-conditioned relative position bias over backward distances ``< rel_extent`` (the
window in sliding layers), L2 clipping of q and k, a log-position scale of q and of the bias's
relative states (full layers, from position ``log_scaling_n_floor``), an RMS-normalised v and a
sigmoid gate on the output; there is no RoPE, so positions enter only through the bias, the
masks and the log scale. The MLP is a sigmoid-routed mixture of experts (top-k on score plus a
correction bias that only selects; weights renormalised and times ``route_scale``) with
softcapped SwiGLU experts; the logits are the first ``unpadded_vocab_size`` rows of the padded
unembedding, softcapped.

Pass count at inference: the reference reads ``text_config.loop_num_passes`` on every call
(TinyLoop: the ``passes`` argument, 1..``MAX_PASSES``). The queries and controllers are shared by
all passes, so any count runs: the reference accepts any count >= 1 without a warning, including
counts the model was not trained at (1 skips the controllers altogether); it neither records nor
enforces a trained count (the config's default is 3). Its cache is sized on first use (``passes -
1`` extra copies of the core layers): a later call with more passes fails (IndexError), one with
fewer leaves stale copies. ``Inkling2Cache`` pins the count at its first step and refuses a change.

State beyond K/V: four causal short convolutions per layer instance (kernel ``K`` =
``conv_kernel_size``, each added to its input and divided by ``sqrt(K + 1)``, or ``sqrt(2K + 1)``
with per-token taps): on the key and value projections (width ``kv_heads * head_dim`` each; in
full layers with per-token taps projected from the layer's k/v input) and on the attention and
MLP outputs (width ``hidden``). A cached decode keeps the last ``K - 1`` inputs of each, per
sequence and layer instance: ``(K - 1) * (2 * kv_heads * head_dim + 2 * hidden)`` float32 values,
a fixed size that does not grow with the sequence (the reference keeps ``K``). Nothing else
carries between steps: sinks, biases and gates are computed from the new tokens alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tinyloop.cpu import inkling2 as native_ops
from tinyloop.cpu.backend import CPU
from tinyloop.errors import ConfigError, RequestError
from tinyloop.model.config import ModelConfig
from tinyloop.model.looped import ForwardOutput

__all__ = ["MAX_PASSES", "MAX_PARAMETERS", "Inkling2Cache", "Inkling2Config", "Inkling2LM", "Transform",
           "inkling2_tensor_map", "load_inkling2"]

MAX_PASSES = 64  # passes per forward: a bound on the work and the per-pass KV, not a trained count
MAX_PARAMETERS = 1 << 38  # the text model's parameter count, checked before anything is allocated
_RES_EPS = 1e-6  # the attention residuals' RMS norm ignores rms_norm_eps in the reference
_CLIP_EPS = 1e-6
# Whether the engine's forward may run a decode step's per-token maths in C (``tinyloop.cpu.inkling2``)
# where the engine put the model on its CPU kernels (``Engine(cpu_kernels=True)``, the default, and
# the library built): tests turn it off to compare against the torch ops.
NATIVE = [True]
_SLIDING, _FULL = "hybrid_sliding", "hybrid"

# config.json key -> inclusive bounds
_INTS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22), "unpadded_vocab_size": (1, 1 << 22), "hidden_size": (1, 1 << 16),
    "num_hidden_layers": (1, 1024), "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024),
    "head_dim": (1, 1024), "swa_num_attention_heads": (1, 1024), "swa_num_key_value_heads": (1, 1024),
    "swa_head_dim": (1, 1024), "sliding_window_size": (1, 1 << 24), "d_rel": (1, 1024),
    "rel_extent": (1, 1 << 20), "log_scaling_n_floor": (1, 1 << 40), "conv_kernel_size": (1, 64),
    "moe_intermediate_size": (1, 1 << 17), "n_routed_experts": (1, 4096), "num_experts_per_tok": (1, 4096),
    "n_layers_per_attn_res_block": (1, 1024), "loop_layer_index_start": (1, 1024),
    "loop_layer_index_end": (1, 1024), "loop_num_passes": (1, MAX_PASSES), "loop_gate_rank": (1, 1 << 16),
    "max_position_embeddings": (1, 1 << 21),
}
# config.json key -> (low, high, low inclusive)
_FLOATS: dict[str, tuple[float, float, bool]] = {
    "rms_norm_eps": (0.0, 1.0, False), "log_scaling_alpha": (0.0, 100.0, True),
    "qk_l2_clip_threshold": (0.0, 1e6, False), "rel_l2_clip_threshold": (0.0, 1e6, False),
    "mlp_gate_softcap": (0.0, 1e6, False), "mlp_up_softcap": (0.0, 1e6, False),
    "final_logit_softcapping": (0.0, 1e6, False), "route_scale": (0.0, 1e6, False),
}
_LOOP_CONFIG = {"core_start": "loop_layer_index_start", "core_end": "loop_layer_index_end",
                "num_passes": "loop_num_passes", "gate_rank": "loop_gate_rank"}


def _int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config.json: text_config.{key} must be an integer, got {value!r}")
    low, high = _INTS[key]
    if not low <= value <= high:
        raise ConfigError(f"config.json: text_config.{key} is {value}; it must be in [{low}, {high}]")
    return value


def _float(cfg: dict[str, Any], key: str) -> float:
    value = cfg.get(key)
    low, high, closed = _FLOATS[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not (low <= value if closed else low < value) or value > high:
        raise ConfigError(f"config.json: text_config.{key} must be a number in {'[' if closed else '('}"
                          f"{low}, {high}], got {value!r}")
    return float(value)


def _text_section(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text config of a ``inkling2_loop`` config.json, or the file itself if it is one;
    ``loop_config`` (the original checkpoints' spelling) overrides the ``loop_*`` keys."""
    if not isinstance(cfg, dict):
        raise ConfigError("config.json must hold an object")
    if cfg.get("model_type") == "inkling2_loop":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json: text_config must be an object")
    elif cfg.get("model_type") == "inkling2_loop_text":
        text = cfg
    else:
        raise ConfigError(f"config.json: model_type is {cfg.get('model_type')!r}, not inkling2_loop")
    if text.get("model_type", "inkling2_loop_text") != "inkling2_loop_text":
        raise ConfigError(f"config.json: text_config.model_type is {text.get('model_type')!r}, "
                          "not inkling2_loop_text")
    loop = text.get("loop_config")
    if loop is None:
        return text
    if not isinstance(loop, dict):
        raise ConfigError("config.json: text_config.loop_config must be an object")
    return text | {dst: loop[src] for src, dst in _LOOP_CONFIG.items() if src in loop}


def _layer_types(text: dict[str, Any], n_layers: int) -> tuple[bool, ...]:
    """Per layer: sliding (``hybrid_sliding``) or full (``hybrid``); absent: every sixth is full."""
    types = text.get("layer_types")
    if types is None:
        return tuple((i + 1) % 6 != 0 for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers or any(t not in (_SLIDING, _FULL) for t in types):
        raise ConfigError(f"config.json: text_config.layer_types must list {n_layers} of "
                          f"{_SLIDING!r} / {_FULL!r}, got {types!r}")
    return tuple(t == _SLIDING for t in types)


@dataclass(frozen=True, slots=True)
class Inkling2Config:
    """The text model's shape, from ``config.json`` (``from_hf``); every field is bounded."""

    vocab_size: int
    unpadded_vocab_size: int
    hidden: int
    sliding: tuple[bool, ...]  # per layer
    heads: int
    kv_heads: int
    head_dim: int
    swa_heads: int
    swa_kv_heads: int
    swa_head_dim: int
    window: int
    d_rel: int
    rel_extent: int
    log_floor: int
    log_alpha: float
    qk_clip: float
    rel_clip: float
    conv_kernel: int
    experts: int
    top_k: int
    moe_intermediate: int
    route_scale: float
    gate_softcap: float
    up_softcap: float
    logit_softcap: float
    norm_eps: float
    block_layers: int
    loop_start: int
    loop_end: int
    passes: int  # the config's loop_num_passes: the default pass count
    gate_rank: int
    max_position: int = 1 << 17  # max_position_embeddings (absent: 131072)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Inkling2Config:
        """From a ``config.json`` dict (``inkling2_loop`` with a ``text_config``, or the text config
        alone); raises ``ConfigError`` naming the first field out of bounds or inconsistent."""
        text = _text_section(cfg)
        if text.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"config.json: text_config.scoring_func is {text.get('scoring_func')!r}; "
                              "only 'sigmoid' is supported")
        n_layers = _int(text, "num_hidden_layers")
        config = cls(
            vocab_size=_int(text, "vocab_size"), unpadded_vocab_size=_int(text, "unpadded_vocab_size"),
            hidden=_int(text, "hidden_size"), sliding=_layer_types(text, n_layers),
            heads=_int(text, "num_attention_heads"), kv_heads=_int(text, "num_key_value_heads"),
            head_dim=_int(text, "head_dim"), swa_heads=_int(text, "swa_num_attention_heads"),
            swa_kv_heads=_int(text, "swa_num_key_value_heads"), swa_head_dim=_int(text, "swa_head_dim"),
            window=_int(text, "sliding_window_size"), d_rel=_int(text, "d_rel"),
            rel_extent=_int(text, "rel_extent"), log_floor=_int(text, "log_scaling_n_floor"),
            log_alpha=_float(text, "log_scaling_alpha"), qk_clip=_float(text, "qk_l2_clip_threshold"),
            rel_clip=_float(text, "rel_l2_clip_threshold"), conv_kernel=_int(text, "conv_kernel_size"),
            experts=_int(text, "n_routed_experts"), top_k=_int(text, "num_experts_per_tok"),
            moe_intermediate=_int(text, "moe_intermediate_size"), route_scale=_float(text, "route_scale"),
            gate_softcap=_float(text, "mlp_gate_softcap"), up_softcap=_float(text, "mlp_up_softcap"),
            logit_softcap=_float(text, "final_logit_softcapping"), norm_eps=_float(text, "rms_norm_eps"),
            block_layers=_int(text, "n_layers_per_attn_res_block"),
            loop_start=_int(text, "loop_layer_index_start"), loop_end=_int(text, "loop_layer_index_end"),
            passes=_int(text, "loop_num_passes"), gate_rank=_int(text, "loop_gate_rank"),
            max_position=_int(text, "max_position_embeddings") if "max_position_embeddings" in text else 1 << 17,
        )
        config._check()
        return config

    def to_hf(self) -> dict[str, Any]:
        """The text config as ``config.json`` spells it (``from_hf`` reads it back to this config)."""
        return {
            "model_type": "inkling2_loop_text", "vocab_size": self.vocab_size,
            "unpadded_vocab_size": self.unpadded_vocab_size, "hidden_size": self.hidden,
            "num_hidden_layers": self.n_layers, "layer_types": [_SLIDING if s else _FULL for s in self.sliding],
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "swa_num_attention_heads": self.swa_heads, "swa_num_key_value_heads": self.swa_kv_heads,
            "swa_head_dim": self.swa_head_dim, "sliding_window_size": self.window, "d_rel": self.d_rel,
            "rel_extent": self.rel_extent, "log_scaling_n_floor": self.log_floor,
            "log_scaling_alpha": self.log_alpha, "qk_l2_clip_threshold": self.qk_clip,
            "rel_l2_clip_threshold": self.rel_clip, "conv_kernel_size": self.conv_kernel,
            "n_routed_experts": self.experts, "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.moe_intermediate, "route_scale": self.route_scale,
            "mlp_gate_softcap": self.gate_softcap, "mlp_up_softcap": self.up_softcap,
            "final_logit_softcapping": self.logit_softcap, "rms_norm_eps": self.norm_eps,
            "n_layers_per_attn_res_block": self.block_layers, "loop_layer_index_start": self.loop_start,
            "loop_layer_index_end": self.loop_end, "loop_num_passes": self.passes, "loop_gate_rank": self.gate_rank,
            "max_position_embeddings": self.max_position, "scoring_func": "sigmoid",
        }

    def model_config(self) -> ModelConfig:
        """The ``ModelConfig`` the engine sizes and checks requests by: the core's layers are the
        loop (``loops`` = passes, one KV slot per pass), a KV row is wide enough for any layer's
        K or V (``kv_heads`` x ``head_dim``: the widest of the full and sliding layers')."""
        return ModelConfig(
            architecture="inkling2", vocab_size=self.vocab_size, hidden=self.hidden,
            heads=max(self.heads, self.swa_heads), kv_heads=max(self.kv_heads, self.swa_kv_heads),
            head_dim=max(self.head_dim, self.swa_head_dim) + max(self.head_dim, self.swa_head_dim) % 2,
            intermediate=self.moe_intermediate, n_prelude=self.loop_start, n_core=self.n_loop,
            n_coda=self.n_layers - self.loop_end, default_loops=self.passes, max_loops=MAX_PASSES,
            max_position=self.max_position, block_style="pre_ln", injection="none", state_init="embed",
            loop_norm="none", norm_eps=self.norm_eps, tie_embeddings=False,
        )

    def _check(self) -> None:
        """The relations between fields, then the total size."""
        rules = (
            ("unpadded_vocab_size", self.unpadded_vocab_size <= self.vocab_size, "must be <= vocab_size"),
            ("num_key_value_heads", self.heads % self.kv_heads == 0, "must divide num_attention_heads"),
            ("swa_num_key_value_heads", self.swa_heads % self.swa_kv_heads == 0,
             "must divide swa_num_attention_heads"),
            ("num_experts_per_tok", self.top_k <= self.experts, "must be <= n_routed_experts"),
            ("loop_layer_index_start", self.loop_start % self.block_layers == 0,
             "must be a multiple of n_layers_per_attn_res_block"),
            ("loop_layer_index_end", self.loop_end % self.block_layers == 0,
             "must be a multiple of n_layers_per_attn_res_block"),
            ("loop_layer_index_end", self.loop_start < self.loop_end <= self.n_layers,
             "must be > loop_layer_index_start and <= num_hidden_layers"),
        )
        for key, ok, why in rules:
            if not ok:
                raise ConfigError(f"config.json: text_config.{key} {why}")
        if self.parameter_count() > MAX_PARAMETERS:
            raise ConfigError(f"config.json: text_config describes {self.parameter_count():.3g} parameters "
                              f"(hidden_size {self.hidden}, vocab_size {self.vocab_size}, n_routed_experts "
                              f"{self.experts}, moe_intermediate_size {self.moe_intermediate}); "
                              f"at most {MAX_PARAMETERS:.3g}")

    @property
    def n_layers(self) -> int:
        """num_hidden_layers."""
        return len(self.sliding)

    @property
    def n_loop(self) -> int:
        """Layers in the looped core."""
        return self.loop_end - self.loop_start

    def is_loop(self, layer: int) -> bool:
        """Whether ``layer`` is in the looped core."""
        return self.loop_start <= layer < self.loop_end

    def is_boundary(self, layer: int) -> bool:
        """Whether ``layer`` starts an attention-residual block."""
        return layer % self.block_layers == 0

    def attn_shape(self, layer: int) -> tuple[int, int, int, int]:
        """heads, kv_heads, head_dim, relative-bias extent of ``layer``'s attention."""
        if self.sliding[layer]:
            return self.swa_heads, self.swa_kv_heads, self.swa_head_dim, self.window
        return self.heads, self.kv_heads, self.head_dim, self.rel_extent

    def parameter_count(self) -> int:
        """Parameters of the text model: exactly what ``Inkling2LM`` allocates."""
        h, k, e = self.hidden, self.conv_kernel, self.experts
        total = (self.vocab_size + self.unpadded_vocab_size + 3 + 4 * self.n_loop) * h
        for layer in range(self.n_layers):
            heads, kv_heads, dim, extent = self.attn_shape(layer)
            queries = 0 if layer == 0 else 1 if self.sliding[layer] else 3
            norms = 2 if self.sliding[layer] else 4
            total += (queries + 1 + norms + 2 * k) * h + e * (h + 1 + 3 * self.moe_intermediate * h)
            total += heads * dim * (3 * h + 1) + 2 * kv_heads * dim * (h + k) + heads * h
            total += heads * self.d_rel * (h + 1) + self.d_rel * extent
            total += 0 if self.sliding[layer] else 2 * h * kv_heads * k
            total += 16 * h * self.gate_rank if self.is_loop(layer) else 0
        return total


# ---- maths shared by the modules ------------------------------------------------------------------

def _f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32: itself when it is (a Python check, not a dispatched no-op ``.float()``)."""
    return x if x.dtype == torch.float32 else x.float()


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without dispatching when it is in ``dtype`` already."""
    return x if x.dtype == dtype else x.to(dtype)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm in float32: ``x * rsqrt(mean(x^2) + eps)``."""
    return F.rms_norm(_f32(x), (x.shape[-1],), eps=eps)


def _weighted_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm in float32, times ``weight``, in ``weight``'s dtype."""
    return _cast(weight * _rms(x, eps), weight.dtype)


def _clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Scale each vector (last dim) down to L2 norm ``threshold`` if it is longer."""
    norm: torch.Tensor = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * ((norm + _CLIP_EPS).reciprocal() * threshold).clamp_(max=1.0)  # threshold / (norm + eps)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def _log_scale(positions: torch.Tensor, config: Inkling2Config) -> torch.Tensor:
    """``1 + alpha * log(max((pos + 1) / n_floor, 1))`` per position ``[B, T]``: ``[B, T, 1, 1]``."""
    ratio = ((positions + 1).float() / config.log_floor).clamp(min=1.0)
    return (1.0 + config.log_alpha * torch.log(ratio))[..., None, None]


def _attend_states(queries: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Attention residual: ``queries`` ``[Q, H]`` attend per token over ``states`` ``[B, T, N, H]``
    (RMS-normalised keys and values); returns ``[B, T, Q, H]``."""
    states = _rms(states, _RES_EPS)
    logits = (states @ (_f32(queries).T * states.shape[-1] ** -0.5)).transpose(-1, -2)  # [B, T, Q, N]
    mixed: torch.Tensor = logits.softmax(-1) @ states
    return mixed


# ---- the cache ---------------------------------------------------------------------------------

@dataclass
class _LayerState:
    """One layer instance's state: its K/V ``[B, kv_heads, S, head_dim]`` and conv tails."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    tails: dict[str, torch.Tensor] = field(default_factory=dict)


class LayerMemory(Protocol):
    """What one layer instance (a layer at one pass) reads and keeps across calls, for the rows
    of one call: ``_CacheMemory`` over an ``Inkling2Cache``, ``_PagedMemory`` over the engine's
    paged KV pool (``tinyloop.model.context.PagedContext``)."""

    positions: torch.Tensor  # [B, T] the new tokens' positions
    native: bool  # whether a decode step may run in C (``_Layer._decode``; ``_PagedMemory`` only)

    def conv_context(self, slot: str, x: torch.Tensor, kernel: int) -> torch.Tensor:
        """``x`` ``[B, T, C]`` after the ``kernel - 1`` inputs before it of the convolution
        ``slot`` (``k``, ``v``, ``attn``, ``mlp``; zeros before the first token): ``[B, K-1+T, C]``;
        ``x`` is kept for the next call."""
        ...

    def attend_keys(self, k: torch.Tensor, v: torch.Tensor,
                    keep: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keep ``k``, ``v`` ``[B, T, KVH, D]``; return the keys and values to attend
        ``[B, KVH, L, D]``, their positions ``[B, L]`` and which each new token may see
        ``[B, T, L]`` (past keys beyond the last ``keep`` positions may be left out)."""
        ...

    def shared(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, or what it gave for ``key`` to another layer instance of these rows in this
        call (what depends only on the positions)."""
        ...

    def flush(self) -> None:
        """Store what the layer instance kept and has not stored yet (at its end)."""
        ...


@dataclass
class _CacheMemory:
    """A layer instance's memory in an ``Inkling2Cache`` (rows of equal length)."""

    state: _LayerState
    positions: torch.Tensor
    native: bool = False

    def conv_context(self, slot: str, x: torch.Tensor, kernel: int) -> torch.Tensor:
        batch, _, channels = x.shape
        tail = self.state.tails.get(slot, x.new_zeros(batch, kernel - 1, channels))
        context = torch.cat([tail, x], dim=1)
        self.state.tails[slot] = context[:, context.shape[1] - (kernel - 1):]
        return context

    def attend_keys(self, k: torch.Tensor, v: torch.Tensor,
                    keep: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.state
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        keys = k if state.keys is None else torch.cat([state.keys, k], dim=2)
        values = v if state.values is None else torch.cat([state.values, v], dim=2)
        start = 0 if keep is None else max(keys.shape[2] - keep, 0)
        state.keys, state.values = keys[:, :, start:], values[:, :, start:]
        end = int(self.positions[0, -1]) + 1
        key_positions = torch.arange(end - keys.shape[2], end, device=k.device).expand(k.shape[0], -1)
        visible = torch.ones(k.shape[0], k.shape[2], keys.shape[2], dtype=torch.bool, device=k.device)
        return keys, values, key_positions, visible

    def shared(self, key: Hashable, make: Callable[[], Any]) -> Any:
        return make()  # (the layers' caches may keep different key ranges)

    def flush(self) -> None:
        """Nothing waits: ``conv_context`` and ``attend_keys`` keep at once."""


# the pool's field for each convolution's inputs (``KVStore``'s Inkling-2 fields)
_CONV_FIELDS = {"k": "k_in", "v": "v_in", "attn": "attn_in", "mlp": "mlp_in"}


class PagedFields(Protocol):
    """What ``_PagedMemory`` needs of the engine's context (``PagedContext``)."""

    def write_fields(self, rows: torch.Tensor | None, slots: torch.Tensor | int, **values: torch.Tensor) -> None:
        ...

    def gather(self, rows: torch.Tensor | None, slots: torch.Tensor | int, names: Sequence[str],
               positions: torch.Tensor | None) -> list[torch.Tensor]:
        ...

    def visible(self, rows: torch.Tensor | None) -> torch.Tensor:
        ...

    def field_width(self, name: str) -> int:
        ...


@dataclass
class _PagedMemory:
    """A layer instance's memory in the paged KV pool: K, V and every convolution's inputs are
    stored per token (pool fields ``k``, ``v``, ``k_in``, ``v_in``, ``attn_in``, ``mlp_in``,
    each row as wide as the widest layer's), so prefix caching, forks and recomputation keep them
    as they keep K and V; a convolution reads back its last ``K - 1`` inputs."""

    ctx: PagedFields
    rows: torch.Tensor | None
    slots: torch.Tensor | int
    positions: torch.Tensor  # [R, T]
    dtype: torch.dtype  # the pool's
    cache: dict[Hashable, Any]  # what ``shared`` made, for every layer instance of one call
    native: bool = False
    _tails: dict[str, torch.Tensor] | None = None  # the four convolutions' inputs before this call
    _pending: dict[str, torch.Tensor] = field(default_factory=dict)  # fields kept, not yet written

    def shared(self, key: Hashable, make: Callable[[], Any]) -> Any:
        full = (key, None if self.rows is None else id(self.rows))
        if full not in self.cache:
            self.cache[full] = make()
        return self.cache[full]

    def _store(self, name: str, x: torch.Tensor) -> torch.Tensor:
        width = self.ctx.field_width(name)
        return _cast(F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x, self.dtype)

    def conv_tail(self, slot: str, kernel: int) -> torch.Tensor:
        """The ``kernel - 1`` inputs of convolution ``slot`` before this call's tokens ``[R, K-1,
        W]`` (W the pool field's width, at least the convolution's), in the pool's dtype."""
        if self._tails is None:  # the layer's four at once (one kernel size): one pool-row lookup
            before = self.positions[:, :1] + torch.arange(1 - kernel, 0, device=self.positions.device)  # [R, K-1]
            names = list(_CONV_FIELDS.values())
            self._tails = dict(zip(names, self.ctx.gather(self.rows, self.slots, names, before), strict=True))
        return self._tails[_CONV_FIELDS[slot]]

    def keep(self, slot: str, x: torch.Tensor) -> None:
        """Keep ``x`` ``[R, T, C]``, convolution ``slot``'s inputs (stored with the K/V write, or by
        ``flush``)."""
        self._pending[_CONV_FIELDS[slot]] = self._store(_CONV_FIELDS[slot], x)

    def conv_context(self, slot: str, x: torch.Tensor, kernel: int) -> torch.Tensor:
        channels = x.shape[-1]
        tail = self.conv_tail(slot, kernel)
        tail = _cast(tail if tail.shape[-1] == channels else tail[..., :channels], x.dtype)
        self.keep(slot, x)
        return torch.cat([tail, x], dim=1)

    def flush(self) -> None:
        if self._pending:
            self.ctx.write_fields(self.rows, self.slots, **self._pending)
            self._pending = {}

    def attend_rows(self, k: torch.Tensor, v: torch.Tensor, keep: int | None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``attend_keys`` with the keys and values as the pool holds them: ``[R, L, W]`` each, in
        the pool's dtype (W at least ``KVH * D``)."""
        batch, length = k.shape[:2]
        self._pending.update(k=self._store("k", k.reshape(batch, length, -1)),
                             v=self._store("v", v.reshape(batch, length, -1)))
        self.flush()
        key_positions, visible, read = self.shared(("keys", keep), partial(self._key_range, keep, batch))
        keys, values = self.ctx.gather(self.rows, self.slots, ("k", "v"), read)
        return keys, values, key_positions, visible

    def attend_keys(self, k: torch.Tensor, v: torch.Tensor,
                    keep: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, kv_heads, dim = k.shape
        keys, values, key_positions, visible = self.attend_rows(k, v, keep)
        keys, values = (_cast(t if t.shape[-1] == kv_heads * dim else t[..., :kv_heads * dim], k.dtype)
                        .view(batch, -1, kv_heads, dim).transpose(1, 2) for t in (keys, values))
        return keys, values, key_positions, visible

    def _key_range(self, keep: int | None, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The positions of the keys to attend ``[R, L']`` (all, or the last ``keep`` before this
        call and its own), which each new token may see ``[R, T, L']``, and the positions to read
        (None: all)."""
        visible = self.ctx.visible(self.rows)  # [R, T, L]: causal, this call's rows' own lengths
        first = 0 if keep is None else max(int(self.positions[:, 0].min()) - keep, 0)
        key_positions = torch.arange(first, visible.shape[-1], device=visible.device).expand(batch, -1)
        return key_positions, visible[..., first:], None if first == 0 else key_positions


@dataclass
class Inkling2Cache:
    """What a cached ``Inkling2LM.step`` keeps for a batch of sequences of equal length: per layer
    instance (``(layer, pass)``; prelude and coda layers only at pass 0) its K/V and the last
    ``K - 1`` inputs of its four short convolutions. ``passes`` is fixed by the first step."""

    batch: int
    length: int = 0
    passes: int | None = None
    layers: dict[tuple[int, int], _LayerState] = field(default_factory=dict)

    def state(self, layer: int, pass_index: int) -> _LayerState:
        """The state of ``layer`` at pass ``pass_index`` (created empty on first use)."""
        return self.layers.setdefault((layer, pass_index), _LayerState())


# ---- modules -------------------------------------------------------------------------------------

class _Queries(nn.Module):
    """Learned attention-residual queries ``[n, hidden]``."""

    def __init__(self, n: int, hidden: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(n, hidden))

    def forward(self, blocks: list[torch.Tensor], partial: torch.Tensor) -> torch.Tensor:
        """``[B, T, n, H]``: the queries over ``blocks`` then ``partial``, each ``[B, T, H]``."""
        return _attend_states(self.query, torch.stack([*blocks, partial], dim=-2))


class _Controller(nn.Module):
    """Mixes a message into a hidden state: ``(1 - tanh(forget)) * h + tanh(gain) * message``."""

    def __init__(self, hidden: int, rank: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.down = nn.Linear(2 * hidden, rank, bias=False)
        self.forget = nn.Linear(rank, hidden, bias=False)
        self.message = nn.Linear(rank, hidden, bias=False)
        for layer in (self.down, self.forget, self.message):  # rank-wide: quantising saves next to nothing,
            layer.keep_float = True  # type: ignore[assignment]  # and float keeps ``normed`` in one C call
        # ``normed``'s copies of forget's and message's weights, transposed, and what they were made of
        self._transposed: tuple[tuple[tuple[int, int], ...], torch.Tensor, torch.Tensor] | None = None

    def forward(self, h: torch.Tensor, message: torch.Tensor) -> torch.Tensor:
        h, message = _f32(h), _f32(message)
        low = self.down(torch.cat([_rms(h, self.eps), _rms(message, self.eps)], dim=-1))
        return (1 - torch.tanh(self.forget(low))) * h + torch.tanh(self.message(low)) * message

    def normed(self, h: torch.Tensor, message: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``_weighted_rms(self(h, message), weight, eps)`` in one C call where the three
        projections are float32 linears (not quantised), else through torch."""
        layers = (self.down, self.forget, self.message)
        if all(type(layer) is nn.Linear and layer.weight.dtype == torch.float32 for layer in layers):
            key = tuple((layer.weight.data_ptr(), layer.weight._version) for layer in layers)
            if self._transposed is None or self._transposed[0] != key:  # (the weights changed: again)
                self._transposed = key, self.forget.weight.detach().t().contiguous(), \
                    self.message.weight.detach().t().contiguous()
            return native_ops.controller(h, message, self.down.weight, self._transposed[1], self._transposed[2],
                                         self.eps, weight, eps)
        return _weighted_rms(self(h, message), weight, eps)


class _ShortConv(nn.Module):
    """Causal depthwise convolution plus its input, scaled: ``weight`` ``[K, C]`` holds the tap of
    each backward distance (row 0: the current token). With ``dynamic_heads``, each token adds taps
    projected from a second input, one set per group of ``C / dynamic_heads`` channels."""

    def __init__(self, channels: int, kernel: int, hidden: int, dynamic_heads: int = 0) -> None:
        super().__init__()
        self.kernel = kernel
        self.heads = dynamic_heads
        self.weight = nn.Parameter(torch.zeros(kernel, channels))
        self.dynamic = nn.Linear(hidden, dynamic_heads * kernel, bias=False) if dynamic_heads else None
        self.denominator = math.sqrt(2 * kernel + 1 if dynamic_heads else kernel + 1)

    def forward(self, x: torch.Tensor, memory: LayerMemory, slot: str,
                source: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[B, T, C]`` continued from the inputs ``memory`` keeps for ``slot`` (and kept
        there); ``source`` ``[B, T, hidden]`` feeds the dynamic taps."""
        x = _f32(x)
        batch, length, channels = x.shape
        context = memory.conv_context(slot, x, self.kernel)
        taps = _f32(self.weight)
        if self.dynamic is None:  # sum over backward distances j of tap j times the input j tokens back
            last, rows = self.kernel - 1, taps.unbind(0)
            out = x * rows[0]
            for j in range(1, self.kernel):
                out.addcmul_(context[:, last - j:last - j + length], rows[j])
        else:
            assert source is not None, "dynamic taps need their source"
            per_token = _f32(self.dynamic(source)).view(batch, length, self.heads, 1, self.kernel)
            weights = taps.T.reshape(self.heads, -1, self.kernel) + per_token
            windows = context.unfold(1, self.kernel, 1).flip(-1).reshape(weights.shape)
            out = (windows * weights).sum(-1).reshape(batch, length, channels)
        return out.add_(x).div_(self.denominator)


class _Attention(nn.Module):
    """Sink-gated attention with L2-clipped q/k, short-convolved k/v, a relative position bias
    and a sigmoid-gated output; sliding or full by ``layer``."""

    def __init__(self, config: Inkling2Config, layer: int) -> None:
        super().__init__()
        heads, kv_heads, dim, extent = config.attn_shape(layer)
        hidden, kernel = config.hidden, config.conv_kernel
        self.config = config
        self.sliding = config.sliding[layer]
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        dynamic = 0 if self.sliding else kv_heads
        self.wq = nn.Linear(hidden, heads * dim, bias=False)
        self.q_scale = nn.Parameter(torch.ones(heads, dim))
        self.wk = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.k_conv = _ShortConv(kv_heads * dim, kernel, hidden, dynamic)
        self.v_conv = _ShortConv(kv_heads * dim, kernel, hidden, dynamic)
        self.wr = nn.Linear(hidden, heads * config.d_rel, bias=False)
        self.rel_scale = nn.Parameter(torch.ones(heads, config.d_rel))
        self.rel_proj = nn.Parameter(torch.zeros(config.d_rel, extent))
        self.wg = nn.Linear(hidden, heads * dim, bias=False)
        self.wo = nn.Linear(heads * dim, hidden, bias=False)
        self.sink = nn.Linear(hidden, heads, bias=False)

    def forward(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, memory: LayerMemory) -> torch.Tensor:
        """Queries from ``xq``, keys from ``xk``, values from ``xv`` (each ``[B, T, hidden]``) at
        ``memory.positions``, after the K/V ``memory`` keeps, which it extends."""
        batch, length, _ = xq.shape
        positions = memory.positions  # [B, T]
        q = _clip(_f32(self.wq(xq).view(batch, length, self.heads, self.dim)) * _f32(self.q_scale),
                  self.config.qk_clip)
        if not self.sliding:
            q = q * _log_scale(positions, self.config)
        k = self.k_conv(self.wk(xk), memory, "k", xk).view(batch, length, self.kv_heads, self.dim)
        v = self.v_conv(self.wv(xv), memory, "v", xv).view(batch, length, self.kv_heads, self.dim)
        keys, values, key_positions, visible = memory.attend_keys(
            _clip(k, self.config.qk_clip), _rms(v, self.config.norm_eps),
            self.config.window - 1 if self.sliding else None)
        groups, n_keys = self.heads // self.kv_heads, keys.shape[2]
        # query heads grouped by the KV head they read: [B, KVH, G * T, D] against [B, KVH, L, D]
        grouped = q.transpose(1, 2).reshape(batch, self.kv_heads, groups * length, self.dim)
        scores = (grouped @ keys.transpose(2, 3)).view(batch, self.heads, length, n_keys) * self.dim ** -0.5
        hidden, index, outside = memory.shared(("geometry", self.sliding, self.rel_proj.shape[-1]), partial(
            self._geometry, positions, key_positions, visible))
        bias = self._relative_bias(self.wr(xq), index, outside, positions)
        scores = (scores + bias).masked_fill(hidden, float("-inf"))
        weights = torch.cat([scores, _f32(self.sink(xq)).transpose(1, 2).unsqueeze(-1)], dim=-1).softmax(-1)[..., :-1]
        out = (weights.reshape(batch, self.kv_heads, groups * length, n_keys) @ values).view(
            batch, self.heads, length, self.dim).transpose(1, 2).reshape(batch, length, -1)
        projected: torch.Tensor = self.wo(out * torch.sigmoid(_f32(self.wg(xq))))
        return projected

    def decode(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, memory: _PagedMemory) -> torch.Tensor:
        """``forward`` for one new token a row (``[B, 1, hidden]`` each) with the per-token maths in
        C (``native_ops``): the projections through torch, the convolutions (with k's clip and v's
        norm) and the attention after them one call each."""
        cfg, batch = self.config, xq.shape[0]
        k_in, v_in = _f32(self.wk(xk)), _f32(self.wv(xv))
        convs = []  # k clipped, v RMS-normed per head, as ``forward`` does after its convolutions
        for conv, x, src, slot, post, value in ((self.k_conv, k_in, xk, "k", "clip", cfg.qk_clip),
                                                (self.v_conv, v_in, xv, "v", "rms", cfg.norm_eps)):
            dynamic = None if conv.dynamic is None else _f32(conv.dynamic(src))
            convs.append(native_ops.short_conv(x, memory.conv_tail(slot, conv.kernel), _f32(conv.weight),
                                               conv.denominator, dynamic, conv.heads, post, self.dim, value))
            memory.keep(slot, x)
        keys, values, key_positions, visible = memory.attend_rows(
            convs[0], convs[1], cfg.window - 1 if self.sliding else None)
        out = native_ops.decode_attention(
            _f32(self.wq(xq)), _f32(self.q_scale), _f32(self.wr(xq)), _f32(self.rel_scale), _f32(self.rel_proj),
            _f32(self.sink(xq)), _f32(self.wg(xq)), keys, values, key_positions, visible[:, 0],
            memory.positions[:, 0], self.kv_heads, cfg.window if self.sliding else 0,
            None if self.sliding else (cfg.log_alpha, float(cfg.log_floor)), cfg.qk_clip, cfg.rel_clip)
        projected: torch.Tensor = self.wo(out.view(batch, 1, -1))
        return projected

    def _geometry(self, positions: torch.Tensor, key_positions: torch.Tensor,
                  visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What depends only on where the queries and keys sit (the same for every layer of this
        kind in a call): which keys each query may not see ``[B, 1, T, L]``, the relative-bias column of
        each key ``[B, 1, T, L]`` and where the bias is zero (past its extent) ``[B, 1, T, L]``."""
        distance = positions[:, :, None] - key_positions[:, None, :]  # [B, T, L]
        allowed = visible & (distance >= 0)
        if self.sliding:
            allowed = allowed & (distance < self.config.window)
        extent = self.rel_proj.shape[-1]
        index = distance.clamp(0, extent - 1)[:, None]
        return ~allowed[:, None], index, ((distance < 0) | (distance >= extent))[:, None]

    def _relative_bias(self, rel: torch.Tensor, index: torch.Tensor, outside: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """``[B, heads, T, S]``: each query's per-head profile over backward distances (the
        column ``index`` of each key), zero where ``outside`` the extent; ``rel`` is ``wr``'s
        output ``[B, T, heads * d_rel]``."""
        batch, length, _ = rel.shape
        rel = _clip(_f32(rel.view(batch, length, self.heads, -1)) * _f32(self.rel_scale),
                    self.config.rel_clip)
        if not self.sliding:
            rel = rel * _log_scale(positions, self.config)
        profiles = (rel @ _f32(self.rel_proj)).transpose(1, 2)
        bias = profiles.gather(-1, index.expand(-1, self.heads, -1, -1))
        return bias.masked_fill(outside, 0.0)


class _Expert(nn.Module):
    """One routed expert: ``gate_up`` ``[2I, H]`` (the gate's rows, then the up's) and ``down``
    ``[H, I]``, linear layers so that the engine packs and quantises them as dense ones."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)


class _MoE(nn.Module):
    """Sigmoid-routed experts (top-k on score + bias, weights renormalised and scaled; routing in
    float32 from an unquantised weight) with a softcapped SwiGLU; tokens are grouped by expert,
    one product per expert and projection."""

    def __init__(self, config: Inkling2Config) -> None:
        super().__init__()
        e, h, i = config.experts, config.hidden, config.moe_intermediate
        self.config = config
        self.inter = i
        self.router_weight = nn.Parameter(torch.zeros(e, h))
        self.router_bias = nn.Parameter(torch.zeros(e))
        self.experts = nn.ModuleList(_Expert(h, i) for _ in range(e))
        self._caps: torch.Tensor | None = None  # ``_inverse_caps``

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token ``[N, H]``: the chosen experts and their weights, ``[N, top_k]`` each."""
        scores = torch.sigmoid(F.linear(_f32(x), _f32(self.router_weight)))
        chosen = torch.topk(scores + _f32(self.router_bias), self.config.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.config.route_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, weights = self.route(flat)
        experts = chosen.reshape(-1)
        order = torch.argsort(experts, stable=True)
        tokens, token_weights = order // self.config.top_k, weights.reshape(-1)[order]
        picked = flat[tokens]  # [N * k, H]: each token once per expert it goes to, grouped by expert
        counts = torch.bincount(experts, minlength=self.config.experts).tolist()
        ends = list(accumulate(counts))
        spans = [(e, end - count, end) for e, (count, end) in enumerate(zip(counts, ends, strict=True)) if count]
        gate_up = _f32(self._grouped(picked, spans, "gate_up", 2 * self.inter))
        down = self._grouped(_cast(self._activation(gate_up), x.dtype), spans, "down", shape[-1])
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        out.index_add_(0, tokens, _f32(down) * token_weights[:, None])
        return out.reshape(shape)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` of float32 ``x`` with the routing, the activation and the recombination in C
        (``native_ops``); the experts' products through torch as there."""
        shape = x.shape
        cfg = self.config
        picked, tokens, weights, counts = native_ops.route(x.reshape(-1, shape[-1]), _f32(self.router_weight),
                                                       _f32(self.router_bias), cfg.top_k, cfg.route_scale)
        per_expert = counts.tolist()
        spans = [(e, end - count, end) for e, (count, end) in enumerate(zip(per_expert, accumulate(per_expert)))
                 if count]
        gate_up = _f32(self._grouped(picked, spans, "gate_up", 2 * self.inter))
        down = self._grouped(native_ops.activation(gate_up, cfg.gate_softcap, cfg.up_softcap), spans, "down", shape[-1])
        return native_ops.combine(_f32(down), tokens, weights, picked.shape[0] // cfg.top_k).view(shape)

    def _grouped(self, x: torch.Tensor, spans: list[tuple[int, int, int]], name: str, width: int) -> torch.Tensor:
        """``[N, width]``: the rows ``start:end`` of ``x`` through expert ``e``'s ``name`` projection
        for each ``(e, start, end)``; a plain linear writes its rows in place (no per-expert copy)
        unless autograd is on (``out=`` products are not differentiable)."""
        out, direct = x.new_empty(x.shape[0], width), not torch.is_grad_enabled()
        experts = list(self.experts)
        for expert, start, end in spans:
            layer = cast(nn.Module, experts[expert]._modules[name])
            if direct and type(layer) is nn.Linear:
                torch.mm(x[start:end], layer.weight.t(), out=out[start:end])
            else:
                out[start:end] = layer(x[start:end])
        return out

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``softcap(g, a) * sigmoid(g) * softcap(u, b)`` of every row ``[g; u]`` (softcap(x, c) =
        c tanh(x / c)), as ``a b tanh(g / a) tanh(u / b) sigmoid(g)``: elementwise, so all experts'
        rows at once."""
        caps = gate_up.mul(self._inverse_caps(gate_up)).tanh_()
        return (caps[:, :self.inter] * caps[:, self.inter:]).mul_(torch.sigmoid(gate_up[:, :self.inter])).mul_(
            self.config.gate_softcap * self.config.up_softcap)

    def _inverse_caps(self, like: torch.Tensor) -> torch.Tensor:
        """``[2I]``: 1 / the gate's softcap, then 1 / the up's."""
        if self._caps is None or self._caps.device != like.device:
            self._caps = torch.cat([torch.full((self.inter,), 1 / self.config.gate_softcap),
                                    torch.full((self.inter,), 1 / self.config.up_softcap)]).to(like.device)
        return self._caps


class _Layer(nn.Module):
    """One decoder layer: attention residual in, attention, post-attention conv, residual or block
    boundary, attention residual in, MoE, post-MLP conv; core layers also take messages."""

    def __init__(self, config: Inkling2Config, layer: int) -> None:
        super().__init__()
        h = config.hidden
        self.config = config
        self.sliding = config.sliding[layer]
        self.boundary = config.is_boundary(layer)
        self.attn_input = _Queries(1 if self.sliding else 3, h) if layer > 0 else None
        self.mlp_input = _Queries(1, h)
        if self.sliding:
            self.attn_norm = nn.Parameter(torch.ones(h))
        else:
            self.norm_q, self.norm_k, self.norm_v = (nn.Parameter(torch.ones(h)) for _ in range(3))
        self.attn = _Attention(config, layer)
        self.attn_conv = _ShortConv(h, config.conv_kernel, h)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.moe = _MoE(config)
        self.mlp_conv = _ShortConv(h, config.conv_kernel, h)
        self.gates = nn.ModuleDict({
            name: _Controller(h, config.gate_rank, config.norm_eps) for name in ("q", "k", "v", "mlp")
        }) if config.is_loop(layer) else None

    def forward(self, h: torch.Tensor, blocks: list[torch.Tensor], messages: torch.Tensor | None,
                memory: LayerMemory) -> torch.Tensor:
        """The next hidden state; ``blocks`` the block states before this layer, ``messages``
        ``[B, T, 4, H]`` (q, k, v, MLP) from the previous pass or None, ``memory`` this layer
        instance's K/V and convolution inputs."""
        if _in_c(memory, h):
            return self._decode(h, blocks, messages, cast(_PagedMemory, memory))
        xq, xk, xv = self._attention_inputs(h, blocks, messages)
        out: torch.Tensor = self.attn_conv(self.attn(xq, xk, xv, memory), memory, "attn")
        if self.boundary:
            blocks, residual = [*blocks, h], out
        else:
            residual = _f32(h) + out
        x = self.mlp_input(blocks, residual)[..., 0, :]
        if messages is not None:
            x = self._gate("mlp", x, messages[..., 3, :])
        y: torch.Tensor = self.mlp_conv(self.moe(_weighted_rms(x, self.mlp_norm, self.config.norm_eps)), memory,
                                        "mlp")
        memory.flush()
        return _cast(residual + y, h.dtype)

    def _decode(self, h: torch.Tensor, blocks: list[torch.Tensor], messages: torch.Tensor | None,
                memory: _PagedMemory) -> torch.Tensor:
        """``forward`` of one new token a row (float32) with its per-token maths in C (``native_ops``,
        ``tinyloop.cpu.inkling2``): the same steps, each norm folded into the step before it."""
        eps = self.config.norm_eps
        xq, xk, xv = self._attention_inputs_native(h, blocks, messages)
        attn = self.attn.decode(xq, xk, xv, memory)
        conv = self.attn_conv
        out = native_ops.short_conv(attn, memory.conv_tail("attn", conv.kernel), _f32(conv.weight), conv.denominator,
                                residual=None if self.boundary else h)
        memory.keep("attn", attn)
        residual = out
        if self.boundary:
            blocks = [*blocks, h]
        states = torch.stack([*blocks, residual], dim=-2)
        if messages is None:
            x = native_ops.attend_states(states, self.mlp_input.query, _RES_EPS, self.mlp_norm, eps)[..., 0, :]
        else:
            mixed = native_ops.attend_states(states, self.mlp_input.query, _RES_EPS)[..., 0, :]
            x = self._controller("mlp").normed(mixed, messages[..., 3, :], self.mlp_norm, eps)
        y = self.moe.decode(x)
        conv = self.mlp_conv
        out = native_ops.short_conv(y, memory.conv_tail("mlp", conv.kernel), _f32(conv.weight), conv.denominator,
                                residual=residual)
        memory.keep("mlp", y)
        memory.flush()
        return out

    def _attention_inputs_native(self, h: torch.Tensor, blocks: list[torch.Tensor], messages: torch.Tensor | None,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_attention_inputs`` through ``native``'s attention residual and controllers."""
        eps = self.config.norm_eps
        norms: list[torch.Tensor] = [self.attn_norm] * 3 if self.sliding else [self.norm_q, self.norm_k, self.norm_v]
        if self.attn_input is None:  # layer 0 reads its input as is (and has no messages)
            x = _weighted_rms(h, norms[0], eps)
            return (x, x, x) if self.sliding else (x, _weighted_rms(h, norms[1], eps), _weighted_rms(h, norms[2], eps))
        states = torch.stack([*blocks, h], dim=-2)
        query = self.attn_input.query
        if messages is None:
            if self.sliding:
                x = native_ops.attend_states(states, query, _RES_EPS, norms[0], eps)[..., 0, :]
                return x, x, x
            xq, xk, xv = native_ops.attend_states(states, query, _RES_EPS, torch.stack(norms), eps).unbind(-2)
            return xq, xk, xv
        mixed = native_ops.attend_states(states, query, _RES_EPS).unbind(-2) * (3 if self.sliding else 1)
        xq, xk, xv = (self._controller(name).normed(x, messages[..., i, :], norm, eps)
                      for i, (name, x, norm) in enumerate(zip("qkv", mixed, norms)))
        return xq, xk, xv

    def _controller(self, name: str) -> _Controller:
        assert self.gates is not None
        return cast(_Controller, self.gates[name])

    def _attention_inputs(self, h: torch.Tensor, blocks: list[torch.Tensor],
                          messages: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed inputs of q, k and v: the attention residual, mixed with the messages."""
        if self.attn_input is None:
            mixed = [h, h, h]
        else:
            mixed = list(self.attn_input(blocks, h).unbind(-2)) * (3 if self.sliding else 1)
        eps = self.config.norm_eps
        if messages is None and self.sliding:  # one input, one norm: the same three
            x = _weighted_rms(mixed[0], self.attn_norm, eps)
            return x, x, x
        if messages is not None:
            mixed = [self._gate(name, x, messages[..., i, :]) for i, (name, x) in enumerate(zip("qkv", mixed))]
        q, k, v = (self.attn_norm,) * 3 if self.sliding else (self.norm_q, self.norm_k, self.norm_v)
        return _weighted_rms(mixed[0], q, eps), _weighted_rms(mixed[1], k, eps), _weighted_rms(mixed[2], v, eps)

    def _gate(self, name: str, x: torch.Tensor, message: torch.Tensor) -> torch.Tensor:
        assert self.gates is not None
        gated: torch.Tensor = cast(_Controller, self.gates[name])(x, message)
        return gated


# (layer, pass, rows) -> that layer instance's memory for those rows (None: all)
MemoryOf = Callable[[int, int, torch.Tensor | None], LayerMemory]


def _in_c(memory: LayerMemory, h: torch.Tensor) -> bool:
    """Whether a layer instance runs its per-token maths in C: a decode step ``serve`` cleared for
    it (``memory.native``: one new token a row) on a float32 hidden state."""
    return memory.native and h.dtype == torch.float32


def _rows_of(rows: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    return t if rows is None else t[rows]


class _NoRope:
    """The engine's contexts ask the model for RoPE tables; Inkling-2 has none: empty ones."""

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.zeros(*positions.shape, 0, device=positions.device)
        return empty, empty

    def build(self) -> None:
        """Nothing to build."""

    def to(self, device: torch.device | str) -> None:
        """Nothing to move."""


class Inkling2LM(nn.Module):
    """The Inkling-2 loop text model. ``model(input_ids, passes)`` -> logits ``[B, T,
    unpadded_vocab_size]`` (float32), and ``step`` the same incrementally over an
    ``Inkling2Cache``: the reference path. ``model(tokens, ctx, specs, last_only)`` is the
    engine's forward (``LoopedLM``'s contract) over its paged KV pool: each row runs its own
    ``loops`` passes. ``arch`` is the model's own config, ``config`` the ``ModelConfig`` the engine
    sizes the pool and checks requests by (``Inkling2Config.model_config``)."""

    def __init__(self, config: Inkling2Config) -> None:
        super().__init__()
        h = config.hidden
        self.arch = config
        self.config = config.model_config()
        self.rope = _NoRope()
        self.backend: Any = None  # the engine's kernel backend: ``cpu.backend.CPU`` lets decode run in C (NATIVE)
        self.embed = nn.Embedding(config.vocab_size, h)
        self.embed_norm = nn.Parameter(torch.ones(h))
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.n_layers))
        self.q_mlp_messages = nn.Parameter(torch.zeros(config.n_loop, 2, h))  # per core layer: q, MLP
        self.kv_messages = nn.Parameter(torch.zeros(config.n_loop, 2, h))  # per core layer: k, v
        self.final_query = nn.Parameter(torch.zeros(1, h))
        self.norm = nn.Parameter(torch.ones(h))
        self.head = nn.Linear(h, config.unpadded_vocab_size, bias=False)
        # within what the C decode steps' scratch holds (else decode runs on torch ops)
        self.native_fits = native_ops.fits(
            config.n_layers // config.block_layers + 1, config.experts, config.top_k, config.gate_rank,
            (config.head_dim, config.swa_head_dim, config.d_rel))

    def use_backend(self, backend: Any) -> None:
        """The engine's kernel backend: with ``cpu.backend.CPU`` (``Engine(cpu_kernels=True)``) the
        engine's decode steps run their per-token maths in C (``_Layer._decode``), else torch ops."""
        self.backend = backend

    def new_cache(self, batch: int) -> Inkling2Cache:
        """An empty cache for ``batch`` sequences."""
        return Inkling2Cache(batch=batch)

    def forward(self, input_ids: torch.Tensor, passes: Any, specs: Sequence[Any] | None = None,
                last_only: bool = True) -> Any:
        """``(input_ids, passes)``: logits at every position ``[B, T, unpadded_vocab_size]`` with
        ``passes`` core passes; ``(tokens, ctx, specs, last_only)``: ``serve``."""
        if specs is None:
            return self.step(input_ids, self.new_cache(input_ids.shape[0]), passes)
        return self.serve(input_ids, passes, specs, last_only)

    def step(self, input_ids: torch.Tensor, cache: Inkling2Cache, passes: int) -> torch.Tensor:
        """Append ``input_ids`` ``[B, T]`` (a prefill chunk or one token) to ``cache``; returns their
        logits ``[B, T, unpadded_vocab_size]``."""
        self._check(input_ids, cache, passes)
        cache.passes = passes
        positions = torch.arange(cache.length, cache.length + input_ids.shape[1], device=input_ids.device)
        positions = positions.expand(input_ids.shape[0], -1)

        def memory(layer: int, pass_index: int, rows: torch.Tensor | None) -> LayerMemory:
            return _CacheMemory(cache.state(layer, pass_index), positions)

        h, blocks = self._layers(input_ids, [passes] * input_ids.shape[0], memory)
        cache.length += input_ids.shape[1]
        return self._logits(h, blocks)

    def serve(self, tokens: torch.Tensor, ctx: Any, specs: Sequence[Any], last_only: bool = True) -> Any:
        """The engine's forward: tokens ``[B, T]`` of rows at ``spec.start`` (``RowSpec``: its
        ``loops`` passes, one KV slot per pass of the ``kv_loops`` it is laid out for, ``window``
        all of them; a self-speculative draft runs fewer passes in its verifier's slots, whose
        verify forward writes every slot of those positions again), K, V and the convolutions'
        inputs in the context's pool (``PagedContext``): a ``ForwardOutput`` whose logits are
        ``[B, T', vocab_size]`` (rows past the head's ``unpadded_vocab_size`` -inf)."""
        cfg, c, n_tok = self.arch, self.config, tokens.shape[1]
        loops = [spec.loops for spec in specs]
        laid_out = [spec.kv_loops or spec.loops for spec in specs]
        if any(spec.window != kv or kv < spec.loops or spec.warm_state is not None
               or (spec.exit is not None and spec.exit.kind != "none")
               or (spec.positions is not None and list(spec.positions) != list(range(spec.start, spec.start + n_tok)))
               for spec, kv in zip(specs, laid_out)):
            raise RequestError("Inkling-2 runs every pass with its own KV (cache_window = loops), in order, without "
                               "exit rules, warm starts or tree drafts", param="loops")
        dev = tokens.device
        starts = torch.tensor([spec.start for spec in specs], dtype=torch.long, device=dev)
        positions = starts[:, None] + torch.arange(n_tok, device=dev)  # [B, T]
        dtype = ctx.pool.store.dtype
        coda = torch.tensor([c.n_prelude + n * c.n_core for n in laid_out], dtype=torch.long, device=dev)
        shared: dict[Hashable, Any] = {}  # the masks every layer of a kind shares (``LayerMemory.shared``)
        # decode in C: on the engine's CPU backend (``cpu_kernels``), a float32 pool
        # (the CPU backend: a CPU model whose kernels built, ``cpu.backend.use_cpu_kernels``)
        use_native = NATIVE[0] and self.native_fits and self.backend is CPU and n_tok == 1 and dtype == torch.float32

        def memory(layer: int, pass_index: int, rows: torch.Tensor | None) -> LayerMemory:
            if layer < cfg.loop_start:
                slots: torch.Tensor | int = layer
            elif layer < cfg.loop_end:
                slots = c.n_prelude + pass_index * c.n_core + layer - cfg.loop_start
            else:
                slots = (coda if rows is None else coda[rows]) + layer - cfg.loop_end
            return _PagedMemory(ctx, rows, slots, positions if rows is None else positions[rows], dtype, shared,
                                use_native)

        h, blocks = self._layers(tokens, loops, memory)
        if last_only:
            ends = torch.tensor([tokens.shape[1] - 1 if spec.last is None else spec.last for spec in specs],
                                dtype=torch.long, device=dev)
            pick = torch.arange(len(specs), device=dev)
            h, blocks = h[pick, ends][:, None], [b[pick, ends][:, None] for b in blocks]
        logits = self._logits(h, blocks)
        padded = logits.new_full((*logits.shape[:-1], c.vocab_size), float("-inf"))
        padded[..., :logits.shape[-1]] = logits
        return ForwardOutput(logits=padded, state=h, loops_used=list(loops))

    def _layers(self, input_ids: torch.Tensor, passes: list[int], memory: MemoryOf,
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embedding, prelude, each row's ``passes[b]`` core passes, coda: the last hidden state and
        block states ``[B, T, H]`` each; ``memory(layer, pass, rows)`` that layer instance's memory
        for ``rows`` (None: all)."""
        cfg = self.arch
        h = _weighted_rms(self.embed(input_ids), self.embed_norm, cfg.norm_eps)
        h, blocks = self._run(range(cfg.loop_start), h, [], memory, 0, None)
        prelude_h, prelude_blocks = h, blocks
        kept = len(prelude_blocks) + 1  # the core's first block state is the prelude's output again
        for pass_index in range(max(passes)):
            active = [b for b, n in enumerate(passes) if n > pass_index]
            rows = None if len(active) == len(passes) else torch.tensor(active, device=input_ids.device)
            take = partial(_rows_of, rows)
            previous = None if pass_index == 0 else ([take(b) for b in blocks[kept:]], take(h))
            out_h, out_blocks = self._run(range(cfg.loop_start, cfg.loop_end), take(prelude_h),
                                          [take(b) for b in prelude_blocks], memory, pass_index, rows, previous)
            if rows is None:
                h, blocks = out_h, out_blocks
            else:  # the rows that ran fewer passes keep their last pass's states
                h = h.index_copy(0, rows, out_h)
                blocks = [*prelude_blocks, *(b.index_copy(0, rows, o) for b, o in
                                             zip(blocks[len(prelude_blocks):], out_blocks[len(prelude_blocks):]))]
        return self._run(range(cfg.loop_end, cfg.n_layers), h, blocks, memory, 0, None)

    def _logits(self, h: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        cfg = self.arch
        out = _attend_states(self.final_query, torch.stack([*blocks, h], dim=-2))[..., 0, :]
        out = _weighted_rms(out, self.norm, cfg.norm_eps)
        return _softcap(_f32(self.head(out)), cfg.logit_softcap)

    def _run(self, layers: range, h: torch.Tensor, blocks: list[torch.Tensor], memory: MemoryOf, pass_index: int,
             rows: torch.Tensor | None, previous: tuple[list[torch.Tensor], torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``layers`` in order from ``h`` and ``blocks`` (of ``rows``, None: all); ``previous`` the
        last pass's in-core block states and output, for the messages of a core pass after the first."""
        for layer in layers:
            mem = memory(layer, pass_index, rows)
            messages = None if previous is None else self._messages(layer - self.arch.loop_start, *previous,
                                                                    native=_in_c(mem, h))
            new_h = self.layers[layer](h, blocks, messages, mem)
            if self.arch.is_boundary(layer):
                blocks = [*blocks, h]
            h = new_h
        return h, blocks

    def _messages(self, core_layer: int, blocks: list[torch.Tensor], h: torch.Tensor,
                  native: bool = False) -> torch.Tensor:
        """``[B, T, 4, H]``: core layer ``core_layer``'s q, k, v and MLP queries over ``blocks`` and
        ``h`` (in C where ``native``)."""
        q_mlp, kv = self.q_mlp_messages[core_layer], self.kv_messages[core_layer]
        queries = torch.stack([q_mlp[0], kv[0], kv[1], q_mlp[1]])
        if native:
            return native_ops.attend_states(torch.stack([*blocks, h], dim=-2), queries, _RES_EPS)
        return _attend_states(queries, torch.stack([*blocks, h], dim=-2))

    def _check(self, input_ids: torch.Tensor, cache: Inkling2Cache, passes: int) -> None:
        """Refuse bad ids, a pass count out of range or different from the cache's, a batch mismatch."""
        if isinstance(passes, bool) or not isinstance(passes, int) or not 1 <= passes <= MAX_PASSES:
            raise RequestError(f"passes must be an integer in [1, {MAX_PASSES}], got {passes!r}", param="passes")
        if cache.passes not in (None, passes):
            raise RequestError(f"this cache was filled with {cache.passes} passes, not {passes}", param="passes")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] != cache.batch \
                or input_ids.dtype not in (torch.int32, torch.int64):
            raise RequestError(f"input_ids must be integer [{cache.batch}, T>0], got {input_ids.dtype} "
                               f"{list(input_ids.shape)}", param="input_ids")
        if bool(((input_ids < 0) | (input_ids >= self.arch.vocab_size)).any()):
            raise RequestError(f"input_ids must be in [0, {self.arch.vocab_size})", param="input_ids")


# ---- the checkpoint ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Transform:
    """How a checkpoint tensor of ``source_shape`` becomes a canonical one: ``op`` of it, or with
    ``expert`` set, ``op`` of that expert's slice of a stacked ``[E, ...]`` tensor (which a reader
    may fetch alone: ``expert_slice``)."""

    source_shape: tuple[int, ...]
    op: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    expert: int | None = None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.op(tensor if self.expert is None else tensor[self.expert])

    def expert_slice(self, expert_tensor: torch.Tensor) -> torch.Tensor:
        """The canonical tensor from the expert's own slice ``[...]`` of the stacked tensor."""
        return self.op(expert_tensor)


def _conv_taps(t: torch.Tensor) -> torch.Tensor:
    """``nn.Conv1d`` weight ``[C, 1, K]`` (last column: the current token) -> taps ``[K, C]``."""
    return t[:, 0].flip(-1).T.contiguous()


def _gate_up(t: torch.Tensor) -> torch.Tensor:
    """An expert's ``[gate; up]`` ``[2I, H]`` from its ``w13`` rows ``[2I, H]`` (interleaved)."""
    return torch.cat([t[0::2], t[1::2]]).contiguous()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def _row(t: torch.Tensor) -> torch.Tensor:
    """A single query ``[H]`` as ``[1, H]``."""
    return t[None]


def _layer_map(config: Inkling2Config, i: int) -> dict[str, tuple[str, Transform]]:
    """Canonical name -> (checkpoint name, transform) for layer ``i``."""
    h, k, e, inter = config.hidden, config.conv_kernel, config.experts, config.moe_intermediate
    heads, kv_heads, dim, extent = config.attn_shape(i)
    src, dst = f"model.llm.layers.{i}.", f"layers.{i}."
    same = {
        "attn.wq.weight": ("attn.wq_du.weight", (heads * dim, h)),
        "attn.q_scale": ("attn.q_l2_clip.scale", (heads, dim)),
        "attn.wk.weight": ("attn.wk_dv.weight", (kv_heads * dim, h)),
        "attn.wv.weight": ("attn.wv_dv.weight", (kv_heads * dim, h)),
        "attn.wr.weight": ("attn.wr_du.weight", (heads * config.d_rel, h)),
        "attn.rel_scale": ("attn.rel_l2_clip.scale", (heads, config.d_rel)),
        "attn.rel_proj": ("attn.rel_logits_proj.proj", (config.d_rel, extent)),
        "attn.wg.weight": ("attn.gate_attn.weight", (heads * dim, h)),
        "attn.wo.weight": ("attn.wo_ud.weight", (h, heads * dim)),
        "attn.sink.weight": ("attn.attn_sink_proj.weight", (heads, h)),
        "mlp_norm": ("mlp_norm.weight", (h,)),
        "moe.router_weight": ("mlp.gate.weight", (e, h)), "moe.router_bias": ("mlp.gate.bias", (e,)),
    }
    if config.sliding[i]:
        same["attn_norm"] = ("attn_norm.weight", (h,))
    else:
        same |= {f"norm_{x}": (f"{x}_input_norm.weight", (h,)) for x in "qkv"}
        same |= {f"attn.{x}_conv.weight": (f"attn.{x}_sconv.static_w", (k, kv_heads * dim)) for x in "kv"}
        same |= {f"attn.{x}_conv.dynamic.weight": (f"attn.{x}_sconv.weight_proj", (kv_heads * k, h)) for x in "kv"}
    if config.is_loop(i):
        for name, ckpt in (("q", "attn"), ("k", "k"), ("v", "v"), ("mlp", "mlp")):
            same[f"gates.{name}.down.weight"] = (f"controllers.{ckpt}.down_weight", (config.gate_rank, 2 * h))
            same[f"gates.{name}.forget.weight"] = (f"controllers.{ckpt}.forget_weight", (h, config.gate_rank))
            same[f"gates.{name}.message.weight"] = (f"controllers.{ckpt}.gain_weight", (h, config.gate_rank))
    out = {dst + name: (src + ckpt, Transform(shape)) for name, (ckpt, shape) in same.items()}
    convs = {"attn_conv.weight": ("attn_sconv.weight", h), "mlp_conv.weight": ("mlp_sconv.weight", h)}
    if config.sliding[i]:
        convs |= {f"attn.{x}_conv.weight": (f"attn.{x}_sconv.weight", kv_heads * dim) for x in "kv"}
    out |= {dst + name: (src + ckpt, Transform((c, 1, k), _conv_taps)) for name, (ckpt, c) in convs.items()}
    w13 = (e, 2 * inter, h)  # gate and up rows interleaved: 2j is gate j, 2j + 1 is up j
    for x in range(e):
        out[dst + f"moe.experts.{x}.gate_up.weight"] = (src + "mlp.experts.w13_weight",
                                                        Transform(w13, _gate_up, expert=x))
        out[dst + f"moe.experts.{x}.down.weight"] = (src + "mlp.experts.w2_weight",
                                                     Transform((e, h, inter), _contiguous, expert=x))
    queries = "model.llm.attn_res."
    out[dst + "mlp_input.query"] = (f"{queries}mlp_queries.{i}", Transform((h,), _row))
    if i > 0:  # attn_queries.{j} belong to layer j + 1: layer 0 reads its input as is
        one_or_three = Transform((h,), _row) if config.sliding[i] else Transform((3, h))
        out[dst + "attn_input.query"] = (f"{queries}attn_queries.{i - 1}", one_or_three)
    return out


def inkling2_tensor_map(config: Inkling2Config) -> dict[str, tuple[str, Transform]]:
    """Canonical name -> (checkpoint name, transform) for every text tensor of the original
    layout: gate/up de-interleaved from ``w13_weight`` (rows 2i, 2i+1), the head's padding rows
    dropped, conv weights turned into taps by backward distance, ``attn_queries.{i}`` to layer
    ``i + 1``, the cross-pass queries split per core layer."""
    h, v, n_loop = config.hidden, config.vocab_size, config.n_loop
    top = "model.llm."
    out: dict[str, tuple[str, Transform]] = {
        "embed.weight": (top + "embed.weight", Transform((v, h))),
        "embed_norm": (top + "embed_norm.weight", Transform((h,))),
        "norm": (top + "norm.weight", Transform((h,))),
        "head.weight": (top + "unembed.weight", Transform((v, h), lambda t: t[:config.unpadded_vocab_size])),
        "final_query": (top + "attn_res.output_query", Transform((h,), _row)),
        "q_mlp_messages": (top + "middle_cycle_cross_pass_queries",
                           Transform((2 * n_loop, h), lambda t: t.view(n_loop, 2, h))),
        "kv_messages": (top + "middle_cycle_cross_pass_kv_queries",
                        Transform((2 * n_loop, h), lambda t: t.view(n_loop, 2, h))),
    }
    for i in range(config.n_layers):
        out |= _layer_map(config, i)
    return out


def _check_names(path: Path, sources: dict[str, tuple[str, Transform]]) -> None:
    """Refuse a missing text tensor, an unknown one (the vision tower ``model.visual.*`` is ignored)
    and a misshapen one, by name, from the file's header alone."""
    wanted = {name: transform.source_shape for name, transform in sources.values()}
    with safe_open(str(path), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    missing = sorted(set(wanted) - set(shapes))
    if missing:
        raise ConfigError(f"{path.name} is missing tensor(s): {', '.join(missing[:8])}")
    unknown = sorted(n for n in shapes if n not in wanted and not n.startswith("model.visual."))
    if unknown:
        raise ConfigError(f"{path.name} has tensor(s) the Inkling-2 loader does not know: {', '.join(unknown[:8])}")
    for name, shape in wanted.items():
        if shapes[name] != shape:
            raise ConfigError(f"{path.name}: tensor {name} has shape {list(shapes[name])}, expected {list(shape)}")


def load_inkling2(dir_path: str | Path) -> tuple[Inkling2LM, Inkling2Config]:
    """The text model of an Inkling-2 loop checkpoint folder (``config.json`` and a single
    ``model.safetensors`` with plain float experts), in float32. Refuses (``ConfigError``) a bad
    config before allocating anything, and a missing, unknown or misshapen tensor by name."""
    directory = Path(dir_path)
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{directory / 'config.json'}: {e}") from e
    config = Inkling2Config.from_hf(raw)
    path = directory / "model.safetensors"
    if not path.is_file():
        raise ConfigError(f"{directory}: no model.safetensors")
    sources = inkling2_tensor_map(config)
    _check_names(path, sources)
    with safe_open(str(path), "pt") as f:
        state = {canon: transform(f.get_tensor(name)).float().contiguous()
                 for canon, (name, transform) in sources.items()}
    with torch.device("meta"):
        model = Inkling2LM(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval(), config
