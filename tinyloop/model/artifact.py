"""The ``.tinyloop`` artifact: one safetensors file holding weights, config and tokenizer.

Tensors carry the canonical ``LoopedLM.state_dict()`` names; the safetensors metadata (all
strings) carries::

    tinyloop.format_version   "1"
    tinyloop.config           ModelConfig JSON
    tinyloop.tokenizer        HF tokenizer JSON
    tinyloop.chat_template    Jinja source ("" when none)
    tinyloop.chat_templates   {name: Jinja source} JSON of the other named templates (optional;
                              ``tool_use``, ...: HF's list form of ``chat_template``)
    tinyloop.special_tokens   {"bos_id", "eos_id", "eos_ids", "pad_id"} JSON (``bos_id`` may be
                              null: a model without one, as Inkling-2)
    tinyloop.arch_config      the model's own config, for an architecture other than ``looped``
                              (``inkling2``: ``Inkling2Config.to_hf()`` JSON; the tensors are then
                              ``Inkling2LM.state_dict()``'s and ``tinyloop.config`` is the
                              ``ModelConfig`` it gives, by which the engine sizes KV and checks
                              requests)

Everything is checked against the header before a tensor is read, and every failure is an
``ArtifactError`` naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tinyloop.errors import ArtifactError, ConfigError, TinyLoopError
from tinyloop.model.config import ModelConfig
from tinyloop.model.inkling2 import Inkling2Config, Inkling2LM
from tinyloop.model.looped import LoopedLM
from tinyloop.model.presets import empty_model, state_shapes
from tinyloop.tokenizer import MAX_NAMED_TEMPLATES, Tokenizer

__all__ = ["FORMAT_VERSION", "KEY_ARCH_CONFIG", "MAX_HEADER_BYTES", "Artifact", "artifact_metadata", "save_artifact",
           "load_artifact", "inspect_artifact", "read_config", "some_names"]

FORMAT_VERSION = 1

KEY_VERSION = "tinyloop.format_version"
KEY_CONFIG = "tinyloop.config"
KEY_TOKENIZER = "tinyloop.tokenizer"
KEY_CHAT_TEMPLATE = "tinyloop.chat_template"
KEY_CHAT_TEMPLATES = "tinyloop.chat_templates"  # optional: written only when the tokenizer has named ones
KEY_SPECIAL = "tinyloop.special_tokens"
KEY_ARCH_CONFIG = "tinyloop.arch_config"  # only for an architecture other than looped (written by its converter)
REQUIRED_KEYS = (KEY_VERSION, KEY_CONFIG, KEY_TOKENIZER, KEY_CHAT_TEMPLATE, KEY_SPECIAL)

# safetensors dtype tags -> torch dtypes (the floating types a model may be stored in).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit: a longer header does not load


@dataclass(frozen=True)
class Artifact:
    """A loaded artifact: the model in eval mode without grads, its tokenizer and metadata."""

    path: Path
    config: ModelConfig
    model: LoopedLM | Inkling2LM  # by ``config.architecture``
    tokenizer: Tokenizer
    chat_template: str
    metadata: dict[str, str]

    @property
    def special_tokens(self) -> dict[str, Any]:
        """``bos_id``, ``eos_id``, ``eos_ids`` and ``pad_id`` as written at save time."""
        return dict(json.loads(self.metadata[KEY_SPECIAL]))


# -- save ------------------------------------------------------------------------------------


def _special_tokens(tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "eos_ids": sorted(tokenizer.eos_ids),
        "pad_id": getattr(tokenizer, "pad_id", None),
    }


def save_artifact(path: str | os.PathLike[str], model: LoopedLM | Inkling2LM, tokenizer: Tokenizer, *,
                  chat_template: str | None = None,
                  extra_metadata: Mapping[str, str] | None = None) -> None:
    """Write ``model`` and ``tokenizer`` to ``path`` atomically (temp file + ``os.replace``).

    ``chat_template`` defaults to the tokenizer's ("" stores none: loading then falls back to
    the tokenizer's default). ``extra_metadata`` adds string entries; it may not override the
    keys this module owns (``tinyloop.arch_config`` included: an ``Inkling2LM``'s is its config).
    """
    path = Path(path)
    template = tokenizer.chat_template if chat_template is None else chat_template
    extra = dict(extra_metadata or {})
    if KEY_ARCH_CONFIG in extra:
        raise ArtifactError(f"{path}: extra metadata may not override {KEY_ARCH_CONFIG!r}")
    if isinstance(model, Inkling2LM):  # its own config beside the ModelConfig it gives
        extra[KEY_ARCH_CONFIG] = json.dumps(model.arch.to_hf())
    metadata = artifact_metadata(path, model.config, tokenizer, template or "", _special_tokens(tokenizer), extra)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")  # same dir: atomic
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; an artifact is shareable data
        os.replace(tmp, path)
    except Exception as exc:  # OSError, or safetensors' own error type for an unwritable path
        raise ArtifactError(f"{path}: cannot write artifact: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def artifact_metadata(path: Path, config: ModelConfig, tokenizer: Tokenizer, chat_template: str,
                      special: Mapping[str, Any], extra_metadata: Mapping[str, str] | None = None) -> dict[str, str]:
    """The safetensors metadata of an artifact (``extra_metadata`` may not override our keys);
    the tokenizer's named ``chat_templates`` are stored beside ``chat_template``, the default."""
    metadata = {
        KEY_VERSION: str(FORMAT_VERSION),
        KEY_CONFIG: config.to_json(),
        KEY_TOKENIZER: tokenizer.to_json(),
        KEY_CHAT_TEMPLATE: chat_template,
        KEY_SPECIAL: json.dumps(dict(special)),
    }
    if tokenizer.chat_templates:
        metadata[KEY_CHAT_TEMPLATES] = json.dumps(tokenizer.chat_templates)
    for key, value in (extra_metadata or {}).items():
        if key in metadata or key == KEY_CHAT_TEMPLATES:  # ours even when this artifact has none
            raise ArtifactError(f"{path}: extra metadata may not override {key!r}")
        if not isinstance(key, str) or not isinstance(value, str):
            raise ArtifactError(f"{path}: metadata entries must be str -> str, got {key!r}")
        metadata[key] = value
    return metadata


def _umask() -> int:
    """The process umask, read without changing it where /proc allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere the only portable read is set-and-restore
    os.umask(mask)
    return mask


# -- header ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Header:
    metadata: dict[str, str]
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}
    file_size: int


def _read_header(path: Path) -> _Header:
    """Parse the safetensors header and check the file is as long as the header says."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ArtifactError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise ArtifactError(f"{path}: not a safetensors file, or truncated "
                                    f"(header length {n}, file size {size})")
            raw = f.read(n)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such artifact file") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a directory, not an artifact file") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read artifact: {exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ArtifactError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(_well_formed(t) for t in header.values()):
        raise ArtifactError(f"{path}: not a safetensors file (malformed header entries)")
    data_end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + data_end > size:
        raise ArtifactError(f"{path}: truncated: the header describes {8 + n + data_end} bytes "
                            f"but the file has {size}")
    return _Header(metadata=dict(metadata), tensors=header, file_size=size)


def _well_formed(entry: Any) -> bool:
    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, int) and v >= 0 for v in value)

    return (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and ints(entry.get("shape"))
            and ints(entry.get("data_offsets")) and len(entry["data_offsets"]) == 2)


