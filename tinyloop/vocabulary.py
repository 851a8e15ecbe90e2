"""The vocabulary every layer shares: exit rules, KV cache modes and the KV slot count.

No torch and no trio here: requests, settings, policy and the CLI use these without loading the
model. ``tinyloop.model`` builds on them.

KV cache modes: what the paged pool stores per token and slot, and what that costs.

    mode                   stores per token and slot                    bytes per token and slot
    full                   K and V (E_kv = 2 * kv_heads * head_dim values)  E_kv * b
    int4                   K and V as 4-bit codes + per-group scale, min    E_kv / 2 + 4 * E_kv / g_kv
    h-mode                 h, the attention input (hidden values)           hidden * b
    h-mode-fp16-qkv        h in 16 bits, K,V recomputed in 16 bits          hidden * 2
    h-mode[-fp16-qkv]+int4 h as 4-bit codes + per-group scale, min          hidden / 2 + 4 * hidden / g_h

``b`` is the bytes of the model dtype (4 for float32, 2 for
float16/bfloat16). An int4 group holds ``g`` consecutive values of one vector (a head's
``head_dim`` for K and V, ``hidden`` for h) and keeps an fp16 scale and an fp16 minimum (4
bytes): ``g_kv = gcd(group_size, head_dim)``, ``g_h = gcd(group_size, hidden)`` so a group never
straddles two heads. Bytes per token = bytes per token and slot * ``kv_slots_per_token``.

h-mode pays for the bytes it saves with compute: every attention call re-projects the stored h
of every key it reads (``h @ [W_k; W_v]``, + k bias, + RoPE). It stores less than full mode only
when ``hidden < 2 * kv_heads * head_dim``: with GQA (few kv heads) it stores *more*.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Literal, Protocol

from tinyloop.errors import ConfigError

__all__ = ["EXIT_DEFAULT_THRESHOLDS", "EXIT_KINDS", "ExitKind", "ExitRule", "ExitedKV", "GATE_KINDS",
           "INT4_GROUP_SIZES", "KVMode", "KV_MODES", "LayerShape", "STOP_KINDS", "kv_slots_per_token"]

ExitKind = Literal["none", "gate", "gate_select", "gate_expected", "kl", "minp_kl", "entropy_diff",
                   "latent_diff", "cosine", "argmax_stability"]
ExitedKV = Literal["copy_latest", "skip"]

EXIT_KINDS: tuple[str, ...] = ("none", "gate", "gate_select", "gate_expected", "kl", "minp_kl",
                               "entropy_diff", "latent_diff", "cosine", "argmax_stability")
GATE_KINDS = ("gate", "gate_select", "gate_expected")  # rules that need a model with an exit gate
STOP_KINDS = ("gate", "kl", "minp_kl", "entropy_diff", "latent_diff", "cosine", "argmax_stability")
"""Rules that stop a decoded token's loops early (the others run every loop)."""

EXIT_DEFAULT_THRESHOLDS: dict[str, float] = {
    "kl": 1e-3, "minp_kl": 1e-5, "entropy_diff": 1e-3, "latent_diff": 0.03, "cosine": 1e-3,
    "argmax_stability": 5.0, "gate": 0.5, "gate_select": 0.5, "gate_expected": 1.0,
}
"""The threshold a rule takes when a request names none (Huginn's reference defaults)."""


