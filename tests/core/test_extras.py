"""A missing extra, as a user without it meets it: `python -m rlcore ...` in a subprocess whose import system
does not find the extra's library (a meta-path finder installed by a sitecustomize on PYTHONPATH), so the
check runs against the real import machinery, not a patched function."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

BLOCKER = textwrap.dedent(
    """
    import os, sys

    class Blocked:
        '''The top-level modules named in RLCORE_TEST_BLOCK are not installed, as far as imports can tell.'''

        def __init__(self, names):
            self.names = names

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocked(set(filter(None, os.environ.get("RLCORE_TEST_BLOCK", "").split(",")))))
    """
)


@pytest.fixture
def without(tmp_path):
    """`without("ray", "run", ...)`: python -m rlcore ... in tmp_path, where `ray` cannot be imported."""
    site = tmp_path / "blocker"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)

    def run(modules: str, *args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
        env.update(PYTHONPATH=str(site), RLCORE_TEST_BLOCK=modules)
        return subprocess.run([sys.executable, "-m", "rlcore", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)

    return run


@pytest.mark.parametrize(("blocked", "args", "line"), [
    ("trl", ["run", "--plugin", "sft"], "--plugin sft needs the 'sft' extra (trl is not installed): pip install 'rlcore[sft]'"),
    ("trl", ["run", "--plugin", "pt"], "--plugin pt needs the 'sft' extra (trl is not installed): pip install 'rlcore[sft]'"),
    ("ray", ["run", "--plugin", "grpo", "--use-ray"], "--use-ray needs the 'ray' extra (ray is not installed): pip install 'rlcore[ray]'"),
    ("megatron", ["run", "--plugin", "grpo", "train.engine=megatron"],
     "train.engine=megatron needs the 'megatron' extra (megatron.core is not installed): pip install 'rlcore[megatron]'"),
], ids=["sft", "pt", "ray", "megatron"])
def test_a_missing_extra_is_one_line_before_anything_starts(without, tmp_path, blocked, args, line):
    done = without(blocked, *args, "output_dir=out")
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"rlcore: error: {line}\n"
    assert not (tmp_path / "out").exists()  # nothing started: no demo model, no output_dir


def test_config_validate_names_the_extra_too(without, tmp_path):
    (tmp_path / "sft.yaml").write_text("max_steps: 2\n")
    done = without("trl", "config", "validate", "--plugin", "sft", "--config", "sft.yaml")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["rlcore: error: --plugin sft needs the 'sft' extra (trl is not installed): "
                                        "pip install 'rlcore[sft]'"]


def test_plugins_marks_an_installed_plugin_whose_library_is_not_importable(without):
    done = without("megatron", "plugins", "--json")
    assert done.returncode == 0 and done.stdout.startswith("[\n"), done.stderr
    listed = {row["name"]: row for row in json.loads(done.stdout)}
    assert listed["megatron"]["missing"] == "megatron.core is not importable: pip install 'rlcore[megatron]'"
    assert listed["megatron"]["provides"]["engines"]  # still listed with what it registers
    assert listed["grpo"]["missing"] == ""
    unblocked = {row["name"]: row for row in json.loads(without("", "plugins", "--json").stdout)}
    assert unblocked["megatron"]["missing"] == ""  # nothing blocked: megatron-core is installed here
    done = without("megatron", "plugins")
    table = done.stdout
    assert done.returncode == 0 and re.match(r"\w+ \S+ \(distribution: ", table), table[:200]  # a plugin per block
    assert "  NOT USABLE: megatron.core is not importable: pip install 'rlcore[megatron]'" in table.split("megatron 0.1.0")[1]
