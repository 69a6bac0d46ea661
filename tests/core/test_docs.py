"""The docs hold to the repository: every path they name exists, every relative link resolves (its anchor too),
every test they cite is defined, and README.md stays a short user's page."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
README_LIMIT = 12 * 1000  # bytes
# a path in the repository as the docs name one, in backticks or in prose; `rlcore/...` is named so that a page
# giving the import name as a folder (there is no rlcore/ folder: core/ is `rlcore`) fails
PATH = re.compile(r"(?<![\w./-])((?:rlcore|core|plugins|contrib|examples|tests|benchmarks|docs)/[\w./*{},:-]*[\w*}])")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```")


def expand(path: str) -> list[str]:
    """`docs/{a,b}.md` -> [docs/a.md, docs/b.md]."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return list(itertools.chain.from_iterable(expand(path[:m.start()] + part + path[m.end():])
                                              for part in m.group(1).split(",")))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def named_paths(text: str) -> list[str]:
    return [p.rstrip(".,:") for p in PATH.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(doc):
    missing = []
    for named in named_paths(doc.read_text(encoding="utf-8")):
        file, _, test = named.partition("::")
        for path in expand(file):
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(path)
            elif test:
                name = test.split("[")[0]
                if not re.search(rf"^\s*(async )?def {re.escape(name)}\(", (ROOT / path).read_text(), re.MULTILINE):
                    missing.append(named)
    assert not missing, f"{doc.relative_to(ROOT)} names paths or tests that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no heading for #{anchor})")
    assert not broken, f"{doc.relative_to(ROOT)} has links that do not resolve: {broken}"


def test_a_test_cited_by_file_and_name_is_checked():
    assert named_paths("see `tests/core/test_docs.py::test_readme_is_a_short_users_page`.") == [
        "tests/core/test_docs.py::test_readme_is_a_short_users_page"]
    assert named_paths("rlcore/compat/ms_swift.py and docs/{a,b}.md, not output_dir/final") == [
        "rlcore/compat/ms_swift.py", "docs/{a,b}.md"]
    assert expand("docs/{a,b}.md") == ["docs/a.md", "docs/b.md"]
    assert slug("## `rlcore plot`") == "rlcore-plot" and slug("### rlcore_configure") == "rlcore_configure"


def test_readme_is_a_short_users_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    size = len(text.encode("utf-8"))
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it under {README_LIMIT} and move the rest to docs/"
    assert "python3 -m venv .venv && . .venv/bin/activate\npip install 'torch==2.13.0' -e '.[hf,rewards]'\n" \
           "rlcore run --plugin grpo" in text
    assert "bash .ci/run" in text
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text.replace("torch==2.13.0", "")), "README.md names a commit"
    assert "benchmarks/results/" not in text, "README.md names a results file: link benchmarks/README.md instead"
