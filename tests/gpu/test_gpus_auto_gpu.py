"""`gpus: auto` (every role's default) on a GPU machine: `rlcore run --plugin grpo model=M dataset=D` with no `gpus`
trains and generates on the GPU in bfloat16, and says so; with --use-ray colocated roles share the visible GPUs;
`config show` prints the counts the run takes. The CPU side (fake GPUs on Ray, the resolution) is
tests/core/test_devices.py.

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_gpus_auto_gpu.py`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlcore.testing import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TIMEOUT_S = 420


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-fp32"))  # float32: auto gives bf16 on a GPU


def rlcore(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "rlcore", *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def one_step(model: str, out: str) -> list[str]:
    return ["--plugin", "grpo", f"model={model}", "dataset=tiny:toy", "reward_funcs=[toy]", "max_steps=1",
            "max_completion_length=8", "per_device_train_batch_size=8", "num_generations=4", f"output_dir={out}"]


def test_a_run_with_no_gpus_and_no_ray_takes_the_gpu_in_bfloat16(model, tmp_path):
    args = one_step(model, str(tmp_path / "run"))
    shown = rlcore("config", "show", *args).stdout
    assert "gpus: 1" in shown[shown.index("\ntrain:"):shown.index("\nrollout:")]  # show resolves as the run does
    done = rlcore("run", *args)
    assert "rlcore: train: 1 worker, in this process on cuda (gpus: auto), engine hf, bfloat16" in done.stderr
    assert "rlcore: rollout: 1 worker, in this process on cuda (gpus: auto), engine hf, bfloat16" in done.stderr
    kept = rlcore("run", *one_step(model, str(tmp_path / "cpu")), "train.gpus=0", "rollout.gpus=0")
    assert "rlcore: train: 1 worker, in this process, engine hf, float32" in kept.stderr  # gpus: 0 keeps the CPU


def test_with_ray_colocated_roles_share_every_visible_gpu(model, tmp_path):
    n = torch.cuda.device_count()
    ranks = "0" if n == 1 else f"0-{n - 1}"
    done = rlcore("run", "--use-ray", *one_step(model, str(tmp_path / "run")), "colocate_groups=[[train, rollout]]")
    workers = f"{n} worker{'s' if n > 1 else ''}"
    assert f"rlcore: train: {workers}, GPU {ranks} (gpus: auto; shared with rollout), engine hf, bfloat16" in done.stderr
    assert f"rlcore: rollout: {workers}, GPU {ranks} (gpus: auto; shared with train), engine hf, bfloat16" in done.stderr
