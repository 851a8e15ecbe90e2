"""A Hugging Face model directory as the hub ships it, read without loading every tensor.

``HFDir`` reads ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (its
``chat_template`` and special token names) and ``generation_config.json``, and indexes the
tensors of ``model.safetensors`` or of the shards ``model.safetensors.index.json`` names, so a
converter can ask for one tensor (or rows of one) at a time. Every failure is a ``ConfigError``
naming the file.

A directory with neither but a ``pytorch_model.bin`` (a pickle, as some checkpoints ship) is
read with ``torch.load(weights_only=True, mmap=True)``: the restricted unpickler that rebuilds
tensors and plain containers only, so a pickle that would run code on load is refused, never
run; a file it cannot read that way is refused with a request for safetensors.

A model directory is untrusted input: every file read from it must be a regular file (opened
without blocking, so a FIFO is refused rather than waited on) that lies inside the directory
once its symlinks are resolved (or in the hub cache's ``blobs`` folder beside a
``snapshots/<revision>`` directory, where the hub keeps the files its snapshots link to), and
a JSON file is read up to its cap (``FileLimits``) and no further.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinyloop.errors import ConfigError

__all__ = ["MAX_JSON_BYTES", "MAX_TOKENIZER_BYTES", "FileLimits", "HFDir", "TensorInfo"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLE = "pytorch_model.bin"
_TAGS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# Published tokenizer.json files take 2-20 MB (Gemma-3's, 262k tokens: 33 MB); the artifact
# embeds the tokenizer in a header safetensors caps at 100 MB.
MAX_TOKENIZER_BYTES = 64 << 20
# config.json, tokenizer_config.json and generation_config.json take kilobytes (the largest,
# a tokenizer_config listing every added token, about 2 MB); a shard index about 100 bytes
# per tensor (DeepSeek-V3's 91k tensors: 9 MB).
MAX_JSON_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class FileLimits:
    """The most bytes each kind of JSON file of a model directory may hold."""

    tokenizer_bytes: int = MAX_TOKENIZER_BYTES  # tokenizer.json
    json_bytes: int = MAX_JSON_BYTES  # every other JSON file (configs, the shard index)

    def cap(self, name: str) -> int:
        return self.tokenizer_bytes if name == "tokenizer.json" else self.json_bytes


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a checkpoint tensor lives, and its shape and safetensors dtype tag."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


def _size(n: int) -> str:
    if n < 2**20:
        return f"{n} bytes"
    return f"{n / 2**20:.1f} MiB" if n % 2**20 else f"{n >> 20} MiB"


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise ConfigError(f"{path}: cannot resolve: {exc}") from None


def _regular_fd(path: Path, real: Path) -> int:
    """A read-only descriptor on ``real`` (``path`` resolved), refused unless a regular file.
    ``O_NONBLOCK``: opening a FIFO would otherwise wait for a writer."""
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (a Hugging Face model directory needs it)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot open: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{path}: not a regular file; refused")
    return fd


def _read_capped(path: Path, real: Path, cap: int, flag: str) -> bytes:
    """At most ``cap`` bytes of ``path``; ``ConfigError`` naming the cap when it holds more."""
    with os.fdopen(_regular_fd(path, real), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = b"" if size > cap else f.read(cap + 1)  # + 1: a file that grew while read
    if size > cap or len(data) > cap:
        raise ConfigError(f"{path}: {_size(max(size, len(data)))} is more than the {_size(cap)} a {path.name} may "
                          f"take ({flag} raises it)")
    return data


@dataclass
class HFDir:
    """One model directory; use as a context manager so the shards are closed afterwards."""

    root: Path
    limits: FileLimits = field(default_factory=FileLimits)
    config: dict[str, Any] = field(init=False)
    tokenizer_json: str = field(init=False)
    tokenizer_config: dict[str, Any] = field(init=False)
    generation_config: dict[str, Any] = field(init=False)
    tensors: dict[str, TensorInfo] = field(init=False)
    _roots: tuple[Path, ...] = field(init=False, repr=False)  # where the directory's files may lie
    _real: dict[Path, Path] = field(init=False, repr=False)  # each shard -> its file, links resolved
    _pickled: dict[str, torch.Tensor] = field(init=False, repr=False)  # pytorch_model.bin's (memory-mapped)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.root.is_dir():
            raise ConfigError(f"{self.root}: not a directory (expected a Hugging Face model directory)")
        real_root = _resolved(self.root)
        hub_blobs = (real_root.parent.parent / "blobs",) if real_root.parent.name == "snapshots" else ()
        self._roots, self._real, self._pickled = (real_root, *hub_blobs), {}, {}
        self.config = self._json("config.json", required=True)
        try:
            self.tokenizer_json = self._read("tokenizer.json").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{self.root / 'tokenizer.json'}: cannot read: {exc}") from exc
        self.tokenizer_config = self._json("tokenizer_config.json", required=False)
        self.generation_config = self._json("generation_config.json", required=False)
        self.tensors = self._index()

    def _inside(self, path: Path) -> Path | None:
        """``path`` with its links resolved, or None when that lies outside the directory."""
        real = _resolved(path)
        return real if any(real.is_relative_to(root) for root in self._roots) else None

    def _read(self, name: str) -> bytes:
        """The bytes of the directory's file ``name`` (at most its cap, a regular file inside)."""
        path = self.root / name
        real = self._inside(path)
        if real is None:
            raise ConfigError(f"{path}: links to a file outside the model directory; refused")
        flag = "--max-tokenizer-mb" if name == "tokenizer.json" else "--max-json-mb"
        return _read_capped(path, real, self.limits.cap(name), flag)

    def _json(self, name: str, *, required: bool) -> dict[str, Any]:
        path = self.root / name
        if not required and not os.path.lexists(path):
            return {}
        try:
            data = json.loads(self._read(name).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read JSON: {exc}") from exc
        except RecursionError:
            raise ConfigError(f"{path}: cannot read JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return data

    def _shards(self) -> list[Path]:
        index = self.root / INDEX
        if os.path.lexists(index):
            weight_map = self._json(INDEX, required=True).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{index}: has no weight_map")
            names = set(weight_map.values())
            if not all(isinstance(name, str) and name for name in names):
                raise ConfigError(f"{index}: weight_map must map tensor names to shard file names")
            return [self._shard(self.root / name, f"{index}: weight_map names {name!r}") for name in sorted(names)]
        if os.path.lexists(self.root / SINGLE):
            return [self._shard(self.root / SINGLE, str(self.root / SINGLE))]
        raise ConfigError(f"{self.root}: no {SINGLE}, no {INDEX} and no {PICKLE}")

    def _shard(self, path: Path, named: str) -> Path:
        """``path`` once it is known to be a regular file inside the directory (``named``: what
        names it, for the error). Neither its content nor its kind is reported when it is not."""
        real = self._inside(path)
        if real is None:
            raise ConfigError(f"{named}, outside the model directory; refused")
        os.close(_regular_fd(path, real))
        self._real[path] = real
        return path

    def _index(self) -> dict[str, TensorInfo]:
        if not any(os.path.lexists(self.root / name) for name in (INDEX, SINGLE)) and os.path.lexists(
                self.root / PICKLE):
            return self._pickle_index(self._shard(self.root / PICKLE, str(self.root / PICKLE)))
        tensors: dict[str, TensorInfo] = {}
        for shard in self._shards():
            with self._opened(shard) as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise ConfigError(f"{shard}: tensor {name} is also in {tensors[name].file.name}")
                    part = handle.get_slice(name)
                    tensors[name] = TensorInfo(name, shard, tuple(part.get_shape()), str(part.get_dtype()))
        return tensors

    def _pickle_index(self, path: Path) -> dict[str, TensorInfo]:
        """``pytorch_model.bin``'s tensors, loaded by the restricted unpickler, memory-mapped."""
        ask = f"convert the weights to {SINGLE} (safetensors) to serve them"
        try:
            state = torch.load(self._real[path], map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # UnpicklingError for a forbidden global; RuntimeError for a legacy file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{path}: refused: it does not load as plain tensors with torch.load(weights_only=True) "
                              f"({first[:200]}); TinyLoop never unpickles a checkpoint freely: {ask}") from None
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in state.items()):
            raise ConfigError(f"{path}: not a mapping of tensor names to tensors; {ask}")
        bad = sorted(name for name, t in state.items() if t.dtype not in _TAGS)
        if bad:
            raise ConfigError(f"{path}: tensor {bad[0]} has dtype {state[bad[0]].dtype}; {ask}")
        self._pickled = state
        return {name: TensorInfo(name, path, tuple(t.shape), _TAGS[t.dtype]) for name, t in state.items()}

    @contextmanager
    def _opened(self, shard: Path) -> Iterator[Any]:
        """A shard's memory map, open only while it is read: the pages a read touched count in
        the process's resident memory until the map is closed, so keeping every shard open
        would hold the whole checkpoint by the end of a conversion."""
        try:
            handle = safe_open(str(self._real[shard]), framework="pt")
        except Exception as exc:  # safetensors' own error types for a missing or corrupt file
            raise ConfigError(f"{shard}: cannot open safetensors file: {exc}") from exc
        with handle:
            yield handle

    def tensor(self, name: str) -> torch.Tensor:
        """One whole tensor, copied out of its shard (whose map is closed again)."""
        info = self.tensors[name]
        if self._pickled:
            return self._pickled[name].clone()  # out of the map
        with self._opened(info.file) as handle:
            out: torch.Tensor = handle.get_tensor(name)  # a copy: safetensors reads into new memory
        return out

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Leading rows ``start:stop`` of tensor ``name``, copied out (the rest is not read)."""
        info = self.tensors[name]
        if self._pickled:
            return self._pickled[name][start:stop].clone()
        with self._opened(info.file) as handle:
            out: torch.Tensor = handle.get_slice(name)[start:stop].clone()
        return out

    def row_chunks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """Tensor ``name`` in chunks of ``rows`` leading rows (bounded memory for a comparison)."""
        info = self.tensors[name]
        for start in range(0, info.shape[0], rows):
            if self._pickled:
                yield self._pickled[name][start:start + rows].clone()
                continue
            with self._opened(info.file) as handle:
                chunk: torch.Tensor = handle.get_slice(name)[start:start + rows].clone()
            yield chunk

    def close(self) -> None:
        """Drops a pickle's map; safetensors shards stay closed between reads."""
        self._pickled = {}

    def __enter__(self) -> HFDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
