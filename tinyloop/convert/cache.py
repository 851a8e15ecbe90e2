"""Serving a Hugging Face model directory: converted once, then kept as an artifact.

``tinyloop serve --model HF_DIR`` converts the directory into the cache directory
(``TINYLOOP_CACHE_DIR``, default ``$XDG_CACHE_HOME/tinyloop`` or ``~/.cache/tinyloop``) and loads
the artifact; the next start finds it there. The cache key covers the directory's path and every
file's name, size and modification time, so a changed checkpoint is converted again.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tinyloop.convert import convert
from tinyloop.convert.hfdir import FileLimits

__all__ = ["converted_artifact", "default_cache_dir", "is_hf_dir"]


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (one with a ``config.json``: any entry of
    that name, so that one which is not a regular file is refused by the converter, by name)."""
    return path.is_dir() and os.path.lexists(path / "config.json")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tinyloop"


def _key(hf_dir: Path) -> str:
    digest = hashlib.sha256(str(hf_dir.resolve()).encode())
    for f in sorted(p for p in hf_dir.iterdir() if p.is_file()):
        stat = f.stat()
        digest.update(f"\0{f.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def converted_artifact(hf_dir: Path, cache_dir: Path | None = None, limits: FileLimits | None = None) -> Path:
    """The artifact for ``hf_dir``: converted now if the cache does not hold it yet (written to a
    partial file first, so an interrupted conversion is never taken for a finished one);
    ``limits``: the JSON files' caps (``hfdir.FileLimits``)."""
    cache_dir = cache_dir or default_cache_dir()
    out = cache_dir / f"{hf_dir.resolve().name}-{_key(hf_dir)}.tinyloop"
    if out.is_file():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    convert(hf_dir, partial, limits=limits)
    os.replace(partial, out)
    return out
