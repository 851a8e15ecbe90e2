"""The looped-model config schema: one dataclass for Huginn-style and Ouro-style models.

Validated on construction (``ConfigError`` names the offending field) and round-tripped through
JSON (``to_json`` / ``from_json``); unknown keys are refused so a typo never loads silently.

A config comes from files TinyLoop did not write (an artifact's header, a checkpoint's
``config.json``), and a model, its RoPE tables and its KV pool are sized from it: every size is
bounded (``SIZE_LIMITS``) and every float must be finite, so a hostile or corrupt config is
refused by field before anything is allocated from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tinyloop.errors import ConfigError
from tinyloop.vocabulary import ExitRule, kv_slots_per_token

__all__ = ["MAX_ROPE_ENTRIES", "SIZE_LIMITS", "VALUE_GATE_CHANNELS", "ModelConfig", "kv_bytes_per_token"]

BlockStyle = Literal["pre_ln", "peri_ln", "sandwich", "post_ln"]
Injection = Literal["concat_linear", "diagonal", "none"]
StateInit = Literal["zeros", "randn", "embed"]
LoopNorm = Literal["final_only", "every_loop", "none"]
RopeStyle = Literal["half", "interleaved"]
RopeScaling = Literal["none", "llama3"]
MlpKind = Literal["swiglu", "relu2"]
Architecture = Literal["looped", "inkling2"]
LoopOutput = Literal["none", "linear"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "block_style": ("pre_ln", "peri_ln", "sandwich", "post_ln"),
    "injection": ("concat_linear", "diagonal", "none"),
    "state_init": ("zeros", "randn", "embed"),
    "loop_norm": ("final_only", "every_loop", "none"),
    "rope_style": ("half", "interleaved"),
    "rope_scaling": ("none", "llama3"),
    "rope_tables": ("float64", "float32"),
    "rope_compute": ("input", "float32"),
    "norm_order": ("weight_in_float32", "cast_then_weight"),
    "mlp": ("swiglu", "relu2"),
    "architecture": ("looped", "inkling2"),
    "loop_output": ("none", "linear"),
}

# Each integer field's (smallest, largest) value. The largest are well above every published
# model (Llama-3.1-405B: hidden 16384, 126 layers, head_dim 128; Gemma-3: vocabulary 262144;
# Qwen2.5-1M: 1010000 positions; Huginn-0125 runs up to 64 loops, Ouro 4) and small enough
# that the module tree and the tensor shapes of a config are cheap to work out before any of
# its tensors is checked against a file.
SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22), "hidden": (1, 1 << 16), "heads": (1, 1024), "kv_heads": (1, 1024),
    "head_dim": (1, 1024), "intermediate": (1, 1 << 18), "n_prelude": (0, 1024), "n_core": (1, 1024),
    "n_coda": (0, 1024), "default_loops": (1, 1024), "max_loops": (1, 1024), "max_position": (1, 1 << 21),
    "rope_original_max_position": (1, 1 << 21),
}
# The RoPE tables hold max_position x head_dim floats each (cos and sin): at most 2 GiB apiece.
MAX_ROPE_ENTRIES = 1 << 29
# Float fields that must be finite and > 0 (rope_low_freq_factor may be any finite value >= 0).
_POSITIVE_FLOATS = ("state_init_std", "rope_theta", "rope_scaling_factor", "rope_high_freq_factor", "norm_eps",
                    "embed_scale")
_BOOLS = ("tie_embeddings", "qk_bias", "qk_norm", "qk_head_norm", "fused_qkv", "exit_gate", "prelude_norm")
# A value embedding's gate reads this many leading channels of its layer's attention input (Parcae)
VALUE_GATE_CHANNELS = 32


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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
    injection: Injection = "concat_linear"  # how the prelude output enters each loop (diagonal: Parcae's
    # s * exp(-softplus(dt_bias) * exp(A_log)) + softplus(dt_bias) * (e @ B.T))
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
    # the model class: ``looped`` (LoopedLM, every field above) or ``inkling2`` (Inkling2LM: the
    # artifact holds its own config; this one says what the engine sizes the KV pool and loops by)
    architecture: Architecture = "looped"
    # Parcae's layout:
    mlp: MlpKind = "swiglu"  # SwiGLU (fc = [gate; up]) or relu2: proj(0.5 * relu(fc(x))^2)
    qk_head_norm: bool = False  # a weightless RMS norm over each head of q and k after RoPE (eps: the dtype's)
    prelude_norm: bool = False  # an RMSNorm on the prelude's output, before it is injected
    loop_output: LoopOutput = "none"  # linear: a projection of the final state before the coda
    value_embeds: tuple[int, ...] = ()  # layers (prelude, core, coda counted on) whose attention adds
    # a gated per-token value embedding: v += 2 sigmoid(gate(x[:, :32])) * embed(token)

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_numbers()
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even for RoPE")
        if self.default_loops > self.max_loops:
            raise ConfigError(f"default_loops ({self.default_loops}) exceeds max_loops ({self.max_loops})")
        self._check_value_embeds()
        if self.injection == "none" and self.state_init != "embed":
            raise ConfigError("injection='none' needs state_init='embed' (the loop has no other input)")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError("llama3 rope scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor")
        if not isinstance(self.exit, ExitRule):
            raise ConfigError("exit must be an ExitRule")
        if not _is_number(self.exit.threshold):
            raise ConfigError(f"exit.threshold must be a finite number, got {self.exit.threshold!r}")
        if self.exit.min_loops > self.max_loops:
            raise ConfigError("exit.min_loops exceeds max_loops")

    def _check_sizes(self) -> None:
        for name, (low, high) in SIZE_LIMITS.items():
            value = getattr(self, name)
            if not _is_int(value) or not low <= value <= high:
                kind = "a positive integer" if low == 1 else "a non-negative integer"
                raise ConfigError(f"{name} must be {kind} up to {high}, got {value!r}")
        if self.max_position * self.head_dim > MAX_ROPE_ENTRIES:
            raise ConfigError(f"max_position {self.max_position} x head_dim {self.head_dim} exceeds "
                              f"{MAX_ROPE_ENTRIES} (the RoPE tables would take "
                              f"{self.max_position * self.head_dim * 8 / 2**30:.0f} GiB); lower max_position")

    def _check_value_embeds(self) -> None:
        layers = self.value_embeds
        if not isinstance(layers, tuple) or not all(_is_int(i) for i in layers):
            raise ConfigError(f"value_embeds must be a list of layer indices, got {layers!r}")
        if list(layers) != sorted(set(layers)) or (layers and not 0 <= layers[0] <= layers[-1] < self.n_layers):
            raise ConfigError(f"value_embeds must be distinct layer indices in 0..{self.n_layers - 1}, in order; "
                              f"got {list(layers)}")
        if layers and self.hidden < VALUE_GATE_CHANNELS:
            raise ConfigError(f"value_embeds need hidden >= {VALUE_GATE_CHANNELS} (the gate reads that many channels)")

    def _check_numbers(self) -> None:
        for name in _POSITIVE_FLOATS:
            value = getattr(self, name)
            if not _is_number(value) or not value > 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if not _is_number(self.rope_low_freq_factor) or self.rope_low_freq_factor < 0:
            raise ConfigError(f"rope_low_freq_factor must be a finite number >= 0, got {self.rope_low_freq_factor!r}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

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
        if isinstance(kwargs.get("value_embeds"), list):  # JSON has no tuples
            kwargs["value_embeds"] = tuple(kwargs["value_embeds"])
        if "exit" in kwargs and not isinstance(kwargs["exit"], ExitRule):
            raw = kwargs["exit"]
            if not isinstance(raw, dict):
                raise ConfigError("exit must be an object with kind, threshold, min_loops, check_every, exited_kv")
            bad = sorted(set(raw) - {"kind", "threshold", "min_loops", "check_every", "exited_kv"})
            if bad:
                raise ConfigError(f"unknown exit field(s): {', '.join(bad)}")
            try:
                kwargs["exit"] = ExitRule(**raw)
            except TypeError as exc:  # a field of the wrong type, compared in ExitRule's checks
                raise ConfigError(f"exit: {exc}") from exc
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
        except RecursionError:  # nested past the parser's stack: not a config
            raise ConfigError("model config is not valid JSON: nested too deeply") from None
        return cls.from_dict(data)


def kv_bytes_per_token(config: ModelConfig, loops: int, cache_window: int | None = None,
                       bytes_per_elem: int = 2) -> int:
    """``2 * kv_heads * head_dim * bytes * (n_prelude + n_coda + n_core * min(W, loops))``."""
    return 2 * config.kv_heads * config.head_dim * bytes_per_elem * kv_slots_per_token(
        config, loops, cache_window)
