"""The looped-model config schema: one dataclass for Huginn-style and Ouro-style models.

Validated on construction (``ConfigError`` names the offending field) and round-tripped through
JSON (``to_json`` / ``from_json``); unknown keys are refused so a typo never loads silently.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from tinyloop.errors import ConfigError
from tinyloop.vocabulary import ExitRule, kv_slots_per_token

__all__ = ["ModelConfig", "kv_bytes_per_token"]

BlockStyle = Literal["pre_ln", "peri_ln", "sandwich", "post_ln"]
Injection = Literal["concat_linear", "none"]
StateInit = Literal["zeros", "randn", "embed"]
LoopNorm = Literal["final_only", "every_loop", "none"]
RopeStyle = Literal["half", "interleaved"]
RopeScaling = Literal["none", "llama3"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "block_style": ("pre_ln", "peri_ln", "sandwich", "post_ln"),
    "injection": ("concat_linear", "none"),
    "state_init": ("zeros", "randn", "embed"),
    "loop_norm": ("final_only", "every_loop", "none"),
    "rope_style": ("half", "interleaved"),
    "rope_scaling": ("none", "llama3"),
    "rope_tables": ("float64", "float32"),
    "rope_compute": ("input", "float32"),
    "norm_order": ("weight_in_float32", "cast_then_weight"),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Dimensions and layout of a looped transformer; see DESIGN.md, "The model family"."""

    vocab_size: int = 4096  # rows of the embedding and LM head (may exceed the tokenizer's vocab)
    hidden: int = 256  # residual width H
    heads: int = 4  # query heads
    kv_heads: int = 4  # key/value heads; GQA when < heads
    head_dim: int = 64  # per-head width (heads * head_dim need not equal hidden)
    intermediate: int = 1024  # MLP inner width (SwiGLU)
    n_prelude: int = 1  # layers run once before the loop
    n_core: int = 2  # layers of the looped core block
    n_coda: int = 1  # layers run once after the loop
    default_loops: int = 4  # loops when a request does not ask
    max_loops: int = 32  # the most loops a request may ask for
    max_position: int = 2048  # longest sequence the model was built for (RoPE table size)
    block_style: BlockStyle = "pre_ln"  # where the norms sit around attention and MLP
    injection: Injection = "concat_linear"  # how the prelude output enters each loop
    state_init: StateInit = "randn"  # initial core state of a token
    state_init_std: float = 0.632  # std of the truncated-normal initial state (randn)
    loop_norm: LoopNorm = "final_only"  # final_norm after the last loop only, after each loop, or none
    # between the loop and the coda (retrofitted recurrence: final_norm only after the coda)
    exit: ExitRule = field(default_factory=ExitRule)  # adaptive exit rule
    rope_theta: float = 10000.0  # RoPE base
    rope_style: RopeStyle = "half"  # rotate-half (Llama/Ouro) or adjacent pairs (Huginn)
    rope_scaling: RopeScaling = "none"  # Llama-3's frequency scaling (the four fields below)
    rope_scaling_factor: float = 8.0  # llama3: low frequencies are divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / this are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / this are kept
    rope_original_max_position: int = 8192  # llama3: the context length the model was trained for
    # Numerics a converted checkpoint's reference uses (the defaults are TinyLoop's own):
    rope_tables: Literal["float64", "float32"] = "float64"  # precision the cos/sin tables are built in
    rope_compute: Literal["input", "float32"] = "input"  # dtype q and k are rotated in (Huginn: float32)
    norm_order: Literal["weight_in_float32", "cast_then_weight"] = "weight_in_float32"  # RMSNorm: scale
    # by the weight in float32 then cast, or cast the normalised x to the input dtype first (both refs)
    norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_embeddings: bool = True  # lm_head shares the embedding matrix
    embed_scale: float = 1.0  # embeddings are multiplied by this (Huginn: sqrt(hidden))
    qk_bias: bool = False  # a learned bias added to q and k before RoPE (Huginn)
    qk_norm: bool = False  # RMSNorm over the full q and k projections before the head split (OLMo-2)
    fused_qkv: bool = True  # one [q;k;v] projection instead of three
    exit_gate: bool = False  # load the exit gate even when the default rule is not ``gate`` (Ouro)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                    "n_core", "default_loops", "max_loops", "max_position")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_prelude", "n_coda"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even for RoPE")
        if self.default_loops > self.max_loops:
            raise ConfigError(f"default_loops ({self.default_loops}) exceeds max_loops ({self.max_loops})")
        if self.injection == "none" and self.state_init != "embed":
            raise ConfigError("injection='none' needs state_init='embed' (the loop has no other input)")
        if self.rope_scaling == "llama3" and not (self.rope_scaling_factor > 0 and self.rope_original_max_position > 0
                                                   and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ConfigError("llama3 rope scaling needs factor > 0, original max position > 0 and "
                              "0 < low_freq_factor < high_freq_factor")
        if not self.state_init_std > 0 or not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError("state_init_std, norm_eps and rope_theta must be > 0")
        if not isinstance(self.exit, ExitRule):
            raise ConfigError("exit must be an ExitRule")
        if self.exit.min_loops > self.max_loops:
            raise ConfigError("exit.min_loops exceeds max_loops")

    # -- derived -------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        """Distinct layers (weights): prelude + core + coda."""
        return self.n_prelude + self.n_core + self.n_coda

    @property
    def has_exit_gate(self) -> bool:
        """Whether the model has an exit gate (``exit_gate.weight``/``.bias``): a request may ask for ``gate``."""
        return self.exit_gate or self.exit.needs_gate

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ConfigError("a model config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        kwargs = dict(data)
        if "exit" in kwargs and not isinstance(kwargs["exit"], ExitRule):
            raw = kwargs["exit"]
            if not isinstance(raw, dict):
                raise ConfigError("exit must be an object with kind, threshold, min_loops, check_every, exited_kv")
            bad = sorted(set(raw) - {"kind", "threshold", "min_loops", "check_every", "exited_kv"})
            if bad:
                raise ConfigError(f"unknown exit field(s): {', '.join(bad)}")
            kwargs["exit"] = ExitRule(**raw)
        try:
            return cls(**kwargs)
        except TypeError as exc:  # wrong arity is impossible after the key check; keep a clear message
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


def kv_bytes_per_token(config: ModelConfig, loops: int, cache_window: int | None = None,
                       bytes_per_elem: int = 2) -> int:
    """``2 * kv_heads * head_dim * bytes * (n_prelude + n_coda + n_core * min(W, loops))``."""
    return 2 * config.kv_heads * config.head_dim * bytes_per_elem * kv_slots_per_token(
        config, loops, cache_window)
