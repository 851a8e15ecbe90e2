"""Parcae (``SandyResearch/parcae-*``: its package's own format, not transformers') onto
TinyLoop's canonical names.

``config.json`` is the ``ParcaeConfig`` dataclass (``"_class_name": "ParcaeConfig"``, no
``model_type``). The layout (the reference ``parcae_lm/models/parcae/parcae.py``):

- embeddings (``transformer.wte``, scale 1), ``n_layers_in_prelude`` pre-norm blocks, then
  ``ln_prelude`` (``prelude_norm``): the prelude's output e;
- the state s (width ``recurrent_embedding_dimension`` = ``n_embd`` here) starts from a
  truncated normal of std ``sqrt(2 / (5 n_embd))`` (``state_init`` ``like-init``, drawn from
  the global RNG on every forward) or zeros (``zero``);
- each loop: diagonal injection ``s * exp(-softplus(dt_bias) * exp(A_log)) +
  softplus(dt_bias) * (e @ B.T)`` (``injection`` ``diagonal``; ``linear`` is Huginn's concat
  adapter), then the ``n_layers_in_recurrent_block`` core blocks; no norm between loops;
- after the last loop the projection ``C`` (``loop_output`` ``linear``), the coda blocks and
  ``ln_f`` once (``loop_norm`` ``none``), then the head (tied to the embeddings);
- blocks: ``x + attn(norm_1(x))``, ``x + mlp(norm_2(x))``; RMSNorm in float32, cast, then the
  weight (``cast_then_weight``); separate ``c_q``/``c_k``/``c_v`` (fused here into one
  projection), interleaved-pair RoPE in float32 at base 50000, then a weightless RMS norm over
  each head of q and k (``qk_head_norm``); MLP ``proj(0.5 * relu(fc(x))^2)`` (``relu2``);
- value embeddings: layer j (prelude, core, coda counted on) with both ``value_embeds.{j}`` and
  an ``attn.ve_gate`` adds ``2 sigmoid(ve_gate(x[..., :32])) * value_embeds.{j}[token]`` to v
  (``value_embeds``); a table or a gate without the other is unused by the reference and dropped.

The loop count: the reference takes it per call (``num_steps_pair``) and otherwise samples it
(Poisson around ``mean_recurrence``, per sequence, even in eval mode). TinyLoop runs
``mean_recurrence`` loops unless a request asks for others (``loops``), and draws the initial
state seeded per request and position (or starts from zeros: ``--state-init zeros``).

The official loader builds RoPE at base 50000 whatever ``rope_settings`` says, loads with
``strict=False`` (a missing tensor silently keeps its random initial value: here it is refused)
and keeps the stored ``freqs_cis`` buffer, which is checked against the tables TinyLoop builds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from tinyloop.convert.common import check_names, check_shape, check_tied_head, config_float, config_int, special_tokens
from tinyloop.convert.hfdir import HFDir
from tinyloop.convert.writer import PlannedTensor
from tinyloop.errors import ArtifactError, ConfigError
from tinyloop.model.config import ModelConfig, StateInit

__all__ = ["EMBED", "is_parcae", "parcae_config", "parcae_plan", "parcae_special_tokens"]

EMBED = "transformer.wte.weight"
ROPE_BASE = 50000.0  # the official loader's, whatever rope_settings holds
# Config values the mapping assumes: anything else is a different model and is refused.
_FIXED: dict[str, object] = {
    "block_class_name": "TransformerPreNormBlock", "norm_class_name": "RMSNorm", "mlp_class_name": "BaseMLP",
    "nonlin_name": "ReLU2", "bias": False, "qk_bias": False, "clip_qkv": None, "logit_softcap": None,
    "use_abacus": False, "mup_model_scaling_factor": 1, "model_class_name": "Parcae",
}
# Initialisations whose embedding and logit scales are 1 and whose embedding std (the
# like-init state's) is sqrt(2 / (5 n_embd)) (parcae_lm/utils/init.py's table).
_INITS = ("scaled-zero", "scaled", "scaled-geiping", "scaled-stuck", "small")
_STATE_INITS: dict[str, StateInit] = {"like-init": "randn", "zero": "zeros"}
_INJECTIONS = {"diagonal": "diagonal", "linear": "concat_linear"}
_BLOCK = {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "mlp_norm.weight",
          "attn.c_proj.weight": "attn.o.weight", "attn.ve_gate.weight": "attn.value_gate.weight",
          "mlp.fc.weight": "mlp.fc.weight", "mlp.proj.weight": "mlp.proj.weight"}
_QKV = ("attn.c_q.weight", "attn.c_k.weight", "attn.c_v.weight")
_STACKS = (("prelude", "prelude", "n_prelude"), ("core_block", "core", "n_core"), ("coda", "coda", "n_coda"))
_TOP = {EMBED: "embed.weight", "transformer.ln_prelude.weight": "prelude_norm.weight",
        "transformer.adapter.A_log": "adapter.A_log", "transformer.adapter.dt_bias": "adapter.dt_bias",
        "transformer.adapter.B": "adapter.B", "transformer.adapter.adapter.weight": "adapter.weight",
        "transformer.C.weight": "loop_out.weight", "transformer.ln_f.weight": "final_norm.weight",
        "lm_head.weight": "lm_head.weight"}

Source = tuple[tuple[str, ...], Callable[..., torch.Tensor]]


def is_parcae(cfg: dict[str, Any]) -> bool:
    """A Parcae ``config.json``: the config dataclass's name, or its model class and loop fields."""
    return cfg.get("_class_name") == "ParcaeConfig" or (
        cfg.get("model_class_name") == "Parcae" and "n_layers_in_recurrent_block" in cfg and "model_type" not in cfg)


