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

__all__ = ["ExitKind", "ExitRule", "INT4_GROUP_SIZES", "KVMode", "KV_MODES", "LayerShape",
           "kv_slots_per_token"]

ExitKind = Literal["none", "gate", "latent_diff", "kl", "gate_select"]


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
    """When a token may stop looping early.

    ``gate``: Ouro's rule, exit at the first loop whose cumulative exit probability reaches
    ``threshold``. ``gate_select``: the same rule as the Ouro reference (HF) applies it: every
    loop runs and writes KV, and per position (prompt positions included) the state of the loop
    the rule picks feeds the head (the last loop when none reaches ``threshold``).
    ``latent_diff``: exit when ``||s_r - s_{r-1}|| / ||s_r|| < threshold``.
    ``kl``: exit when KL(p_r || p_{r-1}) of successive output distributions < threshold.
    Never before ``min_loops``.
    """

    kind: ExitKind = "none"
    threshold: float = 0.0
    min_loops: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("none", "gate", "latent_diff", "kl", "gate_select"):
            raise ConfigError("exit.kind must be one of none, gate, latent_diff, kl, gate_select; "
                              f"got {self.kind!r}")
        if self.kind != "none" and not self.threshold > 0:
            raise ConfigError(f"exit.threshold must be > 0 for exit.kind={self.kind!r}")
        if self.kind in ("gate", "gate_select") and self.threshold > 1:
            raise ConfigError("exit.threshold must be in (0, 1] for the gate rule")
        if self.min_loops < 1:
            raise ConfigError("exit.min_loops must be >= 1")



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
