"""GRPO with a teacher's KL (ms-swift's OPD-RL) on one GPU, in the shape of ms-swift's opd_rl_colocate.yaml: vLLM
rollout colocated with the train workers, the teacher offloaded inside them, one generation per prompt, on the hf
and the megatron train engines. Each test starts a vLLM engine of its own: run each in its own pytest process, e.g.
`python3 -m pytest -m gpu tests/gpu/test_grpo_teacher_gpu.py -k hf`.
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    root = tmp_path_factory.mktemp("opd-gpu")
    shape = dict(num_heads=4, num_kv_heads=2, dtype="bfloat16")
    student = build_tiny_model(root / "student", hidden_size=256, intermediate_size=512, **shape)
    teacher = build_tiny_model(root / "teacher", hidden_size=384, intermediate_size=768, seed=3, **shape)
    return str(student), str(teacher)


@pytest.mark.parametrize("engine", ["hf", "megatron"])
def test_opd_rl_with_vllm_colocated_and_the_teacher_offloaded_in_the_train_workers(models, tmp_path, engine):
    from rlcore import config_model, load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    GRPOConfig = config_model(GRPOConfig)  # with the engines' keys (vllm_*)

    student, teacher = models
    vllm = {"gpus": 1, "engine": "vllm", "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.2,
            "vllm_enforce_eager": True, "vllm_max_model_len": 256}
    config = GRPOConfig(
        model=student, teacher_model=teacher, teacher_kl_coef=1.0, offload_teacher_model=True, num_generations=1,
        output_dir=str(tmp_path / "run"), max_steps=3, learning_rate=1e-3, per_device_train_batch_size=8,
        max_completion_length=32, train={"gpus": 1, "dtype": "bfloat16", "engine": engine}, rollout=vllm,
        colocate_groups=[["train", "rollout"]], offload_model=True, offload_optimizer=True, sleep_level=1,
    )
    trainer = GRPOTrainer(config, load_plugins())
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert trainer.session.roles == ["train", "rollout"] and trainer.session.colocated("train", "rollout")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["teacher_kl"] > 0 and r["grad_norm"] > 0 for r in rows)  # the teacher's term is the only signal
