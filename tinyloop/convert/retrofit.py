"""Retrofitted recurrence (McLeish et al. 2025: ``Recurrent-Llama-3.2-*``, ``Recurrent-TinyLlama-*``,
``Recurrent-OLMo-2-*``) onto TinyLoop's canonical names.

These checkpoints reuse Huginn's ``RavenForCausalLM`` (``model_type`` ``huginn_raven``) and tensor
names, with the layers of a pretrained Llama or OLMo-2 model cut into prelude, looped core and
coda. What differs from Huginn (see the reference ``raven_modeling_minimal.py`` they ship):

- no ``ln_f`` between the loop and the coda: ``transformer.ln_f`` runs once, after the coda
  (``loop_norm`` ``none``); the concat adapter ``[state; prelude_out]`` -> H is Huginn's;
- the layers keep their base model's block: Llama's pre-norm (``norm_1`` before attention,
  ``norm_2`` before the MLP) or OLMo-2's post-norm (``x + norm_1(attn(x))``, ``x + norm_2(mlp(x))``)
  with QK-norm (``attn.q_norm`` / ``attn.k_norm``: RMSNorm over the full q and k projections
  before the head split); the layout is told by the ``q_norm`` tensors;
- rotate-half RoPE at ``rope_theta`` with the base model's ``rope_scaling`` (Llama-3's
  ``llama3`` type), tables in float32; the Llama code rotates in the model dtype, OLMo-2's in
  float32; GQA (``num_key_value_heads``); ``init_values.embed_scale`` 1;
- an untied ``lm_head`` (``tie_embeddings`` false as converted; a tied one is checked equal and
  dropped).

A checkpoint of this family is a ``huginn_raven`` whose ``config.json`` has ``rope_theta`` (the
conversion copies it from the base model; Huginn-0125 has ``rope_base`` only). The reference
draws the initial state from a truncated normal of std ``init_values.std * embed_scale`` (a
tiny value: the conversion keeps Huginn-0125's); TinyLoop draws it seeded per position, or
starts from zeros (the reference's ``init_scale=0``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import Any

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

__all__ = ["is_retrofit", "retrofit_config", "retrofit_plan", "retrofit_special_tokens"]

EMBED = "transformer.wte.weight"
_FIXED: dict[str, object] = {
    "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU", "injection_type": "linear", "bias": False, "qk_bias": False,
}
_COMMON = {"attn.Wqkv.weight": "attn.qkv.weight", "attn.proj.weight": "attn.o.weight",
           "mlp.fc.weight": "mlp.fc.weight", "mlp.proj.weight": "mlp.proj.weight"}
_LLAMA = {**_COMMON, "norm_1.weight": "attn_norm.weight", "norm_2.weight": "mlp_norm.weight"}
_OLMO = {**_COMMON, "norm_1.weight": "attn_post_norm.weight", "norm_2.weight": "mlp_post_norm.weight",
         "attn.q_norm.weight": "attn.q_norm.weight", "attn.k_norm.weight": "attn.k_norm.weight"}
_STACKS = (("prelude", "prelude", "n_prelude"), ("core_block", "core", "n_core"), ("coda", "coda", "n_coda"))
_TOP = {EMBED: "embed.weight", "transformer.adapter.weight": "adapter.weight",
        "transformer.ln_f.weight": "final_norm.weight"}
_CHAT_END = "<|eot_id|>"  # Llama-3's end of turn, a stop token when the vocabulary has it


def is_retrofit(cfg: dict[str, Any]) -> bool:
    """A ``huginn_raven`` config of a retrofitted model: it carries its base model's ``rope_theta``."""
    return "rope_theta" in cfg


def _is_olmo(names: Collection[str]) -> bool:
    return any(name.endswith(".attn.q_norm.weight") for name in names)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any]:
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        return {}
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ConfigError(f"config.json: rope_scaling {scaling!r}; the retrofit converter supports only "
                          "rope_type 'llama3'")
    needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if any(scaling.get(key) is None for key in needed):
        raise ConfigError(f"config.json: rope_scaling needs {', '.join(needed)}")
    return {"rope_scaling": "llama3",
            "rope_scaling_factor": config_float(scaling, "factor", 0.0, where="rope_scaling."),
            "rope_low_freq_factor": config_float(scaling, "low_freq_factor", 0.0, where="rope_scaling."),
            "rope_high_freq_factor": config_float(scaling, "high_freq_factor", 0.0, where="rope_scaling."),
            "rope_original_max_position": config_int(scaling, "original_max_position_embeddings",
                                                     field="rope_original_max_position")}


