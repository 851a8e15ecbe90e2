"""Inkling-2 loop (``model_type`` ``inkling2_loop``, ``Inkling2LoopForConditionalGeneration``) onto
``Inkling2LM``'s canonical names.

The text model, its config and the mapping of every tensor are ``tinyloop.model.inkling2``'s
(``Inkling2Config.from_hf``, ``inkling2_tensor_map``); this module reads a hub directory with them:
shards through ``HFDir``, one tensor at a time, the vision tower (``model.visual.*``, or a name
with a ``vision*`` part) dropped by name, every other unknown or missing tensor refused by name.

Routed experts (``model.llm.layers.{i}.mlp.experts.w13_weight`` / ``w2_weight``) come plain or
block-scaled; the companions a weight has say which (``microscale.py`` has the layouts):

- none: plain floats ``[E, rows, columns]``;
- ``_scale``: MXFP8 (``float8_e4m3fn`` values, an E8M0 ``uint8`` scale per 32);
- ``_scale``, ``_amax`` and ``_outer_scale_denominator``: NVFP4 (packed E2M1 codes, an E4M3
  scale per 16, a per-expert factor);

anything in between is refused naming what is missing. A quantised weight is dequantised to
float32 and then goes through the map's transform like a plain one (``w13`` is gate/up
interleaved by rows after dequantisation, as transformers' ``Inkling2LoopDequantizeExperts``
then ``Interleave`` read it). Each expert's tensors are read (and dequantised) from its own slice
of the stacked ones, so a conversion holds one expert's weights at a time.

Inkling-2 has no bos token (``bos_token`` null): the artifact stores ``bos_id`` null, which the
tokenizer reads as "bos is eos" and nothing prepends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from tinyloop.convert.common import check_names, check_shape
from tinyloop.convert.hfdir import HFDir, TensorInfo
from tinyloop.convert.microscale import MXFP8_BLOCK, NVFP4_BLOCK, dequantize_mxfp8, dequantize_nvfp4
from tinyloop.convert.writer import PlannedTensor
from tinyloop.errors import ArtifactError, ConfigError
from tinyloop.model.inkling2 import Inkling2Config, Inkling2LM, Transform, inkling2_tensor_map

__all__ = ["ARCHITECTURES", "EMBED", "MODEL_TYPES", "inkling2_config", "inkling2_plan", "inkling2_special_tokens",
           "is_inkling2"]

MODEL_TYPES = ("inkling2_loop",)
ARCHITECTURES = ("Inkling2LoopForConditionalGeneration",)
EMBED = "model.llm.embed.weight"
_EXPERT_WEIGHTS = (".mlp.experts.w13_weight", ".mlp.experts.w2_weight")
_NVFP4 = ("_scale", "_amax", "_outer_scale_denominator")  # a weight's companions, in dequantize_nvfp4's order
_FLOATS = ("F32", "BF16", "F16", "F64")  # what a plain tensor may be stored as

Format = Literal["plain", "mxfp8", "nvfp4"]
_COMPANIONS: dict[Format, tuple[str, ...]] = {"plain": (), "mxfp8": ("_scale",), "nvfp4": _NVFP4}


def is_inkling2(cfg: dict[str, Any]) -> bool:
    """An Inkling-2 loop ``config.json``: its ``model_type`` or its architecture's name."""
    archs = cfg.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    return cfg.get("model_type") in MODEL_TYPES or any(a in ARCHITECTURES for a in archs if isinstance(a, str))


def inkling2_config(cfg: dict[str, Any], *, max_position: int | None = None) -> Inkling2Config:
    """The text model's config (``ConfigError`` naming the field); ``max_position`` overrides
    ``max_position_embeddings`` within the bounds of the ``ModelConfig`` the engine reads."""
    config = Inkling2Config.from_hf(cfg)
    if max_position is not None:
        config = dataclasses.replace(config, max_position=max_position)
        config.model_config()  # refuses a max_position out of bounds, by name
    return config


def _is_vision(name: str) -> bool:
    return name.startswith("model.visual.") or any(part.startswith("vision") for part in name.split("."))


def _expert_format(hf: HFDir, weight: str) -> Format:
    """Which format the companions stored beside ``weight`` say it is in."""
    present = tuple(suffix for suffix in _NVFP4 if weight + suffix in hf.tensors)
    for fmt, companions in _COMPANIONS.items():
        if present == companions:
            return fmt
    missing = [weight + suffix for suffix in _NVFP4 if suffix not in present]
    raise ArtifactError(f"checkpoint has {', '.join(weight + s for s in present)} but not {', '.join(missing)}: "
                        f"an expert weight is plain, MXFP8 (with {weight}_scale) or NVFP4 (with {weight}_scale, "
                        "_amax and _outer_scale_denominator)")


def _expect(info: TensorInfo, dtypes: Collection[str], shape: tuple[int, ...], why: str = "") -> None:
    if info.dtype not in dtypes:
        raise ArtifactError(f"checkpoint tensor {info.name} has dtype {info.dtype}, expected "
                            f"{' or '.join(dtypes)}{why}")
    check_shape(info.name, info.shape, shape)


