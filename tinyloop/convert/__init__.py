"""``tinyloop convert``: a Hugging Face checkpoint directory -> a ``.tinyloop`` artifact.

The family is detected from ``model_type`` / ``architectures`` (Parcae's config, which has
neither: its ``_class_name``) with ``--family auto``, or named; an unknown family is refused.
Tensors are streamed shard by shard into the artifact (see
``writer.py``): the checkpoint is never held in memory twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tinyloop.convert import huginn, ouro, parcae, retrofit
from tinyloop.convert.hfdir import FileLimits, HFDir
from tinyloop.convert.writer import write_streaming
from tinyloop.errors import ConfigError, TokenizerError
from tinyloop.model.artifact import artifact_metadata
from tinyloop.model.config import ModelConfig, StateInit
from tinyloop.model.presets import state_shapes
from tinyloop.tokenizer import Tokenizer, split_chat_templates

__all__ = ["FAMILIES", "ConvertResult", "FileLimits", "convert", "detect_family"]

FAMILIES = ("huginn", "ouro", "retrofit", "parcae")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    for name, module in (("huginn", huginn), ("ouro", ouro)):
        if model_type in module.MODEL_TYPES or any(a in module.ARCHITECTURES for a in archs if isinstance(a, str)):
            return "retrofit" if name == "huginn" and retrofit.is_retrofit(config) else name
    raise ConfigError(f"config.json: model_type {model_type!r} (architectures {archs!r}) is not a family "
                      f"tinyloop convert knows; supported: huginn ({', '.join(huginn.MODEL_TYPES)}), "
                      f"ouro ({', '.join(ouro.MODEL_TYPES)}), retrofit (huginn_raven with rope_theta), "
                      "parcae (a ParcaeConfig config.json)")


def convert(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str | None = None,
            family: str = "auto", state_init: StateInit | None = None, max_position: int | None = None,
            progress: Callable[[int, int, str], None] | None = None,
            limits: FileLimits | None = None) -> ConvertResult:
    """Convert ``hf_dir`` to the artifact ``out``; ``dtype`` defaults to the checkpoint's,
    ``state_init`` (the loop's initial state: ``randn`` or ``zeros``) to the family's (Huginn and
    retrofit: randn; Parcae: its config's ``state_init``; Ouro starts from the embeddings).
    ``limits``: the most bytes each JSON file of ``hf_dir`` may hold (``hfdir.FileLimits``)."""
    if family != "auto" and family not in FAMILIES:
        raise ConfigError(f"family must be auto or one of {', '.join(FAMILIES)}; got {family!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    with HFDir(Path(hf_dir), limits or FileLimits()) as hf:
        detected = detect_family(hf.config)
        if family not in ("auto", detected):
            raise ConfigError(f"{hf.root}: is a {detected} checkpoint, not {family}")
        if detected == "ouro":  # the loop starts from the embeddings: state_init does not apply
            config = ouro.ouro_config(hf.config, max_position=max_position)
            plan_of, specials_of, embed = ouro.ouro_plan, ouro.ouro_special_tokens, ouro.EMBED
        elif detected == "retrofit":
            config = retrofit.retrofit_config(hf.config, hf.tensors, state_init=state_init or "randn",
                                              max_position=max_position)
            plan_of, specials_of, embed = retrofit.retrofit_plan, retrofit.retrofit_special_tokens, retrofit.EMBED
        elif detected == "parcae":
            config = parcae.parcae_config(hf.config, parcae.parcae_value_embeds(hf.config, set(hf.tensors)),
                                          state_init=state_init, max_position=max_position)
            plan_of, specials_of, embed = parcae.parcae_plan, parcae.parcae_special_tokens, parcae.EMBED
        else:
            config = huginn.huginn_config(hf.config, state_init=state_init or "randn", max_position=max_position)
            plan_of, specials_of, embed = huginn.huginn_plan, huginn.huginn_special_tokens, "transformer.wte.weight"
        plan = plan_of(hf, config, state_shapes(config))  # every tensor checked against the file: nothing built
        try:
            probe = Tokenizer.from_json(hf.tokenizer_json, eos_id=0)
        except TokenizerError as exc:
            raise TokenizerError(f"{hf.root / 'tokenizer.json'}: {exc}; TinyLoop serves byte-level BPE "
                                 "tokenizers only (convert the tokenizer first)") from exc
        special = specials_of(hf, probe.token_to_id)
        tokenizer = Tokenizer.from_json(hf.tokenizer_json, bos_id=special["bos_id"], eos_id=special["eos_id"],
                                        eos_ids=special["eos_ids"])
        try:  # a string, or HF's list of named templates (the default one, tool_use, ...)
            template, tokenizer.chat_templates = split_chat_templates(hf.tokenizer_config.get("chat_template"))
        except TokenizerError as exc:
            raise ConfigError(f"{hf.root / 'tokenizer_config.json'}: {exc}") from None
        target = DTYPES[dtype] if dtype else _checkpoint_dtype(hf, embed)
        out_path = Path(out)
        metadata = artifact_metadata(out_path, config, tokenizer, template, special,
                                     {"tinyloop.converted_from": detected})
        write_streaming(out_path, plan, target, metadata, progress)
    return ConvertResult(out_path, detected, config, len(plan), str(target).removeprefix("torch."))


def _checkpoint_dtype(hf: HFDir, embed: str) -> torch.dtype:
    tag = hf.tensors[embed].dtype if embed in hf.tensors else "F32"
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(tag, torch.float32)