def retrofit_config(cfg: dict[str, Any], names: Collection[str], *, state_init: StateInit = "randn",
                    max_position: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a retrofitted ``config.json`` whose checkpoint holds tensors ``names``."""
    for key, value in _FIXED.items():
        if key in cfg and cfg[key] != value:
            raise ConfigError(f"config.json: {key} is {cfg[key]!r}; the retrofit converter supports only {value!r}")
    olmo = _is_olmo(names)
    hidden = config_int(cfg, "n_embd", field="hidden")
    heads = config_int(cfg, "num_attention_heads", "n_heads", field="heads")
    head_dim = config_int(cfg, "head_dim", field="head_dim", default=hidden // heads)
    if not olmo and head_dim * heads != hidden:  # the Llama reference splits q at n_embd
        raise ConfigError(f"config.json: head_dim {head_dim} x {heads} heads != n_embd {hidden}")
    init = config_section(cfg, "init_values")
    embed_scale = config_float(init, "embed_scale", hidden ** 0.5, where="init_values.")
    std = config_float(init, "std", (2 / (5 * hidden)) ** 0.5, where="init_values.")
    loops = config_int(cfg, "mean_recurrence", field="default_loops")
    theta = config_float(cfg, "rope_theta", 0.0) or config_float(cfg, "rope_base", 0.0)
    if not theta:
        raise ConfigError("config.json: needs a number rope_theta")
    tied = bool(cfg.get("tie_embeddings", cfg.get("tie_word_embeddings", False)))
    return ModelConfig(
        vocab_size=config_int(cfg, "padded_vocab_size", "vocab_size", field="vocab_size"), hidden=hidden,
        heads=heads, kv_heads=config_int(cfg, "num_key_value_heads", field="kv_heads", default=heads),
        head_dim=head_dim, intermediate=config_int(cfg, "intermediate_size", field="intermediate"),
        n_prelude=config_int(cfg, "n_layers_in_prelude", field="n_prelude"),
        n_core=config_int(cfg, "n_layers_in_recurrent_block", field="n_core"),
        n_coda=config_int(cfg, "n_layers_in_coda", field="n_coda"), default_loops=loops, max_loops=max(64, loops),
        max_position=max_position or config_int(cfg, "max_position_embeddings", "block_size", field="max_position"),
        block_style="post_ln" if olmo else "pre_ln", injection="concat_linear", state_init=state_init,
        state_init_std=std * embed_scale, loop_norm="none", rope_theta=theta, rope_style="half",
        **_rope_scaling(cfg), rope_tables="float32", rope_compute="float32" if olmo else "input",
        norm_order="cast_then_weight",  # the reference's numerics
        norm_eps=config_float(cfg, "norm_eps", 1e-6), tie_embeddings=tied, embed_scale=embed_scale,
        qk_norm=olmo, fused_qkv=True,
    )


def _sources(config: ModelConfig) -> dict[str, str]:
    """Canonical name -> the checkpoint's name."""
    out = {canon: src for src, canon in _TOP.items()}
    if not config.tie_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    layer = _OLMO if config.qk_norm else _LLAMA
    for src_stack, dst_stack, count in _STACKS:
        for i in range(getattr(config, count)):
            for suffix, canon in layer.items():
                out[f"{dst_stack}.{i}.{canon}"] = f"transformer.{src_stack}.{i}.{suffix}"
    return out


def retrofit_plan(hf: HFDir, config: ModelConfig, expected: dict[str, tuple[int, ...]]) -> list[PlannedTensor]:
    """Every canonical tensor with its source; refuses a missing, unknown or misshapen tensor by name."""
    sources = _sources(config)
    if set(sources) != set(expected):  # a mapping bug, not the checkpoint's fault
        raise AssertionError(f"retrofit map and model disagree: {sorted(set(sources) ^ set(expected))}")
    check_names(hf, sources.values(), ("lm_head.weight",) if config.tie_embeddings else (), "retrofit")
    plan: list[PlannedTensor] = []
    for canon, shape in expected.items():
        src = sources[canon]
        check_shape(src, hf.tensors[src].shape, shape)
        plan.append(PlannedTensor(canon, shape, partial(hf.tensor, src)))
    if config.tie_embeddings:
        check_tied_head(hf, "lm_head.weight", EMBED, "config.json ties the head (tie_embeddings)")
    return plan


def retrofit_special_tokens(hf: HFDir, vocab_ids: Callable[[str], int | None]) -> dict[str, Any]:
    """bos, eos, pad and the stop set: bos, eos, generation_config's eos ids and ``<|eot_id|>``."""
    return special_tokens(hf, vocab_ids, _CHAT_END)
