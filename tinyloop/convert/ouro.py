"""Ouro (``ouro``, ``OuroForCausalLM``) onto TinyLoop's canonical names.

The layout (see REFERENCE-LOOPED.md): the whole stack of ``num_hidden_layers`` layers is the
looped core (no prelude, coda or injection; the first loop starts from the embeddings), run
``total_ut_steps`` times; peri-LN blocks (``input_layernorm`` before attention and
``input_layernorm_2`` on its output before the residual add, ``post_attention_layernorm`` /
``post_attention_layernorm_2`` around the MLP); ``model.norm`` after every loop, whose output
feeds the next loop, the exit gate and the head; separate q/k/v projections with GQA,
rotate-half RoPE; an untied ``lm_head``; the exit gate ``model.early_exit_gate`` (Linear H -> 1
with bias), always loaded. The artifact's default exit rule is ``none``: every loop runs and the
last one feeds the head (vLLM's semantics); a request may ask for the ``gate`` rule.

The MLP's ``gate_proj`` and ``up_proj`` are concatenated into TinyLoop's fused ``mlp.fc``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from tinyloop.convert.common import check_names, check_shape, config_float, config_int, special_tokens
from tinyloop.convert.hfdir import HFDir
from tinyloop.convert.writer import PlannedTensor
from tinyloop.errors import ConfigError
from tinyloop.model.config import ModelConfig

__all__ = ["ARCHITECTURES", "MODEL_TYPES", "ouro_config", "ouro_plan", "ouro_special_tokens"]

MODEL_TYPES = ("ouro",)
ARCHITECTURES = ("OuroForCausalLM",)
EMBED = "model.embed_tokens.weight"

# Config values the mapping assumes: anything else is a different model and is refused.
_FIXED: dict[str, object] = {"hidden_act": "silu", "use_sliding_window": False, "rope_scaling": None,
                             "tie_word_embeddings": False}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "input_layernorm_2.weight": "attn_post_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "post_attention_layernorm_2.weight": "mlp_post_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight", "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight", "self_attn.o_proj.weight": "attn.o.weight",
    "mlp.down_proj.weight": "mlp.proj.weight",
}
_TOP = {EMBED: "embed.weight", "model.norm.weight": "final_norm.weight", "lm_head.weight": "lm_head.weight",
        "model.early_exit_gate.weight": "exit_gate.weight", "model.early_exit_gate.bias": "exit_gate.bias"}
_CHAT_END = "<|im_end|>"  # ChatML's end of turn: a stop token besides the shipped eos (id 0)


def ouro_config(cfg: dict[str, Any], *, max_position: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of an Ouro ``config.json``."""
    for key, value in _FIXED.items():
        if key in cfg and cfg[key] != value:
            raise ConfigError(f"config.json: {key} is {cfg[key]!r}; the Ouro converter supports only {value!r}")
    hidden = config_int(cfg, "hidden_size", field="hidden")
    heads = config_int(cfg, "num_attention_heads", field="heads")
    loops = config_int(cfg, "total_ut_steps", field="default_loops", default=4)
    return ModelConfig(
        vocab_size=config_int(cfg, "vocab_size", field="vocab_size"), hidden=hidden, heads=heads,
        kv_heads=config_int(cfg, "num_key_value_heads", field="kv_heads", default=heads),
        head_dim=config_int(cfg, "head_dim", field="head_dim", default=hidden // heads),
        intermediate=config_int(cfg, "intermediate_size", field="intermediate"), n_prelude=0,
        n_core=config_int(cfg, "num_hidden_layers", field="n_core"), n_coda=0, default_loops=loops,
        max_loops=max(16, loops),
        max_position=max_position or config_int(cfg, "max_position_embeddings", field="max_position"),
        block_style="peri_ln", injection="none", state_init="embed", loop_norm="every_loop",
        rope_theta=config_float(cfg, "rope_theta", 10000.0), rope_style="half",
        rope_tables="float32", norm_order="cast_then_weight",  # the reference's numerics
        norm_eps=config_float(cfg, "rms_norm_eps", 1e-6), tie_embeddings=False, fused_qkv=False, exit_gate=True,
    )


def _sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Canonical name -> the Ouro tensor(s) it is made of (two: concatenated along rows)."""
    out: dict[str, tuple[str, ...]] = {canon: (src,) for src, canon in _TOP.items()}
    for i in range(config.n_core):
        src, dst = f"model.layers.{i}.", f"core.{i}."
        for suffix, canon in _LAYER_NAMES.items():
            out[dst + canon] = (src + suffix,)
        out[dst + "mlp.fc.weight"] = (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight")
    return out


def _produce(hf: HFDir, srcs: tuple[str, ...]) -> torch.Tensor:
    return hf.tensor(srcs[0]) if len(srcs) == 1 else torch.cat([hf.tensor(s) for s in srcs])


def ouro_plan(hf: HFDir, config: ModelConfig, expected: dict[str, tuple[int, ...]]) -> list[PlannedTensor]:
    """Every canonical tensor with its source; refuses a missing, unknown or misshapen tensor by name."""
    sources = _sources(config)
    if set(sources) != set(expected):  # a mapping bug, not the checkpoint's fault
        raise AssertionError(f"Ouro map and model disagree: {sorted(set(sources) ^ set(expected))}")
    check_names(hf, (src for srcs in sources.values() for src in srcs), (), "Ouro")
    plan: list[PlannedTensor] = []
    for canon, shape in expected.items():
        srcs = sources[canon]
        rows = shape[0] // len(srcs)
        for src in srcs:
            check_shape(src, hf.tensors[src].shape, (rows, *shape[1:]) if len(srcs) > 1 else shape)
        plan.append(PlannedTensor(canon, shape, partial(_produce, hf, srcs)))
    return plan


def ouro_special_tokens(hf: HFDir, vocab_ids: Callable[[str], int | None]) -> dict[str, Any]:
    """bos = eos = pad = ``<|endoftext|>`` (0) as shipped; the stop set adds ``<|im_end|>`` (2)."""
    return special_tokens(hf, vocab_ids, _CHAT_END)
