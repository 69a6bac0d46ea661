"""The two-role `bandit` algorithm: learns locally and on Ray (CPU workers), resumes exactly, from `rlcore` alone."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import rlcore
from rlcore_example import bandit
from rlcore_example.bandit import BanditConfig


def run(tmp_path: Path, name: str, *overrides: str, use_ray: bool = False) -> dict:
    plugins = rlcore.load_plugins()
    config = rlcore.load_config(BanditConfig, overrides=[f"output_dir={tmp_path / name}", *overrides])
    return plugins.algorithms.get("bandit").trainer(config, plugins, use_ray=use_ray).fit()


def test_written_only_against_rlcore_public_names():
    tree = ast.parse(Path(bandit.__file__).read_text())
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {name for module, name in imported if module == "rlcore"} <= set(rlcore.__all__)
    assert not any(module and module.startswith("rlcore.") for module, _ in imported)
    assert len(Path(bandit.__file__).read_text().splitlines()) < 80  # a whole algorithm of two roles fits in 80 lines


def test_learns_the_paying_arm_in_this_process(tmp_path):
    metrics = run(tmp_path, "local")
    assert metrics["step"] == 30 and metrics["p_best"] > 0.9
    lines = (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 31))
    assert json.loads(lines[0])["reward"] < 0.5  # it started near 1/4


def test_resume_continues_exactly(tmp_path):
    whole = run(tmp_path, "whole", "max_steps=20")
    run(tmp_path, "parts", "max_steps=10")
    resumed = run(tmp_path, "parts", "max_steps=20", "resume=auto")
    assert resumed["p_best"] == whole["p_best"]


def test_runs_on_ray_as_in_process(tmp_path, local_ray):
    """One actor per role on Ray's CPUs; the seeds are per sample, so the run is the in-process one."""
    on_ray = run(tmp_path, "ray", "max_steps=8", "rollout.cpus=1", "train.cpus=1", use_ray=True)
    local = run(tmp_path, "here", "max_steps=8")
    assert on_ray["p_best"] == local["p_best"] and on_ray["step"] == 8