def _metadata_value(path: Path, header: _Header, key: str) -> str:
    try:
        return header.metadata[key]
    except KeyError:
        raise ArtifactError(f"{path}: metadata is missing {key!r}") from None


def _check_version(path: Path, header: _Header) -> None:
    found = _metadata_value(path, header, KEY_VERSION)
    if found != str(FORMAT_VERSION):
        raise ArtifactError(f"{path}: format version {found!r} is not supported "
                            f"(this TinyLoop reads version {FORMAT_VERSION})")


def _config(path: Path, header: _Header) -> ModelConfig:
    try:
        return ModelConfig.from_json(_metadata_value(path, header, KEY_CONFIG))
    except ConfigError as exc:
        raise ArtifactError(f"{path}: invalid {KEY_CONFIG}: {exc}") from exc


def _tokenizer(path: Path, header: _Header, config: ModelConfig, special: dict[str, Any]) -> Tokenizer:
    text = _metadata_value(path, header, KEY_TOKENIZER)
    try:
        tokenizer = Tokenizer.from_json(text, bos_id=special["bos_id"], eos_id=special["eos_id"],
                                        eos_ids=special["eos_ids"])
    except Exception as exc:  # tokenizers raises bare Exception subclasses for bad JSON
        raise ArtifactError(f"{path}: invalid {KEY_TOKENIZER}: {exc}") from exc
    if tokenizer.vocab_size > config.vocab_size:
        raise ArtifactError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model "
                            f"config has vocab_size {config.vocab_size}")
    return tokenizer


