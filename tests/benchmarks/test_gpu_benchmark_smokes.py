"""Each GPU benchmark's `--smoke`: every side on a tiny model on the CPU (vLLM's place taken by the hf engine, TRL
without vLLM), after each side's GPU config is built there (rlcore's: the shipped example with the shared keys,
loaded and checked as `rlcore config validate` does); the results JSON at `--json` and the final table. A benchmark
that fails here would fail on the GPU after a lease's start. Marked `prelease` (minutes: each rlcore side starts Ray):
`python -m pytest -m prelease tests/benchmarks/test_gpu_benchmark_smokes.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def smoke(script: str, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    path = tmp_path / f"{script}.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke", "--json", str(path), *extra],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {path}" in done.stdout
    return json.loads(path.read_text()), done.stdout


@pytest.mark.prelease
@pytest.mark.ray
def test_grpo_gpu_runs_the_example_and_trl_in_rounds_and_compares_their_settings(tmp_path):
    """rlcore's side is `rlcore run` on examples/ray/grpo/colocate.yaml with the shared keys only; TRL gets the values
    rlcore resolved (the example's loss, clipping, vLLM memory share); the sides alternate, a ratio per round."""
    result, out = smoke("grpo_gpu", tmp_path, "--rounds", "2")
    assert result["smoke"] and result["rlcore"]["steps_measured"] == result["trl"]["steps_measured"] == 2
    assert result["rlcore"]["settings"]["num_generations"] == result["trl"]["settings"]["num_generations"] == 4
    assert [sorted(r) for r in result["rounds"]] == [["rlcore", "trl"]] * 2
    ratio = result["ratio"]
    assert len(ratio["per_round"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    run = result["rlcore_runs"]["rlcore"]
    assert run["example"] == "examples/ray/grpo/colocate.yaml" and run["use_ray"]
    assert {k.split("=")[0] for k in run["shared_keys"]} == {
        "model", "dataset", "reward_funcs", "num_generations", "max_completion_length", "per_device_train_batch_size",
        "gradient_accumulation_steps", "max_steps"}
    assert not any(k.startswith(("dtype", "train.dtype", "rollout.dtype")) for k in run["shared_keys"] + run["other_keys"])
    for key in ("loss_type", "epsilon_high", "vllm_gpu_memory_utilization"):  # the example's, on both sides
        assert result["rlcore"]["settings"][key] == result["trl"]["settings"][key]
    assert result["trl"]["settings"]["loss_type"] == "grpo" and result["trl"]["settings"]["epsilon_high"] == 0.28
    assert "ratio to TRL, median" in out and "examples/ray/grpo/colocate.yaml" in out  # the table


@pytest.mark.prelease
@pytest.mark.ray
def test_grpo_gpu_runs_rlcore_packing_arms_beside_trl(tmp_path):
    """--arms: rlcore's side becomes one side per packing arm of its train engine (the example with
    train.padding_free set), each checked as a config first and compared with TRL, round by round."""
    result, out = smoke("grpo_gpu", tmp_path, "--rounds", "1", "--lengths", "mixed", "--arms", "padded,varlen")
    assert [sorted(r) for r in result["rounds"]] == [["rlcore-padded", "rlcore-varlen", "trl"]]
    assert set(result["ratios"]) == {"rlcore padded / TRL", "rlcore varlen / TRL"}
    assert all(each["rounds"] == 1 for each in result["ratios"].values())
    assert "train.padding_free=false" in result["rlcore_runs"]["rlcore-padded"]["other_keys"]
    assert "train.padding_free=true" in result["rlcore_runs"]["rlcore-varlen"]["other_keys"]
    settings = result["settings"]
    assert settings["rlcore-padded"]["padding"].startswith("right-padded")
    assert settings["rlcore-varlen"]["padding"].startswith("padding-free")
    assert "train_mfu" in result["rlcore-varlen"] and "rlcore varlen / TRL" in out


@pytest.mark.prelease
@pytest.mark.ray
def test_sft_gpu_runs_both_sides_on_the_same_tokens_and_profiles_a_step_of_each(tmp_path):
    """--profile reaches TRL's training_step in rlcore's Ray worker as in TRL's own process."""
    result, out = smoke("sft_gpu", tmp_path, "--profile", "--rounds", "1")
    rlcore, trl = result["sides"]["rlcore"], result["sides"]["trl"]
    assert rlcore["window_tokens"] == trl["window_tokens"] > 0
    assert "ratio_median_step" in result and "rlcore / TRL median step" in out
    assert result["ratio"]["rounds"] == 1 and result["rlcore_runs"]["rlcore"]["example"] == "examples/ray/sft/multi_node.yaml"
    for key in ("packing", "gradient_checkpointing", "lr_scheduler_type", "warmup_steps"):  # the example's, on both
        assert rlcore["settings"][key] == trl["settings"][key]
    assert result["host"]["cpus"] >= 1 and result["host"]["python_loop_s"] > 0
    for side in ("rlcore", "trl"):
        profile = result["sides"][side]["profile"]
        assert profile["seconds"] > 0 and "aten::" in profile["table"], profile
        assert f"profile-{side}: one training_step under torch's profiler" in out


@pytest.mark.prelease
@pytest.mark.ray
def test_sample_gpu_runs_the_raw_side_and_one_worker(tmp_path):
    result, out = smoke("sample_gpu", tmp_path, "--rounds", "1")
    assert set(result["sides"]) == {"raw", "rlcore1"}
    assert result["sides"]["raw"]["candidates"] == result["sides"]["rlcore1"]["candidates"] == 32
    assert "one_worker_vs_raw" in result["ratios"] and "one_worker_vs_raw" in out
    assert result["ratio_rounds"]["one_worker_vs_raw"]["rounds"] == 1
    assert result["rlcore_runs"]["rlcore1"]["example"] == "examples/ray/sample/sampling.yaml"


@pytest.mark.prelease
def test_megatron_gpu_part_one_runs_each_train_engine(tmp_path):
    pytest.importorskip("megatron.core")
    result, _ = smoke("megatron_gpu", tmp_path, "--part", "one", "--rounds", "1")
    runs = result["one_gpu_qwen2_0.5b_colocated"]["runs"]
    assert all(r["run"]["example"] == "examples/ray/grpo/colocate_device_groups.yaml" for r in runs)
    assert [r["engine"] for r in runs] == ["megatron", "megatron-bf16", "hf"]
    assert all("failed" not in r and r["steps_measured"] == 2 for r in runs)
    ratios = result["one_gpu_qwen2_0.5b_colocated"]["ratios"]
    assert [r["engine"] for r in ratios] == ["megatron", "megatron-bf16"] and all(r["train_x_hf"] > 0 for r in ratios)