class LayerShape(Protocol):
    """The part of a model config the KV arithmetic reads (``ModelConfig`` has it)."""

    @property
    def n_prelude(self) -> int: ...
    @property
    def n_core(self) -> int: ...
    @property
    def n_coda(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ExitRule:
    """When a token may stop looping early, or which loop feeds the head.

    Stop rules (``STOP_KINDS``) end a decoded token's loops once they fire. Huginn's reference
    criteria, each compared after a checked loop against its value at the previous check:

    - ``kl``: KL(p_prev || p_new) of the output distributions (the coda runs at every check),
      the first check against a uniform distribution; fires below ``threshold``.
    - ``minp_kl``: the same on min-p-filtered distributions (probabilities under 0.1 * max set to
      1/V, renormalised).
    - ``entropy_diff``: |H(p_new) - H(p_prev)|, the first check against 100.
    - ``latent_diff``: ``||s_new - s_prev|| / ||s_new||``, the first check against the initial state.
    - ``cosine``: 1 - cos(s_new, s_prev), the first check against the initial state.
    - ``argmax_stability``: the argmax has not changed for ``threshold`` checks in a row.
    - ``gate``: Ouro's gate, exit once the cumulative exit probability reaches ``threshold``.

    A check runs after loop ``d`` (1-based) when ``d >= min_loops`` and ``(d - min_loops) %
    check_every == 0`` (the reference's ``min_steps`` is ``min_loops - 1``, its
    ``check_criterion_every_n_steps`` is ``check_every``). ``exited_kv`` is what later tokens read
    in the loop slots an exited token never wrote: ``copy_latest`` (its last written K,V are copied
    into them) or ``skip`` (those keys are left out of attention at those loops: the reference's
    default lookup).

    Rules that run every loop: ``gate_select``, the Ouro reference's exit selection (per position,
    prompt positions included, the state of the first loop whose cumulative exit probability
    reaches ``threshold`` feeds the head, the last loop when none does); ``gate_expected``, the
    Ouro reference's ``use_weighted_exit`` (the head's logits averaged over the loops, weighted by
    the exit distribution).
    """

    kind: ExitKind = "none"
    threshold: float = 0.0
    min_loops: int = 1
    check_every: int = 1
    exited_kv: ExitedKV = "copy_latest"

    def __post_init__(self) -> None:
        kind = str(self.kind).replace("-", "_")
        if kind not in EXIT_KINDS:
            raise ConfigError(f"exit.kind must be one of {', '.join(EXIT_KINDS)}; got {self.kind!r}")
        object.__setattr__(self, "kind", kind)
        if kind not in ("none", "gate_expected") and not self.threshold > 0:
            raise ConfigError(f"exit.threshold must be > 0 for exit.kind={kind!r}")
        if kind in ("gate", "gate_select") and self.threshold > 1:
            raise ConfigError("exit.threshold must be in (0, 1] for the gate rules")
        if self.min_loops < 1:
            raise ConfigError("exit.min_loops must be >= 1")
        if self.check_every < 1:
            raise ConfigError("exit.check_every must be >= 1")
        if self.exited_kv not in ("copy_latest", "skip"):
            raise ConfigError(f"exit.exited_kv must be copy_latest or skip; got {self.exited_kv!r}")

    @classmethod
    def of(cls, kind: str, threshold: float | None = None, **fields: object) -> ExitRule:
        """A rule whose threshold, when None, is the kind's default (``EXIT_DEFAULT_THRESHOLDS``)."""
        kind = kind.replace("-", "_")
        if threshold is None:
            threshold = EXIT_DEFAULT_THRESHOLDS.get(kind, 0.0)
        return cls(kind, threshold, **fields)  # type: ignore[arg-type]

    @property
    def stops(self) -> bool:
        """Whether a decoded token may run fewer loops than asked (its KV then has gaps)."""
        return self.kind in STOP_KINDS

    @property
    def needs_gate(self) -> bool:
        return self.kind in GATE_KINDS

    def checks_after(self, done: int) -> bool:
        """Whether the rule is checked after ``done`` loops (1-based)."""
        return done >= self.min_loops and (done - self.min_loops) % self.check_every == 0


def kv_slots_per_token(config: LayerShape, loops: int, cache_window: int | None = None) -> int:
    """KV slots (layer applications that keep K and V) per token: DESIGN.md's formula."""
    window = loops if cache_window is None else cache_window
    if window < 1:
        raise ConfigError("cache_window must be >= 1")
    return config.n_prelude + config.n_coda + config.n_core * min(window, loops)



INT4_GROUP_SIZES = (32, 64)
INT4_META_BYTES = 4  # per group: an fp16 scale and an fp16 minimum


@dataclass(frozen=True, slots=True)
class KVMode:
    """One KV cache mode; the flags combine (``h_mode`` + ``int4`` stores h as 4-bit)."""

    int4: bool = False  # 4-bit codes with a per-group fp16 scale and minimum
    h_mode: bool = False  # store the attention input h, recompute K and V when read
    fp16_qkv: bool = False  # h-mode only: h and the recompute projection in 16 bits
    group_size: int = 32  # int4 values per scale (32 or 64; capped to a divisor of the width)

    def __post_init__(self) -> None:
        if self.fp16_qkv and not self.h_mode:
            raise ConfigError("the fp16 qkv recompute (TINYLOOP_H_MODE_FP16_ATTN_QKV) needs "
                              "h-mode (TINYLOOP_KV_H_MODE=1)")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")

    @property
    def name(self) -> str:
        """``full``, ``int4``, ``h-mode``, ``h-mode-fp16-qkv``, ``h-mode+int4``, ...: as reported
        in ``model_info.kv_cache_mode`` (``Settings.kv_cache_mode``)."""
        parts = []
        if self.h_mode:
            parts.append("h-mode-fp16-qkv" if self.fp16_qkv else "h-mode")
        if self.int4:
            parts.append("int4")
        return "+".join(parts) or "full"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, value: KVMode | str | None) -> KVMode:
        """A mode from its name (``"h-mode+int4"``), a mode, or None (full)."""
        if value is None:
            return cls()
        if isinstance(value, KVMode):
            return value
        text = value.strip().lower()
        if text == "full":
            return cls()
        flags = {"int4": False, "h_mode": False, "fp16_qkv": False}
        for part in text.split("+"):
            if part == "int4":
                flags["int4"] = True
            elif part == "h-mode":
                flags["h_mode"] = True
            elif part == "h-mode-fp16-qkv":
                flags["h_mode"] = flags["fp16_qkv"] = True
            else:
                raise ConfigError(f"unknown KV cache mode {value!r}; one of {', '.join(KV_MODES)}")
        return cls(**flags)

    # -- sizes ---------------------------------------------------------------------------------
    def group(self, width: int) -> int:
        """The int4 group for vectors of ``width`` values: ``gcd(group_size, width)``."""
        return gcd(self.group_size, width)

    def slot_bytes(self, config: LayerShape, elem_bytes: int) -> int:
        """Bytes per token and slot (the table above); ``elem_bytes`` of the model dtype."""
        if getattr(config, "architecture", "looped") == "inkling2":  # K, V, their conv inputs, two more
            return (4 * config.kv_heads * config.head_dim + 2 * config.hidden) * elem_bytes
        if self.h_mode:
            width, count = config.hidden, 1
            elem_bytes = 2 if self.fp16_qkv else elem_bytes
        else:
            width, count = config.head_dim, 2 * config.kv_heads
        if self.int4:
            if width % 2:
                raise ConfigError(f"int4 packs two values per byte: width {width} must be even")
            return count * (width // 2 + INT4_META_BYTES * (width // self.group(width)))
        return count * width * elem_bytes

    def bytes_per_token(self, config: LayerShape, loops: int, cache_window: int | None = None,
                        elem_bytes: int = 2) -> int:
        """``slot_bytes * (n_prelude + n_coda + n_core * min(W, loops))``."""
        return self.slot_bytes(config, elem_bytes) * kv_slots_per_token(config, loops, cache_window)


KV_MODES = ("full", "int4", "h-mode", "h-mode+int4", "h-mode-fp16-qkv", "h-mode-fp16-qkv+int4")