def _special(path: Path, header: _Header, config: ModelConfig) -> dict[str, Any]:
    try:
        special = json.loads(_metadata_value(path, header, KEY_SPECIAL))
        ids = [special["bos_id"], special["eos_id"], special["pad_id"], *special["eos_ids"]]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{path}: invalid {KEY_SPECIAL}: {exc!r}") from None
    for token in ids:
        if token is not None and not (isinstance(token, int) and 0 <= token < config.vocab_size):
            raise ArtifactError(f"{path}: {KEY_SPECIAL} has token id {token!r} outside the "
                                f"vocabulary (vocab_size {config.vocab_size})")
    return dict(special)


def some_names(names: list[str], first: int = 10) -> str:
    """``names`` for an error message: the first ``first`` of them, and how many in all."""
    shown = ", ".join(names[:first])
    return shown if len(names) <= first else f"{shown}, ... ({len(names)} in all)"


def _check_tensors(path: Path, header: _Header, expected: dict[str, tuple[int, ...]]) -> None:
    """The header's tensors are exactly the model's (``expected``: its names and shapes): names,
    shapes, floating dtypes, and each one's bytes in the file what its shape and dtype take
    (worked out from the config alone: nothing is allocated before the file is known to hold
    the model)."""
    missing = [name for name in expected if name not in header.tensors]
    if missing:
        raise ArtifactError(f"{path}: missing tensor(s): {some_names(missing)}")
    unexpected = sorted(set(header.tensors) - set(expected))
    if unexpected:
        raise ArtifactError(f"{path}: unexpected tensor(s): {some_names(unexpected)}")
    for name, shape in expected.items():
        entry = header.tensors[name]
        found = tuple(entry["shape"])
        if found != shape:
            raise ArtifactError(f"{path}: tensor {name} has shape {list(found)}, "
                                f"expected {list(shape)}")
        if entry["dtype"] not in _DTYPES:
            raise ArtifactError(f"{path}: tensor {name} has dtype {entry['dtype']}, "
                                f"expected one of {', '.join(_DTYPES)}")
        start, end = entry["data_offsets"]
        if end - start != math.prod(shape) * _DTYPES[entry["dtype"]].itemsize:
            raise ArtifactError(f"{path}: tensor {name} takes bytes {start}..{end} of the data, not the "
                                f"{math.prod(shape) * _DTYPES[entry['dtype']].itemsize} its shape and dtype need")


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """An artifact's model config, from its header alone (no tokenizer, no tensor read)."""
    path = Path(path)
    header = _read_header(path)
    _check_version(path, header)
    return _config(path, header)


def _arch_config(path: Path, header: _Header, config: ModelConfig) -> Inkling2Config:
    """An ``inkling2`` artifact's own config (``KEY_ARCH_CONFIG``), which must give the stored
    ``ModelConfig`` (``max_position`` aside: the stored one rules, as a ``max_seq_len`` extends it)."""
    text = _metadata_value(path, header, KEY_ARCH_CONFIG)
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ArtifactError(f"{path}: invalid {KEY_ARCH_CONFIG}: not JSON ({exc})") from None
    try:
        arch = Inkling2Config.from_hf(raw)
    except ConfigError as exc:
        raise ArtifactError(f"{path}: invalid {KEY_ARCH_CONFIG}: {exc}") from None
    arch = dataclasses.replace(arch, max_position=config.max_position)
    derived = arch.model_config()
    if derived != config:
        fields = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(derived, f.name)]
        raise ArtifactError(f"{path}: {KEY_ARCH_CONFIG} and {KEY_CONFIG} disagree (on {', '.join(fields)}): "
                            "the file is not one model")
    return arch


def _inkling2_shell(arch: Inkling2Config) -> Inkling2LM:
    """An ``Inkling2LM`` on the meta device: its state_dict's names and shapes, nothing allocated
    (``MAX_PARAMETERS`` bounds the config already)."""
    with torch.device("meta"):
        return Inkling2LM(arch)


def _shapes(model: Inkling2LM) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _checked_header(path: Path) -> tuple[_Header, ModelConfig, Tokenizer, dict[str, Any], Inkling2Config | None]:
    """Everything in the header, checked; the last item is an ``inkling2`` artifact's own config."""
    header = _read_header(path)
    for key in REQUIRED_KEYS:
        _metadata_value(path, header, key)
    _check_version(path, header)
    config = _config(path, header)
    special = _special(path, header, config)
    tokenizer = _tokenizer(path, header, config, special)
    arch = _arch_config(path, header, config) if config.architecture == "inkling2" else None
    _check_tensors(path, header, state_shapes(config) if arch is None else _shapes(_inkling2_shell(arch)))
    return header, config, tokenizer, special, arch


