"""The user's path with `train.engine=megatron` on one GPU: each shipped example that has a train role, from
`rlcore run`, scaled to one GPU, colocated with vLLM (sleeping at level 1 or 2 while megatron trains, megatron
offloaded while vLLM generates), on Ray and in one process; then `--resume` from a megatron checkpoint.

Every run must finish with the weight-sync check on (it raises after the first sync if vLLM did not get
the trained weights), log the number that should move (GRPO's reward, GKD's JSD) at every step, and say
which engine trained. One vLLM per process: `bash tests/gpu/run.sh megatron` runs each test in its own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray"
VLLM = ["rollout.dtype=bfloat16", "rollout.vllm_gpu_memory_utilization=0.25", "rollout.vllm_enforce_eager=true",
        "rollout.vllm_max_model_len=512"]
MEGATRON = ["train.engine=megatron", "train.dtype=bfloat16", "check_weight_sync=true"]
ONE_GPU = ["train.gpus=1", "rollout.gpus=1"]
GROUP_OF_ONE = ["device_groups.nproc_per_node=1", "device_groups.{group}.ranks=[0]"]


@pytest.fixture(scope="module")
def models():
    """A student and a bigger teacher, their random weights drawn on the GPU, and the two data sets."""
    from rlcore.testing import build_tiny_model

    root = Path(tempfile.gettempdir()) / "rlcore-gpu-tests" / "megatron-cli"
    # head_dim 64 and 96, as in test_gkd_gpu.py (vLLM 0.26's warm-up failed at head_dim 16)
    shape = dict(num_heads=4, num_kv_heads=2, num_layers=4, dtype="bfloat16", device="cuda")
    student = build_tiny_model(root / "student", hidden_size=256, intermediate_size=512, **shape)
    teacher = build_tiny_model(root / "teacher", hidden_size=384, intermediate_size=768, seed=3, **shape)
    math_rows = [{"prompt": f"What is {a} + {b}?", "solution": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
    (root / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in math_rows))
    chat_rows = [{"prompt": f"Say {i}:", "completion": f"number {i}"} for i in range(64)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_rows))
    return {"student": str(student), "teacher": str(teacher), "math": str(root / "math.jsonl"),
            "chat": str(root / "chat.jsonl")}


def rlcore(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "rlcore", "run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "RLCORE_DEBUG": "1"})
    assert done.returncode == 0, f"rlcore run exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    assert "megatron" in done.stderr  # the session's description names the train engine
    return done


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def grpo_args(models, out: Path, example: str, steps: int = 3) -> list[str]:
    return ["--plugin", "grpo", "--config", str(EXAMPLES / "grpo" / example), f"model={models['student']}",
            f"dataset={models['math']}", f"output_dir={out}", f"max_steps={steps}", "learning_rate=5e-3",
            "reward_funcs=[toy,format]", "num_generations=4", "per_device_train_batch_size=8",
            "max_completion_length=32", *MEGATRON, *VLLM]


GRPO_LAYOUTS = {
    "colocate-ray-sleep1": (["--use-ray"], "colocate.yaml", ONE_GPU + ["sleep_level=1"]),
    "colocate-one-process-sleep2": ([], "colocate.yaml", ONE_GPU + ["sleep_level=2"]),
    "colocate_device_groups-ray": (["--use-ray"], "colocate_device_groups.yaml",
                                   [a.format(group="policy_group") for a in GROUP_OF_ONE]),
}


@pytest.mark.parametrize("layout", list(GRPO_LAYOUTS))
def test_grpo_examples_with_megatron(models, tmp_path, layout):
    flags, example, scale = GRPO_LAYOUTS[layout]
    out = tmp_path / "run"
    rlcore([*flags, *grpo_args(models, out, example), *scale], tmp_path)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["reward"]) and r["grad_norm"] > 0 and math.isfinite(r["loss"]) for r in rows)


GKD_LAYOUTS = {
    "teacher_colocated-full": ("teacher_colocated.yaml", ONE_GPU + ["teacher_model={teacher}"]),
    "teacher_colocated-top8": ("teacher_colocated.yaml", ONE_GPU + ["teacher_model={teacher}", "gkd_logits_topk=8"]),
    "teacher_shared": ("teacher_shared.yaml", [a.format(group="shared_group") for a in GROUP_OF_ONE] + [
        "teacher.model={teacher}", "teacher.vllm_gpu_memory_utilization=0.2", "teacher.vllm_enforce_eager=true",
        "teacher.vllm_max_model_len=512", "gkd_logits_topk=8"]),
}


@pytest.mark.parametrize("layout", list(GKD_LAYOUTS))
def test_gkd_examples_with_megatron(models, tmp_path, layout):
    example, scale = GKD_LAYOUTS[layout]
    out = tmp_path / "run"
    rlcore(["--use-ray", "--plugin", "gkd", "--config", str(EXAMPLES / "gkd" / example), f"model={models['student']}",
            f"dataset={models['chat']}", f"output_dir={out}", "max_steps=3", "learning_rate=1e-3",
            "per_device_train_batch_size=8", "gradient_accumulation_steps=1", "max_completion_length=32",
            *MEGATRON, *VLLM, *(a.format(**models) for a in scale)], tmp_path)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["jsd"] > 0 and math.isfinite(r["jsd"]) and r["grad_norm"] > 0 for r in rows)


def test_resume_from_a_megatron_checkpoint(models, tmp_path):
    out = tmp_path / "run"
    rlcore(["--use-ray", *grpo_args(models, out, "colocate.yaml", steps=2), *ONE_GPU, "save_steps=2"], tmp_path)
    assert (out / "checkpoint-2").is_dir()
    rlcore(["--use-ray", "--resume", *grpo_args(models, out, "colocate.yaml", steps=3), *ONE_GPU, "save_steps=2"],
                  tmp_path)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]  # step 3 from the checkpoint, each step once
    assert math.isfinite(rows[-1]["reward"]) and rows[-1]["grad_norm"] > 0
