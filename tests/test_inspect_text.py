"""``tinyloop inspect``'s text: every config line holds its key, at least two spaces, then its
value, with the values in one column (a long key such as ``rope_original_max_position`` too)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tinyloop.cli import main
from tinyloop.model.artifact import read_config

CONFIG_LINE = re.compile(r"^  (\S+)( {2,})(\S.*)$")


def test_every_config_key_is_apart_from_its_value(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tiny_artifact)]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("config") + 1
    block = lines[start:start + len(read_config(tiny_artifact).to_dict())]
    matches = [CONFIG_LINE.match(line) for line in block]
    assert all(matches), [line for line, m in zip(block, matches) if m is None]
    keys = [m[1] for m in matches if m]
    assert keys == list(read_config(tiny_artifact).to_dict())  # every key, none run into its value
    assert "rope_original_max_position" in keys
    assert len({m.start(3) for m in matches if m}) == 1, block  # the values share one column