# -- load ------------------------------------------------------------------------------------


@contextmanager
def _foreign_errors(path: Path) -> Iterator[None]:
    """safetensors and torch report corrupt data with their own exception types."""
    try:
        yield
    except TinyLoopError:
        raise
    except Exception as exc:
        raise ArtifactError(f"{path}: cannot read tensors: {exc}") from exc


def load_artifact(path: str | os.PathLike[str], *, max_seq_len: int | None = None,
                  device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Artifact:
    """Check and load an artifact onto ``device``: a ``LoopedLM``, or the model its config's
    ``architecture`` names (``inkling2``: an ``Inkling2LM``).

    ``dtype`` converts every weight (default: the stored dtype of ``embed.weight``, so a file
    with mixed dtypes loads as one). A ``max_seq_len`` beyond the config's ``max_position``
    extends the config (and an ``inkling2`` model's own), and the RoPE tables with it. The
    tokenizer's ``chat_template`` is set to the artifact's.
    """
    path = Path(path)
    header, config, tokenizer, _, arch = _checked_header(path)
    config = _extended(config, max_seq_len)
    target = dtype or _DTYPES[header.tensors["embed.weight"]["dtype"]]
    model: LoopedLM | Inkling2LM
    if arch is None:
        model = empty_model(config, device)
    else:
        model = _inkling2_shell(dataclasses.replace(arch, max_position=config.max_position))
    with _foreign_errors(path), safe_open(str(path), framework="pt", device=str(device)) as f:
        state = {name: f.get_tensor(name).to(target) for name in header.tensors}
    model.load_state_dict(state, strict=True, assign=True)
    model.eval().requires_grad_(False)
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise ArtifactError(f"{path}: tensors left unloaded: {some_names(leftover)}")
    if isinstance(model, LoopedLM):
        model.rope.build()  # now, once the file is known to hold the model, not inside a first request
    # An artifact saved without a template keeps the tokenizer's default (ChatML), so the
    # tokenizer and the artifact never disagree about how a chat is rendered.
    tokenizer.chat_template = header.metadata[KEY_CHAT_TEMPLATE] or tokenizer.chat_template
    tokenizer.chat_templates = _named_templates(path, header.metadata.get(KEY_CHAT_TEMPLATES))
    return Artifact(path=path, config=config, model=model, tokenizer=tokenizer,
                    chat_template=tokenizer.chat_template, metadata=dict(header.metadata))


def _extended(config: ModelConfig, max_seq_len: int | None) -> ModelConfig:
    """``config`` with ``max_position`` raised to ``max_seq_len`` when that is beyond it."""
    if max_seq_len is None:
        return config
    if max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if max_seq_len <= config.max_position:
        return config
    try:
        return config.replace(max_position=max_seq_len)
    except ConfigError as exc:  # past the positions a config may have
        raise ConfigError(f"max_seq_len {max_seq_len} is more than this model can be extended to: {exc}") from None


def _named_templates(path: Path, text: str | None) -> dict[str, str]:
    """The artifact's named chat templates (``KEY_CHAT_TEMPLATES``); ArtifactError when malformed."""
    if not text:
        return {}
    try:
        named = json.loads(text)
    except ValueError as exc:
        raise ArtifactError(f"{path}: {KEY_CHAT_TEMPLATES} is not JSON: {exc}") from exc
    if (not isinstance(named, dict) or len(named) > MAX_NAMED_TEMPLATES or "default" in named
            or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in named.items())):
        raise ArtifactError(f"{path}: {KEY_CHAT_TEMPLATES} must map at most {MAX_NAMED_TEMPLATES} names "
                            "(other than 'default') to template sources")
    return named


def inspect_artifact(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What an artifact holds, from its header alone (no tensor is read). JSON-serialisable."""
    path = Path(path)
    header, config, tokenizer, special, _ = _checked_header(path)
    dtypes = sorted({str(_DTYPES[t["dtype"]]).removeprefix("torch.") for t in header.tensors.values()})
    params = sum(math.prod(t["shape"]) for t in header.tensors.values())
    return {
        "path": str(path),
        "format_version": FORMAT_VERSION,
        "file_size": header.file_size,
        "parameters": params,
        "tensors": len(header.tensors),
        "dtypes": dtypes,
        "dtype": str(_DTYPES[header.tensors["embed.weight"]["dtype"]]).removeprefix("torch."),
        "architecture": config.architecture,
        "config": config.to_dict(),
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "special_tokens": special,
        "chat_template": header.metadata[KEY_CHAT_TEMPLATE],
    }
