"""A Hugging Face model directory as the hub ships it, read without loading every tensor.

``HFDir`` reads ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (its
``chat_template`` and special token names) and ``generation_config.json``, and indexes the
tensors of ``model.safetensors`` or of the shards ``model.safetensors.index.json`` names, so a
converter can ask for one tensor (or rows of one) at a time. Every failure is a ``ConfigError``
naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinyloop.errors import ConfigError

__all__ = ["HFDir", "TensorInfo"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a checkpoint tensor lives, and its shape and safetensors dtype tag."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


def _json_file(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.exists() and not required:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (a Hugging Face model directory needs it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


@dataclass
class HFDir:
    """One model directory; use as a context manager so the shards are closed afterwards."""

    root: Path
    config: dict[str, Any] = field(init=False)
    tokenizer_json: str = field(init=False)
    tokenizer_config: dict[str, Any] = field(init=False)
    generation_config: dict[str, Any] = field(init=False)
    tensors: dict[str, TensorInfo] = field(init=False)
    _stack: ExitStack = field(init=False, default_factory=ExitStack)
    _open: dict[Path, Any] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.root.is_dir():
            raise ConfigError(f"{self.root}: not a directory (expected a Hugging Face model directory)")
        self.config = _json_file(self.root / "config.json", required=True)
        try:
            self.tokenizer_json = (self.root / "tokenizer.json").read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{self.root / 'tokenizer.json'}: cannot read: {exc}") from exc
        self.tokenizer_config = _json_file(self.root / "tokenizer_config.json", required=False)
        self.generation_config = _json_file(self.root / "generation_config.json", required=False)
        self.tensors = self._index()

    def _shards(self) -> list[Path]:
        index = self.root / INDEX
        if index.exists():
            weight_map = _json_file(index, required=True).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{index}: has no weight_map")
            return [self.root / name for name in sorted(set(weight_map.values()))]
        if (self.root / SINGLE).exists():
            return [self.root / SINGLE]
        raise ConfigError(f"{self.root}: no {SINGLE} and no {INDEX}")

    def _index(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for shard in self._shards():
            handle = self._handle(shard)
            for name in handle.keys():
                if name in tensors:
                    raise ConfigError(f"{shard}: tensor {name} is also in {tensors[name].file.name}")
                part = handle.get_slice(name)
                tensors[name] = TensorInfo(name, shard, tuple(part.get_shape()), str(part.get_dtype()))
        return tensors

    def _handle(self, shard: Path) -> Any:
        if shard not in self._open:
            try:
                self._open[shard] = self._stack.enter_context(safe_open(str(shard), framework="pt"))
            except Exception as exc:  # safetensors' own error types for a missing or corrupt file
                raise ConfigError(f"{shard}: cannot open safetensors file: {exc}") from exc
        return self._open[shard]

    def tensor(self, name: str) -> torch.Tensor:
        """One whole tensor (read from its shard's memory map)."""
        info = self.tensors[name]
        out: torch.Tensor = self._handle(info.file).get_tensor(name)
        return out

    def row_chunks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """Tensor ``name`` in chunks of ``rows`` leading rows (bounded memory for a comparison)."""
        info = self.tensors[name]
        part = self._handle(info.file).get_slice(name)
        for start in range(0, info.shape[0], rows):
            yield part[start:start + rows]

    def close(self) -> None:
        self._open.clear()
        self._stack.close()

    def __enter__(self) -> HFDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
