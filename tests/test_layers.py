"""The package's layers: no import circle, and the light layers load without torch or trio."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tinyloop"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports a module runs when it is imported, and those under ``if TYPE_CHECKING:`` (a
    circle there is still a circle for the type checker and the reader); not those inside
    functions, which run later."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return found


def edges(name: str, path: Path) -> set[str]:
    out = set()
    for node in top_level_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            assert not node.level, f"{name}: the package uses absolute imports only"
            base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        out.update(t for t in targets if t in MODULES and t != name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle_in_the_package() -> None:
    graph = {name: edges(name, path) for name, path in MODULES.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def loaded_after(code: str) -> list[str]:
    """The modules loaded by running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    return list(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("module", ["tinyloop", "tinyloop.errors", "tinyloop.policy", "tinyloop.requests",
                                    "tinyloop.settings", "tinyloop.vocabulary"])
def test_light_layers_import_neither_torch_nor_trio(module: str) -> None:
    loaded = loaded_after(f"import {module}")
    assert "torch" not in loaded and "trio" not in loaded


def test_the_http_layer_imports_neither_torch_nor_the_model() -> None:
    http = sorted(m for m in MODULES if m.startswith("tinyloop.http"))
    loaded = loaded_after("\n".join(f"import {m}" for m in http))
    assert "torch" not in loaded
    assert not [m for m in loaded if m.startswith(("tinyloop.model", "tinyloop.engine"))]


def test_requests_and_settings_do_not_import_the_model() -> None:
    for name in ("tinyloop.requests", "tinyloop.settings"):
        assert not [m for m in edges(name, MODULES[name]) if m.startswith("tinyloop.model")]
