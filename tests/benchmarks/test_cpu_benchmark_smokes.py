"""The CPU benchmarks run end to end, briefly (marked `prelease`: out of the default suite's time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.prelease
def test_gkd_cpu_runs_rlcore_and_reads_back_the_settings_it_compares(tmp_path):
    out = tmp_path / "gkd_cpu.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gkd_cpu.py"), "--only", "rlcore", "--repeats", "1",
                    "--steps", "3", "--warmup", "1", "--quiet", "--json", str(out)], check=True, cwd=tmp_path, timeout=600)
    result = json.loads(out.read_text())
    settings, side = result["settings"]["rlcore"], result["sides"]["rlcore"]
    # the optimizer options the run's train engine was given, read back (GKD leaves them at their defaults)
    assert (settings["adam_beta1"], settings["adam_beta2"], settings["adam_epsilon"]) == (0.9, 0.999, 1e-8)
    assert side["step_s"] > 0 and side["completion_tokens_per_step"] > 0 and len(side["per_run_step_s"]) == 1
