"""Import hygiene of the core: every module imports on its own, and module-level imports form no cycle.

A cycle works or breaks depending on which module a process imports first, so it is refused outright here
rather than found by a worker process that happens to start from the other end. Imports inside functions
and under `if TYPE_CHECKING:` do not run at import time and are left out of the graph.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "core"
PACKAGE = "rlcore"
INIT = "__init__"
# `python -m rlcore` runs the CLI on import; tests/core/test_cli.py covers it.
MODULES = sorted(p.stem for p in CORE.glob("*.py") if p.stem not in (INIT, "__main__"))


@pytest.mark.parametrize("module", MODULES)
def test_every_core_module_imports_alone_in_a_fresh_interpreter(module):
    done = subprocess.run(
        [sys.executable, "-c", f"import {PACKAGE}.{module}"], capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, f"`import {PACKAGE}.{module}` failed on its own:\n{done.stderr[-3000:]}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_statements(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of `body` that run when the module is imported."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            found += _import_time_statements(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                found += _import_time_statements(getattr(node, field, None) or [])
    return found


def _targets(node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    """The core modules one import statement imports (`__init__` for names of the package itself)."""
    if isinstance(node, ast.Import):
        parts = [alias.name.split(".") for alias in node.names]
        return {p[1] if len(p) > 1 and p[1] in modules else INIT for p in parts if p[0] == PACKAGE}
    if node.level == 0 and not (node.module or "").split(".")[0] == PACKAGE:
        return set()
    if node.level > 1:
        return set()  # above the package
    path = (node.module or "").split(".")
    if node.level == 0:
        path = path[1:]
    if path and path[0]:
        return {path[0] if path[0] in modules else INIT}
    return {alias.name if alias.name in modules else INIT for alias in node.names}


def core_import_graph() -> dict[str, set[str]]:
    """Module -> the core modules its module-level imports load (the package itself is `__init__`)."""
    files = {p.stem: p for p in CORE.glob("*.py")}
    # core's folders (runtime/, compat/) are nodes here; tests/core/test_import_graph.py follows every import into them
    modules = set(files) | {p.parent.name for p in CORE.glob("*/__init__.py")}
    return {
        name: {t for stmt in _import_time_statements(ast.parse(path.read_text()).body) for t in _targets(stmt, modules)} - {name}
        for name, path in files.items()
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_through(graph, component) for component in components]


def _path_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A closed path from the component's first module back to it, inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"no cycle through {component}")


def test_the_core_import_graph_has_no_cycle():
    cycles = find_cycles(core_import_graph())
    assert not cycles, "core modules import each other at import time: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_graph_sees_module_level_imports_only_and_finds_a_cycle():
    """The checker itself: imports in functions and under TYPE_CHECKING are not edges; a cycle is found."""
    source = (
        "from typing import TYPE_CHECKING\nfrom . import b\nfrom .errors import X\nimport rlcore.c\n"
        "if TYPE_CHECKING:\n    from .d import D\nelse:\n    from .e import E\n"
        "try:\n    from rlcore import Batch\nexcept ImportError:\n    pass\n"
        "def f():\n    from .g import G\n"
    )
    modules = {"a", "b", "c", "d", "e", "g", "errors", INIT}
    found = {t for stmt in _import_time_statements(ast.parse(source).body) for t in _targets(stmt, modules)}
    assert found == {"b", "errors", "c", "e", INIT}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
