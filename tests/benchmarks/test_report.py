"""benchmarks/report.py: benchmarks/README.md is generated from benchmarks/results/*.json and checked in current."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "report.py"


def load_report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checked_in_benchmarks_readme_is_what_the_results_give():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + "\n(run `python benchmarks/report.py` and commit benchmarks/README.md)"


def test_check_fails_on_a_stale_readme(tmp_path, monkeypatch):
    report = load_report()
    monkeypatch.setattr(report, "README", tmp_path / "README.md")
    (tmp_path / "README.md").write_text("# a figure copied by hand\n")
    assert report.main(["--check"]) == 1
    assert report.main([]) == 0
    assert report.main(["--check"]) == 0


def test_old_and_new_result_shapes_and_the_latest_run(tmp_path):
    report = load_report()
    results = tmp_path / "results"
    results.mkdir()

    def write(name, record):
        (results / name).write_text(json.dumps(record))

    # the day's first run has no call letter; -b is a later one the same day
    write("grpo_gpu-colocate-2026-12-01-nvidia-h200.json",
          {"kind": "nvidia-h200", "date": "2026-12-01", "commit": "b10b863", "work": "8 prompts", "ratio": 0.464,
           "target": "ratio <= 0.5 (rlcore / TRL step time)", "met": True})
    write("grpo_gpu-colocate-2026-12-04-nvidia-h200.json",
          {"kind": "nvidia-h200", "date": "2026-12-04", "commit": "aaaaaaa", "work": "8 prompts",
           "ratio": {"per_round": [0.5, 0.52], "median": 0.51, "min": 0.5, "max": 0.52, "rounds": 2},
           "target": "ratio <= 0.5 (rlcore / TRL step time)", "met": False})
    write("grpo_gpu-colocate-2026-12-04-nvidia-h200-b.json",
          {"kind": "nvidia-h200", "date": "2026-12-04", "commit": "0123456789abcdef", "work": "8 prompts, newest",
           "ratio": {"per_round": [0.41, 0.45, 0.43], "median": 0.43, "min": 0.41, "max": 0.45, "rounds": 3},
           "target": "ratio <= 0.5 (rlcore / TRL step time)", "met": True})
    write("dtype_gpu-2026-12-04-nvidia-h200.json",
          {"kind": "nvidia-h200", "date": "2026-12-04", "commit": "fedcba9", "example": "examples/ray/grpo/colocate.yaml",
           "ratio_auto_over_float32": [0.61, 0.66], "median_ratio": 0.635, "spread": [0.61, 0.66]})
    write("gkd_gpu-2026-12-04-nvidia-h200.json",
          {"kind": "nvidia-h200", "date": "2026-12-04", "commit": "1234567", "targets_base": "trl",
           "sides": {"trl": {"tokens_per_s": 100.0}, "full": {"tokens_per_s": 150.0}},
           "ratios": {"full": {"per_round": [1.4, 1.6], "median": 1.5, "min": 1.4, "max": 1.6, "rounds": 2}},
           "targets": {"full": "median >= 1.5"}, "met": {"full": True}})
    write("sft_cpu.json", {"rlcore_step_s": 0.5, "ratio_step": 0.988, "steps": 23, "warmup": 3,
                           "environment": {"cpu_count": 2}, "date": "2026-12-01 00:00:26"})
    (results / "notes.txt").write_text("not a result")

    text = report.render(results)
    latest = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| [")}
    grpo = latest["[grpo_gpu-colocate](#grpo_gpu-colocate)"]
    assert "grpo_gpu-colocate-2026-12-04-nvidia-h200-b.json" in grpo and "0123456" in grpo
    assert "0.43 (spread 0.41-0.45 over 3 rounds: 0.41, 0.45, 0.43)" in grpo and "| met |" in grpo
    dtype = latest["[dtype_gpu](#dtype_gpu)"]
    assert "auto over float32 (median): 0.635 (spread 0.61-0.66 over 2 rounds: 0.61, 0.66)" in dtype
    gkd = latest["[gkd_gpu](#gkd_gpu)"]
    assert "full: 1.5 (spread 1.4-1.6 over 2 rounds: 1.4, 1.6)" in gkd and "full: met" in gkd
    assert "ratio_step: 0.988" in latest["[sft_cpu](#sft_cpu)"] and "CPU, 2 cores" in latest["[sft_cpu](#sft_cpu)"]
    assert "example examples/ray/grpo/colocate.yaml" in text
    assert "[notes.txt](results/notes.txt)" in text
    # every run is listed under its benchmark, newest first
    section = text.split("## grpo_gpu-colocate")[1]
    order = [name for name in ("-2026-12-04-nvidia-h200-b.json", "-2026-12-04-nvidia-h200.json",
                               "-2026-12-01-nvidia-h200.json")]
    positions = [section.index(f"[grpo_gpu-colocate{name}]") for name in order]
    assert positions == sorted(positions)
    assert report.render(results) == text  # the files alone decide the output
