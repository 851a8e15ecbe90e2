"""The package's version: what ``tinyloop --version``, ``GET /version`` and ``tinyloop.__version__``
report.

The installed distribution's metadata is the source (``pip install`` wrote it from
``pyproject.toml``); a source tree run without installing falls back to reading ``pyproject.toml``
itself, so the two never disagree on what ``version`` says there.
"""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

__all__ = ["UNKNOWN", "package_version", "pyproject_version", "torch_version"]

UNKNOWN = "0+unknown"  # neither installed nor beside its pyproject.toml (PEP 440: a local version)
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"  # in a source tree


def package_version() -> str:
    """The installed ``tinyloop``'s version, else ``pyproject_version()``."""
    try:
        return metadata.version("tinyloop")
    except metadata.PackageNotFoundError:
        return pyproject_version()


def pyproject_version(path: Path = PYPROJECT) -> str:
    """``[project] version`` of ``path``; ``UNKNOWN`` when there is no such file or field."""
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return UNKNOWN
    version = project.get("version") if isinstance(project, dict) else None
    return version if isinstance(version, str) else UNKNOWN


@cache
def torch_version() -> str | None:
    """The installed torch's version (read from its metadata: torch is not imported), or None."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
