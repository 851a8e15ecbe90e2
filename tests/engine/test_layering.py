"""The engine's shape: a core under 300 lines, strategies that never import it, no import circle
among the engine's and the model's modules (counting imports under TYPE_CHECKING)."""

from __future__ import annotations

import ast
from pathlib import Path

import tinyloop
from tests.test_layers import find_cycle

PACKAGE = Path(tinyloop.__file__).parent


def imports(path: Path) -> set[str]:
    """Every tinyloop module ``path`` imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("tinyloop.")}


def graph(*packages: str) -> dict[str, set[str]]:
    modules = {f"tinyloop.{p}.{f.stem}": f for p in packages for f in (PACKAGE / p).glob("*.py")
               if f.stem != "__init__"}
    return {name: imports(path) & modules.keys() - {name} for name, path in modules.items()}


def test_no_import_circle_among_the_engine_and_model_modules() -> None:
    edges = graph("engine", "model")
    assert "tinyloop.engine.speculative" in edges and "tinyloop.model.backend" in edges
    assert find_cycle(edges) is None, find_cycle(edges)


def test_nothing_in_the_engine_package_imports_the_core_back() -> None:
    edges = graph("engine")
    assert [m for m, deps in edges.items() if "tinyloop.engine.engine" in deps] == []


def test_the_core_stays_small() -> None:
    assert len((PACKAGE / "engine" / "engine.py").read_text().splitlines()) < 300
