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
from contextlib import contextmanager
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
            with self._opened(shard) as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise ConfigError(f"{shard}: tensor {name} is also in {tensors[name].file.name}")
                    part = handle.get_slice(name)
                    tensors[name] = TensorInfo(name, shard, tuple(part.get_shape()), str(part.get_dtype()))
        return tensors

    @staticmethod
    @contextmanager
    def _opened(shard: Path) -> Iterator[Any]:
        """A shard's memory map, open only while it is read: the pages a read touched count in
        the process's resident memory until the map is closed, so keeping every shard open
        would hold the whole checkpoint by the end of a conversion."""
        try:
            handle = safe_open(str(shard), framework="pt")
        except Exception as exc:  # safetensors' own error types for a missing or corrupt file
            raise ConfigError(f"{shard}: cannot open safetensors file: {exc}") from exc
        with handle:
            yield handle

    def tensor(self, name: str) -> torch.Tensor:
        """One whole tensor, copied out of its shard (whose map is closed again)."""
        info = self.tensors[name]
        with self._opened(info.file) as handle:
            out: torch.Tensor = handle.get_tensor(name)  # a copy: safetensors reads into new memory
        return out

    def row_chunks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """Tensor ``name`` in chunks of ``rows`` leading rows (bounded memory for a comparison)."""
        info = self.tensors[name]
        for start in range(0, info.shape[0], rows):
            with self._opened(info.file) as handle:
                chunk: torch.Tensor = handle.get_slice(name)[start:start + rows].clone()
            yield chunk

    def close(self) -> None:
        """Nothing stays open between reads; kept so the directory reads as a context manager."""

    def __enter__(self) -> HFDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
