"""`benchmarks/memory_plan.py --predict-only`: every case's plan for an H200 from config.json alone, on the CPU, so a
case meant to fit fits and the overflow case is predicted to overflow before a GPU lease. Marked `prelease`:
`python -m pytest -m prelease tests/benchmarks/test_memory_plan_predict.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.prelease
def test_every_case_but_the_overflow_is_predicted_to_fit_an_h200(tmp_path):
    path = tmp_path / "predicted.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "memory_plan.py"), "--predict-only", "--json", str(path)],
                          capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(path.read_text())["cases"]
    assert {name: case["fits"] for name, case in cases.items()} == {
        "grpo": True, "gkd": True, "grpo-lora": True, "grpo-megatron": True, "grpo-megatron-lora": True,
        "gkd-topk": True, "sft": True, "sampling": True, "grpo-7b-lora": True, "overflow": False,
        "fitted": True}  # --fit's plan: the overflow case with the first change that fits
    assert cases["overflow"]["peaks_gib"]["training"] > 140
    assert set(cases["grpo"]["peaks_gib"]) == {"generation", "training", "weight sync"}
    assert set(cases["sampling"]["peaks_gib"]) == {"generation", "scoring"}
