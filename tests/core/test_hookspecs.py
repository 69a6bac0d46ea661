"""Meta-test in the style of datasette's: every hook has a test and a documented section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlcore import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = sorted(name for name in vars(hookspecs) if name.startswith("rlcore_"))


def test_the_hooks_are_found():
    assert {"rlcore_roles", "rlcore_algorithms", "rlcore_configure", "rlcore_step_end"} <= set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_implemented_or_called_by_a_test(hook):
    pattern = re.compile(rf"def {hook}\(|hook\.{hook}\(")
    users = [
        path.relative_to(ROOT)
        for path in (ROOT / "tests").rglob("*.py")
        if path.name != "test_hookspecs.py" and pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert users, f"no test under tests/ implements `def {hook}(` or calls `hook.{hook}(`"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_documented_section(hook):
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    heading = re.compile(rf"^#+ .*\b{hook}\b|<a (name|id)=\"{hook}\">", re.MULTILINE)
    assert any(
        heading.search(doc.read_text(encoding="utf-8")) for doc in documents if doc.exists()
    ), f"README.md or docs/*.md needs a section whose heading (or anchor) names {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hookspec_has_a_docstring_with_an_example(hook):
    doc = getattr(hookspecs, hook).__doc__ or ""
    assert "@hookimpl" in doc and f"def {hook}(" in doc
