"""What the artifact tests share: a copy of an artifact with its header or tensors changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def rewrite_artifact(src: Path, dst: Path, *, metadata: dict[str, str | None] | None = None,
             tensors: dict[str, torch.Tensor | None] | None = None) -> Path:
    """Copy ``src`` to ``dst`` with metadata entries and tensors replaced (None removes)."""
    with safe_open(str(src), framework="pt") as f:
        meta: dict[str, Any] = dict(f.metadata())
    state = load_file(str(src))
    for key, value in (metadata or {}).items():
        meta.pop(key) if value is None else meta.__setitem__(key, value)
    for key, tensor in (tensors or {}).items():
        state.pop(key) if tensor is None else state.__setitem__(key, tensor)
    save_file(state, str(dst), metadata=meta)
    return dst
