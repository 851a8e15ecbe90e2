"""Write a ``.tinyloop`` artifact one tensor at a time.

``save_artifact`` needs the whole model in memory; a converted checkpoint may be larger than
that allows twice over. Here the safetensors header is laid out from the planned names, shapes
and dtype first, then each tensor is produced, converted and written, and dropped before the
next one: at most one source tensor and its converted copy are alive at a time. A header that
safetensors would refuse to read back (``MAX_HEADER_BYTES``: an embedded tokenizer too large)
is refused before anything is written.
"""

from __future__ import annotations

import json
import math
import os
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tinyloop.errors import ArtifactError
from tinyloop.model.artifact import MAX_HEADER_BYTES

__all__ = ["PlannedTensor", "write_streaming"]

_TAGS: dict[torch.dtype, str] = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One output tensor: its canonical name, shape, and how to produce it when it is written."""

    name: str
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


def _header(plan: Sequence[PlannedTensor], dtype: torch.dtype, metadata: Mapping[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    width = torch.empty((), dtype=dtype).element_size()
    for item in plan:
        size = math.prod(item.shape) * width
        entries[item.name] = {"dtype": _TAGS[dtype], "shape": list(item.shape), "data_offsets": [offset, offset + size]}
        offset += size
    try:  # UTF-8 as it is, as safetensors' own writer does: escaped, a byte-level BPE vocabulary
        # (mostly non-ASCII) takes three times the bytes
        raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (a chat template's "\ud800"): only escaped is valid
        raw = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def write_streaming(path: Path, plan: Sequence[PlannedTensor], dtype: torch.dtype,
                    metadata: Mapping[str, str], progress: Callable[[int, int, str], None] | None = None) -> None:
    """Write ``plan`` in ``dtype`` to ``path`` atomically (temp file in the same directory)."""
    if dtype not in _TAGS:
        raise ArtifactError(f"{path}: cannot write dtype {dtype}; use one of float32, bfloat16, float16")
    header = _header(plan, dtype, metadata)
    if len(header) > MAX_HEADER_BYTES:
        sizes = sorted(((len(v.encode()), k) for k, v in metadata.items()), reverse=True)[:2]
        raise ArtifactError(f"{path}: the artifact's header would take {len(header) / 2**20:.1f} MiB, more than "
                            f"the {MAX_HEADER_BYTES / 2**20:g} MiB safetensors reads back (largest entries: "
                            f"{', '.join(f'{k} {n / 2**20:.1f} MiB' for n, k in sizes)}); refused")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for i, item in enumerate(plan):
                tensor = item.produce().to(dtype).contiguous()
                if tuple(tensor.shape) != item.shape:
                    raise ArtifactError(f"{path}: tensor {item.name} came out as {list(tensor.shape)}, "
                                        f"planned {list(item.shape)}")
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)  # no extra copy
                del tensor
                if progress is not None:
                    progress(i + 1, len(plan), item.name)
        os.replace(tmp, path)
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot write artifact: {exc}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
