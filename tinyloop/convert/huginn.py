"""Huginn-0125 (``huginn_raven``, ``RavenForCausalLM``) onto TinyLoop's canonical names.

The layout (see DESIGN.md and the published model): sandwich blocks (``norm_1`` before and
``norm_2`` after attention's residual add, ``norm_3``/``norm_4`` around the MLP), a fused
``Wqkv`` with a learned ``qk_bias`` [2, 1, H, D] added to q and k before interleaved RoPE, a
concat adapter ``[state; prelude_out]`` -> H, embeddings scaled by ``init_values.embed_scale``,
``ln_f`` before and after the coda, and a tied head. The stored ``lm_head.weight`` must equal
``transformer.wte.weight`` and is dropped; ``freqs_cis`` (the reference's RoPE table) is dropped.

The reference draws each token's initial state from a truncated normal of std
``init_values.std * embed_scale``; TinyLoop draws it seeded per position (``state_init`` randn,
reproducible per request), or starts from zeros (``state_init`` zeros, what the reference does
with ``init_scale=0``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from tinyloop.convert.common import (
    check_names,
    check_shape,
    check_tied_head,
    config_float,
    config_int,
    config_section,
    special_tokens,
)
from tinyloop.convert.hfdir import HFDir
from tinyloop.convert.writer import PlannedTensor
from tinyloop.errors import ConfigError
from tinyloop.model.config import ModelConfig, StateInit

__all__ = ["MODEL_TYPES", "huginn_config", "huginn_plan", "huginn_special_tokens"]

MODEL_TYPES = ("huginn_raven",)
ARCHITECTURES = ("RavenForCausalLM",)

# Config values the mapping assumes: anything else is a different model and is refused.
_FIXED: dict[str, object] = {
    "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU", "injection_type": "linear", "bias": False, "tie_embeddings": True,
}
# Per layer: Huginn's suffix -> TinyLoop's suffix (qk_bias is split separately).
_LAYER_NAMES = {
    "norm_1.weight": "attn_norm.weight", "norm_2.weight": "attn_post_norm.weight",
    "norm_3.weight": "mlp_norm.weight", "norm_4.weight": "mlp_post_norm.weight",
    "attn.Wqkv.weight": "attn.qkv.weight", "attn.proj.weight": "attn.o.weight",
    "mlp.fc.weight": "mlp.fc.weight", "mlp.proj.weight": "mlp.proj.weight",
}
_STACKS = (("prelude", "prelude", "n_prelude"), ("core_block", "core", "n_core"), ("coda", "coda", "n_coda"))
_TOP = {"transformer.wte.weight": "embed.weight", "transformer.adapter.weight": "adapter.weight",
        "transformer.ln_f.weight": "final_norm.weight"}
_DROPPED = ("lm_head.weight", "freqs_cis")


def huginn_config(cfg: dict[str, Any], *, state_init: StateInit = "randn",
                  max_position: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a Huginn ``config.json``."""
    for key, value in _FIXED.items():
        if key in cfg and cfg[key] != value:
            raise ConfigError(f"config.json: {key} is {cfg[key]!r}; the Huginn converter supports only {value!r}")
    hidden = config_int(cfg, "n_embd", field="hidden")
    heads = config_int(cfg, "num_attention_heads", "n_heads", field="heads")
    init = config_section(cfg, "init_values")
    embed_scale = config_float(init, "embed_scale", hidden ** 0.5, where="init_values.")
    std = config_float(init, "std", (2 / (5 * hidden)) ** 0.5, where="init_values.")
    loops = config_int(cfg, "mean_recurrence", field="default_loops")
    kv_heads = config_int(cfg, "num_key_value_heads", field="kv_heads", default=heads)
    if kv_heads != heads:
        raise ConfigError(f"config.json: num_key_value_heads {kv_heads} != {heads} heads; Huginn is full MHA")
    return ModelConfig(
        vocab_size=config_int(cfg, "padded_vocab_size", "vocab_size", field="vocab_size"), hidden=hidden,
        heads=heads, kv_heads=kv_heads, head_dim=config_int(cfg, "head_dim", field="head_dim", default=hidden // heads),
        intermediate=config_int(cfg, "intermediate_size", field="intermediate"),
        n_prelude=config_int(cfg, "n_layers_in_prelude", field="n_prelude"),
        n_core=config_int(cfg, "n_layers_in_recurrent_block", field="n_core"),
        n_coda=config_int(cfg, "n_layers_in_coda", field="n_coda"), default_loops=loops, max_loops=max(64, loops),
        max_position=max_position or config_int(cfg, "block_size", field="max_position"),
        block_style="sandwich", injection="concat_linear", state_init=state_init,
        state_init_std=std * embed_scale, loop_norm="final_only", rope_theta=config_float(cfg, "rope_base", 50000.0),
        rope_style="interleaved",
        rope_tables="float32", rope_compute="float32", norm_order="cast_then_weight",  # the reference's numerics
        norm_eps=config_float(cfg, "norm_eps", 1e-6), tie_embeddings=True,
        embed_scale=embed_scale, qk_bias=bool(cfg.get("qk_bias", False)), fused_qkv=True,
    )


def _sources(config: ModelConfig) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """Canonical name -> (Huginn name, transform)."""
    same: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # noqa: E731
    out = {canon: (src, same) for src, canon in _TOP.items()}
    for src_stack, dst_stack, count in _STACKS:
        for i in range(getattr(config, count)):
            src, dst = f"transformer.{src_stack}.{i}.", f"{dst_stack}.{i}."
            for suffix, canon in _LAYER_NAMES.items():
                out[dst + canon] = (src + suffix, same)
            if config.qk_bias:
                out[dst + "attn.q_bias"] = (src + "attn.qk_bias", lambda t: t[0, 0])
                out[dst + "attn.k_bias"] = (src + "attn.qk_bias", lambda t: t[1, 0])
    return out


def _produce(hf: HFDir, src: str, transform: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return transform(hf.tensor(src))


def huginn_plan(hf: HFDir, config: ModelConfig, expected: dict[str, tuple[int, ...]]) -> list[PlannedTensor]:
    """Every canonical tensor with its source; refuses a missing, unknown or misshapen tensor by name."""
    sources = _sources(config)
    if set(sources) != set(expected):  # a mapping bug, not the checkpoint's fault
        raise AssertionError(f"Huginn map and model disagree: {sorted(set(sources) ^ set(expected))}")
    check_names(hf, (src for src, _ in sources.values()), _DROPPED, "Huginn")
    plan: list[PlannedTensor] = []
    for canon, shape in expected.items():
        src, transform = sources[canon]
        want = (2, 1, config.heads, config.head_dim) if src.endswith("qk_bias") else shape
        check_shape(src, hf.tensors[src].shape, want)
        plan.append(PlannedTensor(canon, shape, partial(_produce, hf, src, transform)))
    check_tied_head(hf, "lm_head.weight", "transformer.wte.weight",
                    "the Huginn converter supports only the tied head")
    return plan


def huginn_special_tokens(hf: HFDir, vocab_ids: Callable[[str], int | None]) -> dict[str, Any]:
    """bos, eos and the stop set: bos, eos and generation_config's eos ids ({65504, 65505, 65508})."""
    return special_tokens(hf, vocab_ids)
