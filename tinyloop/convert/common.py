"""What every checkpoint family's mapping shares: config integers and floats, shape and name
checks, and the special tokens read from ``tokenizer_config.json`` / ``generation_config.json``.

``config_int`` and ``config_float`` check a ``config.json`` value against the ``ModelConfig``
field it becomes (``SIZE_LIMITS``; finite floats), so a refusal names the key the file holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch

from tinyloop.convert.hfdir import HFDir
from tinyloop.errors import ArtifactError, ConfigError
from tinyloop.model.artifact import some_names
from tinyloop.model.config import SIZE_LIMITS

__all__ = ["check_names", "check_shape", "check_tied_head", "config_float", "config_int", "config_section",
           "special_tokens"]


def config_int(cfg: dict[str, Any], *keys: str, field: str, default: int | None = None) -> int:
    """The first of ``keys`` that ``config.json`` holds (absent or null: the next, then
    ``default``), an integer in the range of the ``ModelConfig`` field ``field`` it becomes."""
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.json: {key} must be an integer, got {value!r}")
        low, high = SIZE_LIMITS[field]
        if not low <= value <= high:
            bound = f"at least {low}" if value < low else f"at most {high}"
            raise ConfigError(f"config.json: {key} is {value}; TinyLoop needs {bound} (its {field})")
        return value
    if default is not None:
        return default
    raise ConfigError(f"config.json: needs an integer {' or '.join(keys)}")


def config_float(cfg: dict[str, Any], key: str, default: float, *, where: str = "") -> float:
    """``config.json``'s number ``key`` (``where``: the object it sits in, as ``init_values.``),
    finite and > 0, else ``default`` when absent or null. JSON's ``NaN`` and ``Infinity``, which
    Python's parser accepts, are refused here by the key's name."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config.json: {where}{key} must be a finite number > 0, got {value!r}")
    return float(value)


def config_section(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """``config.json``'s object ``key`` (absent or null: empty)."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config.json: {key} must be an object, got {value!r}")
    return value


def check_shape(name: str, found: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if found != expected:
        raise ArtifactError(f"checkpoint tensor {name} has shape {list(found)}, expected {list(expected)}")


def check_names(hf: HFDir, used: Iterable[str], dropped: Collection[str], family: str) -> None:
    """Refuse, by name, a checkpoint tensor the mapping does not use or drop, and a missing one."""
    used = set(used)
    unknown = sorted(set(hf.tensors) - used - set(dropped))
    if unknown:
        raise ArtifactError(f"checkpoint has tensor(s) the {family} converter does not know: {some_names(unknown)}")
    missing = sorted(used - set(hf.tensors))
    if missing:
        raise ArtifactError(f"checkpoint is missing tensor(s): {some_names(missing)}")


def check_tied_head(hf: HFDir, head: str, embed: str, why: str, rows: int = 4096) -> None:
    """A stored ``head`` must equal ``embed`` (compared a block of rows at a time); absent is fine."""
    if head not in hf.tensors:
        return
    check_shape(head, hf.tensors[head].shape, hf.tensors[embed].shape)
    for block, emb in zip(hf.row_chunks(head, rows), hf.row_chunks(embed, rows)):
        if not torch.equal(block, emb):
            raise ArtifactError(f"checkpoint tensor {head} differs from {embed}; {why}")


def special_tokens(hf: HFDir, vocab_ids: Callable[[str], int | None], *stops: str) -> dict[str, Any]:
    """bos, eos, pad and the stop set: bos, eos, generation_config's eos ids and the tokens
    ``stops`` names that the vocabulary has."""
    def named(key: str) -> int | None:
        token = hf.tokenizer_config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return vocab_ids(token) if isinstance(token, str) else None

    gen = hf.generation_config
    bos = named("bos_token")
    bos = bos if bos is not None else gen.get("bos_token_id")
    eos = named("eos_token")
    gen_eos = gen.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    if eos is None:
        eos = gen_eos[0] if gen_eos else None
    if eos is None or bos is None:
        raise ConfigError("tokenizer_config.json / generation_config.json: need a bos and an eos token")
    pad = named("pad_token")
    pad = pad if pad is not None else gen.get("pad_token_id")
    extra = [i for i in map(vocab_ids, stops) if i is not None]
    return {"bos_id": bos, "eos_id": eos, "eos_ids": sorted({bos, eos, *gen_eos, *extra}), "pad_id": pad}
