"""``tinyloop generate`` on a freshly initialised artifact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinyloop.cli import main


def test_generate_streams_the_same_text_as_json(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--model", str(tiny_artifact), "--prompt", "def add(a, b):", "--max-tokens", "12"]
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completion_tokens"] == 12 and result["loops"] == 4
    assert main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == result["text"] + "\n"


def test_generate_streams_tokens_as_they_come(tiny_artifact: Path) -> None:
    """The real entry point, in a subprocess: text arrives before the process ends."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinyloop.cli", "generate", "--model", str(tiny_artifact),
         "--prompt", "class Stack:", "--max-tokens", "200", "--stream", "--loops", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    still_running = proc.poll() is None
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert first and still_running, "the first bytes should arrive while tokens are still generated"
    assert len(first + rest) > 1


def test_generate_reports_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tmp_path / "nope.tinyloop"), "--prompt", "x"]) == 2
    assert "nope.tinyloop" in capsys.readouterr().err


def test_generate_rejects_bad_knobs(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny_artifact), "--prompt", "x", "--loops", "99"]) == 2
    assert "loops must be <=" in capsys.readouterr().err
