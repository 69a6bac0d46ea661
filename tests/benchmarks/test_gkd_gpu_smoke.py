"""`benchmarks/gkd_gpu.py --smoke`: every side's code path (TRL's DistillationTrainer with the installed TRL's
argument names, rlcore's `rlcore run` on examples/ray/gkd/teacher_colocated.yaml with the full vocabulary and with
top-64, the memory sweep through both LM-head paths) on tiny models on the CPU, without vLLM. Marked `prelease`
(minutes: each rlcore side starts Ray): run before a GPU lease with
`python -m pytest -m prelease tests/benchmarks/test_gkd_gpu_smoke.py`, not in the default run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gkd_gpu.py"


@pytest.mark.prelease
def test_the_gkd_benchmark_runs_every_side_on_the_cpu(tmp_path):
    path = tmp_path / "gkd.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--rounds", "1", "--json", str(path)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(path.read_text())
    assert set(record["sides"]) == {"trl", "full", "topk", "memory"}
    assert record["host"]["cpus"] >= 1 and record["host"]["python_loop_s"] > 0  # the machine, for other leases' runs
    sides = {}
    for line in done.stdout.splitlines():
        if line.startswith("{\""):  # the sides, as JSON (TRL prints its logs as Python dicts)
            sides.update(json.loads(line))
    assert set(sides) == {"trl", "full", "topk", "memory"}
    for what in ("trl", "full", "topk"):
        assert sides[what]["tokens_per_s"] > 0 and sides[what]["steps_measured"] == 2
    assert sides["full"]["settings"]["gkd_logits_topk"] is None and sides["topk"]["settings"]["gkd_logits_topk"] == 64
    assert sides["trl"]["settings"]["beta"] == sides["full"]["settings"]["beta"] == 0.5  # the example's, on both
    assert sides["trl"]["settings"]["vllm_gpu_memory_utilization"] == 0.4  # the example's vLLM share, given to TRL
    assert sides["full"]["settings"]["offload_teacher_model"] is True  # the example's default, measured
    for what in ("full", "topk"):
        run = record["rlcore_runs"][what]
        assert run["example"] == "examples/ray/gkd/teacher_colocated.yaml" and run["use_ray"]
        assert record["ratios"][what]["rounds"] == 1
    assert record["rlcore_runs"]["topk"]["other_keys"][0] == "gkd_logits_topk=64"
    memory = sides["memory"]
    assert len(memory["chunked"]["step_s"]) == len(memory["logits"]["step_s"]) == len(memory["lengths"])
    assert "rlcore teacher_colocated.yaml, top-64" in done.stdout and "x TRL by round" in done.stdout  # the table