def _fixed(cfg: dict[str, Any]) -> None:
    for key, value in _FIXED.items():
        if key in cfg and cfg[key] != value:
            raise ConfigError(f"config.json: {key} is {cfg[key]!r}; the Parcae converter supports only {value!r}")
    rope = cfg.get("rope_settings") or {}
    if not isinstance(rope, dict) or rope.get("use_rope", True) is not True or rope.get("rope_condense_ratio", 1) != 1:
        raise ConfigError(f"config.json: rope_settings {rope!r}; the Parcae converter supports only RoPE "
                          "with rope_condense_ratio 1")
    init = cfg.get("init_strategy", "scaled-zero")
    if init not in _INITS:
        raise ConfigError(f"config.json: init_strategy {init!r}; the Parcae converter supports {', '.join(_INITS)} "
                          "(their embedding and logit scales are 1)")
    if cfg.get("injection_type", "diagonal") not in _INJECTIONS:
        raise ConfigError(f"config.json: injection_type {cfg.get('injection_type')!r}; the Parcae converter "
                          f"supports {', '.join(_INJECTIONS)}")
    if cfg.get("state_init", "like-init") not in _STATE_INITS:
        raise ConfigError(f"config.json: state_init {cfg.get('state_init')!r}; the Parcae converter supports "
                          f"{', '.join(_STATE_INITS)}")


