"""Packaging: every package folder is listed in setup.cfg; README, .ci/run and the example agree."""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def setup_cfg() -> tuple[dict[str, str], set[str]]:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    package_dir = dict(
        (part.strip() for part in line.split("=", 1))
        for line in parser["options"]["package_dir"].strip().splitlines()
    )
    return package_dir, set(parser["options"]["packages"].split())


def test_every_package_folder_is_listed_under_its_import_name():
    package_dir, packages = setup_cfg()
    assert package_dir == {"rlcore": "core", "rlcore.plugins": "plugins", "rlcore.contrib": "contrib"}
    missing = []
    for import_name, folder in package_dir.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" in parts:
                continue
            name = ".".join((import_name, *parts))
            if name not in packages:
                missing.append(f"{name} ({init.parent.relative_to(ROOT)})")
    assert not missing, f"add these to `packages` in setup.cfg: {', '.join(missing)}"


def test_every_listed_package_exists():
    package_dir, packages = setup_cfg()
    for name in packages:
        root = max((k for k in package_dir if name == k or name.startswith(k + ".")), key=len)
        folder = ROOT / package_dir[root] / Path(*name[len(root) :].split(".")[1:])
        assert (folder / "__init__.py").is_file(), f"setup.cfg lists {name} but {folder} has no __init__.py"


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"^\s*(python -m pytest[^\n#]*?)\s*(?:#.*)?$", script, re.MULTILINE)
    assert len(commands) == 1, "`.ci/run` should run exactly one pytest command"
    assert commands[0] in (ROOT / "README.md").read_text(), f"README.md should show the test command {commands[0]!r}"


def test_the_example_plugin_declares_its_entry_point():
    project = tomllib.loads((ROOT / "examples" / "plugin-template" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "rlcore-example-plugin"
    assert project["entry-points"]["rlcore.plugins"] == {"example": "rlcore_example", "bandit": "rlcore_example.bandit"}
    assert "rlcore" in project["dependencies"]


def test_the_console_script_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"rlcore": "rlcore.cli:main"}
