"""``tinyloop convert``: a Hugging Face checkpoint directory -> a ``.tinyloop`` artifact.

The family is detected from ``model_type`` / ``architectures`` (Parcae's config, which has
neither: its ``_class_name``) with ``--family auto``, or named; an unknown family is refused.
Huginn, Ouro, retrofit and Parcae become a ``LoopedLM``; Inkling-2 loop (``inkling2``) its own
``Inkling2LM``, whose config the artifact carries beside the ``ModelConfig`` the engine reads
(``tinyloop.arch_config``).
Tensors are streamed shard by shard into the artifact (see
``writer.py``): the checkpoint is never held in memory twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinyloop.convert import huginn, inkling2, ouro, parcae, retrofit
from tinyloop.convert.hfdir import FileLimits, HFDir
from tinyloop.convert.writer import PlannedTensor, write_streaming
from tinyloop.errors import ConfigError, TokenizerError
from tinyloop.model.artifact import KEY_ARCH_CONFIG, artifact_metadata
from tinyloop.model.config import ModelConfig, StateInit
from tinyloop.model.presets import state_shapes
from tinyloop.tokenizer import Tokenizer, split_chat_templates

__all__ = ["FAMILIES", "ConvertResult", "FileLimits", "convert", "detect_family"]

FAMILIES = ("huginn", "ouro", "retrofit", "parcae", "inkling2")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a family's reader of bos, eos, pad and the stop set, given the tokenizer's vocabulary
SpecialTokens = Callable[[HFDir, Callable[[str], int | None]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ConvertResult:
    path: Path
    family: str
    config: ModelConfig
    tensors: int
    dtype: str


def detect_family(config: dict[str, Any]) -> str:
    """The converter family of a ``config.json``; ``ConfigError`` for one TinyLoop cannot convert."""
    if parcae.is_parcae(config):
        return "parcae"
    if inkling2.is_inkling2(config):
        return "inkling2"
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    for name, module in (("huginn", huginn), ("ouro", ouro)):
        if model_type in module.MODEL_TYPES or any(a in module.ARCHITECTURES for a in archs if isinstance(a, str)):
            return "retrofit" if name == "huginn" and retrofit.is_retrofit(config) else name
    raise ConfigError(f"config.json: model_type {model_type!r} (architectures {archs!r}) is not a family "
                      f"tinyloop convert knows; supported: huginn ({', '.join(huginn.MODEL_TYPES)}), "
                      f"ouro ({', '.join(ouro.MODEL_TYPES)}), retrofit (huginn_raven with rope_theta), "
                      "parcae (a ParcaeConfig config.json), inkling2 "
                      f"({', '.join(inkling2.MODEL_TYPES)})")


def convert(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str | None = None,
            family: str = "auto", state_init: StateInit | None = None, max_position: int | None = None,
            progress: Callable[[int, int, str], None] | None = None,
            limits: FileLimits | None = None) -> ConvertResult:
    """Convert ``hf_dir`` to the artifact ``out``; ``dtype`` defaults to the checkpoint's,
    ``state_init`` (the loop's initial state: ``randn`` or ``zeros``) to the family's (Huginn and
    retrofit: randn; Parcae: its config's ``state_init``; Ouro starts from the embeddings; Inkling-2
    has no loop state: its passes restart from the prelude's output, and ``state_init`` is refused).
    ``limits``: the most bytes each JSON file of ``hf_dir`` may hold (``hfdir.FileLimits``)."""
    if family != "auto" and family not in FAMILIES:
        raise ConfigError(f"family must be auto or one of {', '.join(FAMILIES)}; got {family!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    with HFDir(Path(hf_dir), limits or FileLimits()) as hf:
        detected = detect_family(hf.config)
        if family not in ("auto", detected):
            raise ConfigError(f"{hf.root}: is a {detected} checkpoint, not {family}")
        mapped = (_inkling2(hf, state_init, max_position) if detected == "inkling2"
                  else _looped(hf, detected, state_init, max_position))
        plan, config = mapped.plan, mapped.config
        try:
            probe = Tokenizer.from_json(hf.tokenizer_json, eos_id=0)
        except TokenizerError as exc:
            raise TokenizerError(f"{hf.root / 'tokenizer.json'}: {exc}; TinyLoop serves byte-level BPE "
                                 "tokenizers only (convert the tokenizer first)") from exc
        special = mapped.special_tokens(hf, probe.token_to_id)
        tokenizer = Tokenizer.from_json(hf.tokenizer_json, bos_id=special["bos_id"], eos_id=special["eos_id"],
                                        eos_ids=special["eos_ids"])
        try:  # a string, or HF's list of named templates (the default one, tool_use, ...)
            template, tokenizer.chat_templates = split_chat_templates(hf.tokenizer_config.get("chat_template"))
        except TokenizerError as exc:
            raise ConfigError(f"{hf.root / 'tokenizer_config.json'}: {exc}") from None
        target = DTYPES[dtype] if dtype else _checkpoint_dtype(hf, mapped.embed)
        out_path = Path(out)
        metadata = artifact_metadata(out_path, config, tokenizer, template, special,
                                     {"tinyloop.converted_from": detected, **mapped.metadata})
        write_streaming(out_path, plan, target, metadata, progress)
    return ConvertResult(out_path, detected, config, len(plan), str(target).removeprefix("torch."))


@dataclass(frozen=True, slots=True)
class _Mapped:
    """A checkpoint mapped by its family: the config the engine reads, the tensors to write, how
    its special tokens are read, its embedding's name (whose dtype is the default) and the
    family's own metadata entries."""

    config: ModelConfig
    plan: list[PlannedTensor]
    special_tokens: SpecialTokens
    embed: str
    metadata: dict[str, str]


def _looped(hf: HFDir, family: str, state_init: StateInit | None, max_position: int | None) -> _Mapped:
    """A family served by ``LoopedLM``: every tensor checked against the file, nothing built."""
    plan_of: Callable[[HFDir, ModelConfig, dict[str, tuple[int, ...]]], list[PlannedTensor]]
    specials_of: SpecialTokens
    if family == "ouro":  # the loop starts from the embeddings: state_init does not apply
        config = ouro.ouro_config(hf.config, max_position=max_position)
        plan_of, specials_of, embed = ouro.ouro_plan, ouro.ouro_special_tokens, ouro.EMBED
    elif family == "retrofit":
        config = retrofit.retrofit_config(hf.config, hf.tensors, state_init=state_init or "randn",
                                          max_position=max_position)
        plan_of, specials_of, embed = retrofit.retrofit_plan, retrofit.retrofit_special_tokens, retrofit.EMBED
    elif family == "parcae":
        config = parcae.parcae_config(hf.config, parcae.parcae_value_embeds(hf.config, set(hf.tensors)),
                                      state_init=state_init, max_position=max_position)
        plan_of, specials_of, embed = parcae.parcae_plan, parcae.parcae_special_tokens, parcae.EMBED
    else:
        config = huginn.huginn_config(hf.config, state_init=state_init or "randn", max_position=max_position)
        plan_of, specials_of, embed = huginn.huginn_plan, huginn.huginn_special_tokens, "transformer.wte.weight"
    return _Mapped(config, plan_of(hf, config, state_shapes(config)), specials_of, embed, {})


def _inkling2(hf: HFDir, state_init: StateInit | None, max_position: int | None) -> _Mapped:
    """Inkling-2 loop, served by ``Inkling2LM``: its own config travels as ``tinyloop.arch_config``."""
    if state_init is not None:
        raise ConfigError(f"state_init {state_init!r} does not apply to an inkling2 checkpoint: its passes "
                          "restart from the prelude's output, there is no initial loop state")
    arch = inkling2.inkling2_config(hf.config, max_position=max_position)
    return _Mapped(arch.model_config(), inkling2.inkling2_plan(hf, arch), inkling2.inkling2_special_tokens,
                   inkling2.EMBED, {KEY_ARCH_CONFIG: json.dumps(arch.to_hf())})


def _checkpoint_dtype(hf: HFDir, embed: str) -> torch.dtype:
    tag = hf.tensors[embed].dtype if embed in hf.tensors else "F32"
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(tag, torch.float32)
