"""benchmarks/memory_measure.py and memory_plan.py on the CPU: NVML's samples and the probe's phases and pids, in the
files' own formats, attributed to phases and roles; the results' rows beside a real `rlcore plan`; `--predict-only`;
and the probe plugin in a real run."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GiB = 1 << 30


@pytest.fixture(scope="module")
def bench(request):
    """memory_measure and memory_plan, imported from benchmarks/ (a folder of scripts, not a package)."""
    sys.path.insert(0, str(BENCHMARKS))
    request.addfinalizer(lambda: sys.path.remove(str(BENCHMARKS)))
    return importlib.import_module("memory_measure"), importlib.import_module("memory_plan")


def write_samples(path: Path, rows: list[tuple[float, int, int, dict[int, int | None]]],
                  parents: dict[int, list[int]]) -> None:
    """A sampler's file: a GPU row per tuple (t, gpu, used, pids), a pid's parents the first time it shows, and a last
    line cut short as when the sampler is terminated mid-write."""
    seen, lines = set(), []
    for t, gpu, used, pids in rows:
        lines.append(json.dumps({"t": t, "gpu": gpu, "used": used, "pids": pids}))  # pids become strings, as NVML's
        for pid in sorted(pids.keys() - seen):
            seen.add(pid)
            lines.append(json.dumps({"t": t, "pid": pid, "parents": parents.get(pid, [])}))
    path.write_text("\n".join(lines) + '\n{"t": 99.0, "gpu": 0, "us')


def test_samples_and_probe_files_give_each_phase_its_device_and_role_peaks(bench, tmp_path):
    measure, _ = bench
    driver, train, rollout, engine_core, stranger = 100, 201, 202, 303, 999
    probe = {"driver": driver, "roles": {"train": [train], "rollout": [rollout]},
             "phases": [{"phase": "generate", "start": 1.0, "end": 2.0}, {"phase": "reward", "start": 2.0, "end": 2.5},
                        {"phase": "logprobs", "start": 2.5, "end": 3.0}, {"phase": "train", "start": 3.0, "end": 4.0},
                        {"phase": "sync", "start": 4.0, "end": 5.0}, {"phase": "generate", "start": 5.0, "end": 6.0}]}
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    write_samples(tmp_path / "nvml.jsonl", [
        (0.1, 0, 1 * GiB, {}),  # before the run: the baseline
        (0.2, 1, 2 * GiB, {stranger: 2 * GiB}),
        (1.5, 0, 40 * GiB, {train: 1 * GiB, rollout: 30 * GiB, engine_core: 8 * GiB}),  # a child of the rollout worker
        (2.2, 0, 60 * GiB, {rollout: 59 * GiB}),  # reward: no plan phase
        (2.7, 0, 9 * GiB, {train: 4 * GiB, rollout: 4 * GiB}),
        (3.5, 0, 21 * GiB, {train: 16 * GiB, rollout: 1 * GiB, driver: None}),  # None: NVML cannot say
        (3.6, 1, 3 * GiB, {stranger: 2 * GiB}),
        (4.5, 0, 7 * GiB, {train: 3 * GiB, rollout: 3 * GiB}),
        (5.5, 0, 45 * GiB, {train: 1 * GiB, rollout: 35 * GiB, engine_core: 8 * GiB}),
    ], parents={engine_core: [rollout, 50, 1]})
    rows, parents = measure.read_samples(tmp_path / "nvml.jsonl")
    assert len(rows) == 9 and parents[engine_core] == [rollout, 50, 1]
    baseline = measure.baseline_of(rows, started=0.0)
    assert baseline == {0: 1 * GiB, 1: 2 * GiB}
    seen = measure.attribute(rows, parents, json.loads((tmp_path / "probe.json").read_text()), baseline)
    assert seen["pids"] == {str(driver): "driver", str(train): "train", str(rollout): "rollout",
                            str(engine_core): "rollout", str(stranger): f"pid {stranger}"}
    phases = seen["phases"]
    assert set(phases) == {"generation", "training", "weight sync"}  # reward's 60 GiB belongs to none
    assert phases["generation"]["0"] == {"device_peak": 44 * GiB, "roles": {"train": 1 * GiB, "rollout": 43 * GiB},
                                         "samples": 2}  # the second generate window holds the peak
    assert phases["training"]["0"]["device_peak"] == 20 * GiB
    assert phases["training"]["0"]["roles"] == {"train": 16 * GiB, "rollout": 4 * GiB, "driver": 0}
    assert phases["training"]["1"] == {"device_peak": 1 * GiB, "roles": {f"pid {stranger}": 2 * GiB}, "samples": 1}
    assert phases["weight sync"]["0"]["roles"] == {"train": 3 * GiB, "rollout": 3 * GiB} and "note" not in seen
    apart = measure.attribute(rows, parents, {**probe, "roles": {"train": [7], "rollout": [8]}}, baseline)
    assert apart["phases"]["training"]["0"]["roles"] == {f"pid {train}": 16 * GiB, f"pid {rollout}": 4 * GiB, "driver": 0}
    assert apart["note"].startswith("no pid NVML lists is a role's worker")


def test_results_rows_set_the_plan_beside_the_measured_peaks(bench, tmp_path):
    measure, plan = bench
    case = plan.CASES["grpo"]
    models = {key: plan.config_only(tmp_path / "model", shape) for key, shape in case["models"].items()}
    keys = {**plan.case_keys(case, models, {"prompts": "p.jsonl", "chats": "c.jsonl"}, tmp_path / "out"),
            "gpu_memory_gib": 140}
    predicted = plan.predict(case, keys)  # `rlcore plan --use-ray --json` of the case, as the benchmark asks it
    by_phase = {row["phase"]: row for row in predicted["rows"]}
    generation = {t["role"]: 0 for t in by_phase["generation"]["terms"]}
    for term in by_phase["generation"]["terms"]:
        generation[term["role"]] += term["bytes"]
    peak = by_phase["generation"]["peak_bytes"]
    measured = {"phases": {"generation": {"0": {"device_peak": int(peak / 1.2), "samples": 7, "roles": {
        "train": generation["train"], "rollout": int(generation["rollout"] / 0.97), "pid 999": GiB}}}}}
    rows = measure.compare(predicted, measured, gpus=[0])
    assert [(r["gpu"], r["phase"]) for r in rows] == [(0, "generation"), (0, "training"), (0, "weight sync")]
    gen = rows[0]
    assert gen["predicted_gib"] == round(peak / GiB, 2) and gen["device_peak_gib"] == round(peak / 1.2 / GiB, 2)
    assert gen["error"] == 0.2 and gen["meets_target"] is False  # over by 20%
    assert gen["roles"]["train"]["error"] == 0.0 and gen["roles"]["train"]["meets_target"] is True
    assert gen["roles"]["rollout"]["error"] == -0.03 and gen["roles"]["rollout"]["meets_target"] is True
    assert gen["roles"]["pid 999"] == {"components": {}, "predicted_gib": 0.0, "measured_gib": 1.0, "error": -1.0,
                                       "meets_target": False}
    assert set(gen["roles"]["rollout"]["components"]) == {t["component"] for t in by_phase["generation"]["terms"]
                                                          if t["role"] == "rollout"}
    assert "device_peak_gib" not in rows[1] and "measured_gib" not in rows[1]["roles"]["train"]  # nothing measured
    assert measure.error_of(95, 100) == {"error": -0.05, "meets_target": True}
    assert measure.error_of(94, 100)["meets_target"] is False and measure.error_of(111, 100)["meets_target"] is False
    lines = measure.table({"grpo": {"rows": rows}})
    assert lines[1].split()[:4] == ["grpo", "0", "generation", "device"] and lines[1].split()[-1] == "False"
    assert [line[32:42].strip() for line in lines[2:2 + len(gen["roles"])]] == list(gen["roles"])

    report = importlib.import_module("report")  # benchmarks/README.md's generator reads the results as written
    cases = {"grpo": {"example": case["example"], "rows": rows},
             "overflow": {"rows": [], "predicted_fits": False, "out_of_memory": True, "overflow_shown": True},
             "fitted": {"rows": [], "predicted_fits": True, "returncode": 0, "out_of_memory": False,
                        "fit_changes": ["sleep_level=1"], "fit_shown": True}}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "memory_plan-2026-12-05-nvidia-h200.json").write_text(json.dumps(
        {"benchmark": "memory_plan", "commit": "0123456789abcdef", "cases": cases, "met": measure.met(cases),
         "target": plan.TARGET}))
    text = report.render(tmp_path / "results")
    assert "grpo GPU 0 generation: not met; overflow refused by the plan, out of memory when forced: met" in text
    assert "fitted --fit's change runs within the GPU: met" in text
    assert measure.table({"fitted": cases["fitted"]})[1] == ("fitted         --fit applied sleep_level=1; its plan fits: "
                                                            "True; the run finished: True, out of memory: False")


def test_predict_only_prints_and_writes_each_cases_plan(tmp_path):
    path = tmp_path / "predicted.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "memory_plan.py"), "--predict-only", "--only", "grpo",
                           "--json", str(path)], capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("grpo               fits on 140 GiB: True")
    case = json.loads(path.read_text())["cases"]["grpo"]
    assert case["fits"] is True and set(case["peaks_gib"]) == {"generation", "training", "weight sync"}


def test_the_probe_loaded_as_with_loads_it_writes_the_trainers_phases_and_roles(bench, tmp_path):
    """The probe file in a GRPO run (the tiny model on the CPU; no Ray, so each role's process is this one: that Ray's
    pids are the workers' own is tests/core/test_roles.py's): its phases are the trainer's, its roles the session's."""
    from rlcore import load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer
    from rlcore.testing import build_tiny_model

    measure, _ = bench
    out = tmp_path / "probe.json"
    (tmp_path / "probe_run.py").write_text(measure.PROBE.format(out=str(out)))
    plugins = load_plugins(extra=(str(tmp_path / "probe_run.py"),))
    config = GRPOConfig(model=str(build_tiny_model(tmp_path / "tiny")), output_dir=str(tmp_path / "run"),
                        max_completion_length=8, per_device_train_batch_size=8, num_generations=4, max_steps=2)
    GRPOTrainer(config, plugins).fit()
    probe = json.loads(out.read_text())
    assert probe["driver"] == os.getpid() and probe["roles"] == {"train": [os.getpid()], "rollout": [os.getpid()]}
    phases = [p["phase"] for p in probe["phases"]]
    assert {"generate", "logprobs", "train", "sync"} <= set(phases) and phases.index("generate") < phases.index("train")
    assert all(p["start"] <= p["end"] for p in probe["phases"])
    assert all(a["end"] <= b["end"] for a, b in zip(probe["phases"], probe["phases"][1:]))  # written as each ends
