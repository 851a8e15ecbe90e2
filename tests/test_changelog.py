"""CHANGELOG.md follows Keep a Changelog: an Unreleased section first, then the releases, newest
first, the newest being the version ``pyproject.toml`` declares."""

from __future__ import annotations

import re

from tests.test_version import ROOT, declared


def test_the_changelog_starts_at_the_declared_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d[^\]]*)\] - (\d{4}-\d{2}-\d{2})$", text, re.MULTILINE)
    assert releases and releases[0][0] == declared(), releases
    unreleased = text.split(f"## [{declared()}]")[0]
    assert "## [Unreleased]" in unreleased
    assert re.search(r"^### (Added|Changed|Deprecated|Removed|Fixed|Security)$", unreleased, re.MULTILINE)
