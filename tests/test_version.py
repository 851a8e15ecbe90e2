"""``tinyloop --version`` and ``GET /version`` report the version ``pyproject.toml`` declares (the
installed metadata's, else the file's)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from tinyloop import version
from tinyloop.cli import main
from tinyloop.http.factory import create_app
from tinyloop.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def declared() -> str:
    value: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return value


def test_the_command_line_prints_the_declared_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tinyloop {declared()}\n"


async def test_the_version_route_reports_the_declared_version() -> None:
    resp = await create_app(None, settings=Settings()).test_client().get("/version")
    assert resp.status_code == 200
    body = await resp.get_json()
    assert body["version"] == declared()
    assert body["torch"] == metadata.version("torch")


def test_a_source_tree_without_metadata_reads_pyproject(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert version.package_version() == declared()
    assert version.pyproject_version(tmp_path / "missing.toml") == version.UNKNOWN
    (tmp_path / "bare.toml").write_text("[project]\nname = 'x'\n")
    assert version.pyproject_version(tmp_path / "bare.toml") == version.UNKNOWN