def parcae_config(cfg: dict[str, Any], value_embeds: tuple[int, ...], *, state_init: StateInit | None = None,
                  max_position: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a Parcae ``config.json``; ``value_embeds``: the layers whose table
    and gate the checkpoint holds (``parcae_value_embeds``); ``state_init`` overrides the
    config's (``like-init`` -> randn, ``zero`` -> zeros)."""
    _fixed(cfg)
    hidden = config_int(cfg, "n_embd", field="hidden")
    heads = config_int(cfg, "num_attention_heads", field="heads")
    kv_heads = config_int(cfg, "num_key_value_heads", field="kv_heads", default=heads)
    if kv_heads != heads:  # the core forces kv heads = heads; one kv width for every layer here
        raise ConfigError(f"config.json: num_key_value_heads {kv_heads} != {heads} heads; the Parcae converter "
                          "supports full multi-head attention (the core's)")
    if hidden % heads:
        raise ConfigError(f"config.json: n_embd {hidden} is not a multiple of num_attention_heads {heads}")
    intermediate = config_int(cfg, "intermediate_size", field="intermediate")
    for key, want in (("recurrent_embedding_dimension", hidden), ("recurrent_intermediation_embedding_dimension",
                                                                   intermediate), ("recurrent_num_attention_heads",
                                                                                   heads)):
        if cfg.get(key) is not None and cfg[key] != want:
            raise ConfigError(f"config.json: {key} {cfg[key]!r} differs from the outer layers' {want}; the Parcae "
                              "converter supports a core as wide as the prelude and coda")
    loops = config_int(cfg, "mean_recurrence", field="default_loops")
    tie = cfg.get("tie_embeddings", False)
    if not isinstance(tie, bool) or not isinstance(cfg.get("qk_norm", False), bool) or not isinstance(
            cfg.get("prelude_norm", False), bool):
        raise ConfigError("config.json: tie_embeddings, qk_norm and prelude_norm must be true or false")
    chosen = state_init or _STATE_INITS[cfg.get("state_init", "like-init")]
    return ModelConfig(
        vocab_size=config_int(cfg, "padded_vocab_size", "vocab_size", field="vocab_size"), hidden=hidden,
        heads=heads, kv_heads=kv_heads, head_dim=hidden // heads, intermediate=intermediate,
        n_prelude=config_int(cfg, "n_layers_in_prelude", field="n_prelude"),
        n_core=config_int(cfg, "n_layers_in_recurrent_block", field="n_core"),
        n_coda=config_int(cfg, "n_layers_in_coda", field="n_coda"), default_loops=loops, max_loops=max(64, loops),
        max_position=max_position or config_int(cfg, "block_size", field="max_position"),
        block_style="pre_ln", injection=_INJECTIONS[cfg.get("injection_type", "diagonal")],  # type: ignore[arg-type]
        state_init=chosen, state_init_std=math.sqrt(2 / (5 * hidden)), loop_norm="none", rope_theta=ROPE_BASE,
        rope_style="interleaved", rope_tables="float32", rope_compute="float32", norm_order="cast_then_weight",
        norm_eps=config_float(cfg, "norm_eps", 1e-5), tie_embeddings=tie, fused_qkv=True, mlp="relu2",
        qk_head_norm=cfg.get("qk_norm", False), prelude_norm=cfg.get("prelude_norm", False), loop_output="linear",
        value_embeds=value_embeds,
    )


def parcae_value_embeds(cfg: dict[str, Any], names: set[str]) -> tuple[int, ...]:
    """The layers (prelude, core, coda counted on) that hold both a value table and its gate."""
    keys = (("n_layers_in_prelude", "n_prelude"), ("n_layers_in_recurrent_block", "n_core"),
            ("n_layers_in_coda", "n_coda"))
    counts = [config_int(cfg, key, field=field) for key, field in keys]
    out = []
    layer = 0
    for (src, _, _), count in zip(_STACKS, counts):
        for i in range(count):
            if f"value_embeds.{layer}.weight" in names and f"transformer.{src}.{i}.attn.ve_gate.weight" in names:
                out.append(layer)
            layer += 1
    return tuple(out)


def _sources(config: ModelConfig) -> dict[str, Source]:
    """Canonical name -> (Parcae names, how they become it)."""
    same: Callable[..., torch.Tensor] = lambda t: t  # noqa: E731
    fuse: Callable[..., torch.Tensor] = lambda *ts: torch.cat(ts)  # noqa: E731
    out: dict[str, Source] = {canon: ((src,), same) for src, canon in _TOP.items()}
    layer = 0
    for src_stack, dst_stack, count in _STACKS:
        for i in range(getattr(config, count)):
            src, dst = f"transformer.{src_stack}.{i}.", f"{dst_stack}.{i}."
            out |= {dst + canon: ((src + suffix,), same) for suffix, canon in _BLOCK.items()}
            out[dst + "attn.qkv.weight"] = (tuple(src + name for name in _QKV), fuse)
            out[dst + "attn.value_table.weight"] = ((f"value_embeds.{layer}.weight",), same)
            layer += 1
    return out


def _dropped(hf: HFDir, config: ModelConfig) -> list[str]:
    """Stored tensors the reference does not read: the tied head (checked equal), the RoPE
    buffer (checked), and a value table or gate without the other."""
    lone = [name for name in hf.tensors if name.startswith("value_embeds.") or name.endswith(".attn.ve_gate.weight")]
    return ["freqs_cis", *([] if not config.tie_embeddings else ["lm_head.weight"]), *lone]


def _produce(hf: HFDir, srcs: tuple[str, ...], transform: Callable[..., torch.Tensor]) -> torch.Tensor:
    return transform(*(hf.tensor(src) for src in srcs))


def parcae_plan(hf: HFDir, config: ModelConfig, expected: dict[str, tuple[int, ...]]) -> list[PlannedTensor]:
    """Every canonical tensor with its source; refuses a missing, unknown or misshapen tensor by name."""
    sources = {canon: src for canon, src in _sources(config).items() if canon in expected}
    if set(sources) != set(expected):  # a mapping bug, not the checkpoint's fault
        raise AssertionError(f"Parcae map and model disagree: {sorted(set(sources) ^ set(expected))}")
    check_names(hf, (name for srcs, _ in sources.values() for name in srcs), _dropped(hf, config), "Parcae")
    plan: list[PlannedTensor] = []
    for canon, shape in expected.items():
        srcs, transform = sources[canon]
        if len(srcs) == 1:
            check_shape(srcs[0], hf.tensors[srcs[0]].shape, shape)
        else:  # q, k, v: [heads * head_dim, H] each
            for src in srcs:
                check_shape(src, hf.tensors[src].shape, (shape[0] // 3, shape[1]))
        plan.append(PlannedTensor(canon, shape, partial(_produce, hf, srcs, transform)))
    if config.tie_embeddings:
        check_tied_head(hf, "lm_head.weight", EMBED, "the config ties the head to the embeddings")
    _check_rope(hf, config)
    return plan


def _check_rope(hf: HFDir, config: ModelConfig) -> None:
    """The stored ``freqs_cis`` ``[1, P, 1, D/2, 2]`` (cos, sin) must be the tables TinyLoop builds."""
    info = hf.tensors.get("freqs_cis")
    if info is None:
        return
    half = config.head_dim // 2
    if len(info.shape) != 5 or info.shape[2:] != (1, half, 2) or info.shape[0] != 1:
        raise ArtifactError(f"checkpoint tensor freqs_cis has shape {list(info.shape)}, expected "
                            f"[1, positions, 1, {half}, 2]")
    stored = hf.tensor("freqs_cis")[0, :, 0].float()  # [P, D/2, 2]
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))
    angles = torch.outer(torch.arange(stored.shape[0], dtype=torch.float32), inv)
    want = torch.stack([angles.cos(), angles.sin()], dim=-1)
    if not torch.allclose(stored, want, atol=1e-5, rtol=0):
        raise ArtifactError(f"checkpoint tensor freqs_cis is not RoPE at base {config.rope_theta:g} (the reference "
                            "loader's); TinyLoop cannot serve other tables")


def parcae_special_tokens(hf: HFDir, vocab_ids: Callable[[str], int | None]) -> dict[str, Any]:
    """bos, eos and the stop set from ``tokenizer_config.json`` (``<|bos|>``, ``<|eos|>``)."""
    return special_tokens(hf, vocab_ids)