def _check_source(hf: HFDir, name: str, shape: tuple[int, ...], fmt: Format) -> None:
    """Dtype and shape of ``name`` and its companions, from the header (``shape``: dequantised)."""
    info = hf.tensors[name]
    if fmt == "plain":
        hint = f" (a quantised expert weight needs its {name}_scale)" if name.endswith(_EXPERT_WEIGHTS) else ""
        _expect(info, _FLOATS, shape, hint)
        return
    experts, rows, columns = shape
    block = NVFP4_BLOCK if fmt == "nvfp4" else MXFP8_BLOCK
    if columns % block:
        raise ArtifactError(f"checkpoint tensor {name} is stored {fmt.upper()}, but its {columns} columns are not "
                            f"a multiple of the format's {block}-value blocks")
    scale = hf.tensors[name + "_scale"]
    if fmt == "mxfp8":
        _expect(info, ("F8_E4M3",), shape)
        _expect(scale, ("U8",), (experts, rows, columns // block))
        return
    _expect(info, ("U8",), (experts, rows, columns // 2))
    _expect(scale, ("F8_E4M3",), (experts, rows, columns // block))
    for suffix in _NVFP4[1:]:  # one factor per expert (or one for all), however it is shaped
        factor = hf.tensors[name + suffix]
        if factor.dtype not in _FLOATS or torch.Size(factor.shape).numel() not in (1, experts):
            raise ArtifactError(f"checkpoint tensor {factor.name} has dtype {factor.dtype} and shape "
                                f"{list(factor.shape)}; expected one float per expert ({experts})")


@dataclass
class _Reader:
    """Produces each checkpoint tensor, dequantised to float32 when stored quantised; an expert's
    canonical tensor from that expert's slice of the stacked ones (and its companions') alone."""

    hf: HFDir
    formats: dict[str, Format]

    def produce(self, name: str, transform: Transform) -> torch.Tensor:
        if transform.expert is None:
            return transform(self._read(name, None))
        return transform.expert_slice(self._read(name, transform.expert)[0])

    def _read(self, name: str, expert: int | None) -> torch.Tensor:
        """Tensor ``name``, or expert ``expert``'s slice of it ``[1, ...]``, in float32 when quantised."""
        def fetch(key: str) -> torch.Tensor:
            if expert is None:
                return self.hf.tensor(key)
            stacked = self.hf.tensors[key].shape[:1] not in ((), (1,))  # (a factor may be one value for all)
            return self.hf.rows(key, expert, expert + 1) if stacked else self.hf.tensor(key)

        fmt = self.formats.get(name, "plain")
        if fmt == "nvfp4":
            codes, scale, amax, denominator = (fetch(name + suffix) for suffix in ("", *_NVFP4))
            return dequantize_nvfp4(name, codes, scale, amax, denominator, torch.float32)
        if fmt == "mxfp8":
            return dequantize_mxfp8(name, fetch(name), fetch(name + "_scale"), torch.float32)
        return fetch(name)


def inkling2_plan(hf: HFDir, config: Inkling2Config) -> list[PlannedTensor]:
    """Every tensor of ``Inkling2LM(config).state_dict()`` with its source; refuses a missing,
    unknown, misshapen or mistyped tensor (a quantised expert's companions included) by name."""
    with torch.device("meta"):  # names and shapes only: nothing is allocated
        expected = {name: tuple(t.shape) for name, t in Inkling2LM(config).state_dict().items()}
    sources = inkling2_tensor_map(config)
    if set(sources) != set(expected):  # a mapping bug, not the checkpoint's fault
        raise AssertionError(f"Inkling-2 map and model disagree: {sorted(set(sources) ^ set(expected))}")
    formats = {name: _expert_format(hf, name) for name, _ in sources.values() if name.endswith(_EXPERT_WEIGHTS)}
    used = {name for name, _ in sources.values()}
    used |= {name + suffix for name, fmt in formats.items() for suffix in _COMPANIONS[fmt]}
    check_names(hf, used, [name for name in hf.tensors if name not in used and _is_vision(name)], "Inkling-2")
    for name, transform in dict(sources.values()).items():
        _check_source(hf, name, transform.source_shape, formats.get(name, "plain"))
    reader = _Reader(hf, formats)
    return [PlannedTensor(canon, shape, partial(reader.produce, *sources[canon])) for canon, shape in expected.items()]


def _generation_ids(hf: HFDir, key: str) -> list[int]:
    """``generation_config.json``'s ``key``: an id or a list of ids (absent or null: none)."""
    value = hf.generation_config.get(key)
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"generation_config.json: {key} must be a token id or a list of them, got {value!r}")
    return ids


def inkling2_special_tokens(hf: HFDir, vocab_ids: Callable[[str], int | None]) -> dict[str, Any]:
    """eos (``tokenizer_config.json``'s ``<|im_end|>``, else generation_config's first), pad, the
    stop set (eos and generation_config's eos ids: {258, 256} in the fixture) and bos, which
    Inkling-2 does not have (``bos_token`` null): then ``bos_id`` is None, not made up."""
    def named(key: str) -> int | None:
        token = hf.tokenizer_config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return vocab_ids(token) if isinstance(token, str) else None

    gen_eos = _generation_ids(hf, "eos_token_id")
    eos = named("eos_token")
    if eos is None:
        eos = gen_eos[0] if gen_eos else None
    if eos is None:
        raise ConfigError("tokenizer_config.json / generation_config.json: need an eos token")
    bos = named("bos_token")
    bos = bos if bos is not None else next(iter(_generation_ids(hf, "bos_token_id")), None)
    pad = named("pad_token")
    pad = pad if pad is not None else next(iter(_generation_ids(hf, "pad_token_id")), None)
    stops = {eos, *gen_eos, *([] if bos is None else [bos])}
    return {"bos_id": bos, "eos_id": eos, "eos_ids": sorted(stops), "pad_id": pad}
