"""Core's import graph, built from the source: no circle. Every import counts, at a module's top, inside a
function or under TYPE_CHECKING, since each is a dependency of one module on another; a new circle fails here
with its modules and their edges."""

from __future__ import annotations

import ast
from pathlib import Path

import rlcore

CORE = Path(rlcore.__file__).resolve().parent


def module_name(path: Path, root: Path = CORE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["rlcore", *parts])


def import_graph(root: Path = CORE) -> dict[str, set[str]]:
    """module -> the modules of core it imports (`from . import x` is an import of x, not of the package)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                targets = subs if subs and not node.module else [target, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_core_imports_in_no_circle():
    graph = import_graph()
    found = circles(graph)
    edges = [f"{v} -> {', '.join(sorted(w for w in graph[v] if w in c))}" for c in found for v in c]
    assert found == [], "import circles in core:\n" + "\n".join(edges)


def test_a_circle_is_found(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (tmp_path / "c.py").write_text("def f():\n    from .a import x\n")
    (tmp_path / "d.py").write_text("from . import a\nimport rlcore.d\n")
    assert circles(import_graph(tmp_path)) == [["rlcore.a", "rlcore.b", "rlcore.c"]]


def test_the_folders_are_layers():
    """The runtime (core/runtime/) builds on core's shared pieces, never on the algorithm contract, the CLI or the
    translators; the translators (core/compat/) are the CLI's, which runs them before a config is validated."""
    graph = import_graph()
    above = ("rlcore.role_trainer", "rlcore.trainer", "rlcore.cli", "rlcore.compat")
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("rlcore.runtime.")
                    for t in targets if t.startswith(above))
    assert upward == []
    users = sorted(m for m, targets in graph.items() if not m.startswith("rlcore.compat")
                   and any(t.startswith("rlcore.compat") for t in targets))
    assert users == ["rlcore.cli"]
