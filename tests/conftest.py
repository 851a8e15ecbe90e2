"""Fixtures shared across the test tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinyloop.model.artifact import save_artifact
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.tokenizer import default_tokenizer


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``tiny`` preset artifact (seed 0, the default tokenizer), written once per session.

    Read-only: a test that needs to damage or rewrite an artifact copies it first.
    """
    path = tmp_path_factory.mktemp("artifacts") / "tiny.tinyloop"
    save_artifact(path, init_model(PRESETS["tiny"], seed=0), default_tokenizer())
    return path
