"""GRPO with the vLLM rollout engine on the GPU: colocated in one process (sleep/wake, offload, in-process
sync), with a tensor-parallel rollout, and separate on Ray (NCCL broadcast, async generation). Each test
starts a vLLM of its own and one process holds one in-process vLLM: tests/gpu/run.sh runs each in its own
pytest process.
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlcore.plugins.hf.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("grpo-gpu") / "tiny", hidden_size=256, num_heads=4,
                                num_kv_heads=2, intermediate_size=512, dtype="bfloat16"))


def run(model_dir, tmp_path, use_ray=False, rollout=None, **overrides):
    from rlcore import load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    overrides = {"max_steps": 3, **overrides}
    config = GRPOConfig(
        model=model_dir, output_dir=str(tmp_path / "run"), learning_rate=1e-5,
        num_generations=4, per_device_train_batch_size=16, max_completion_length=32,
        train={"gpus": 1, "dtype": "bfloat16"},
        rollout={"gpus": 1, "engine": "vllm", "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.2,
                 "vllm_enforce_eager": True, "vllm_max_model_len": 256, **(rollout or {})},
        **overrides,
    )
    trainer = GRPOTrainer(config, load_plugins(), use_ray=use_ray)
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return trainer, rows


def test_colocated_vllm_sleeps_offloads_and_syncs_in_process(model_dir, tmp_path):
    trainer, rows = run(model_dir, tmp_path, colocate_groups=[["train", "rollout"]], sleep_level=1,
                        offload_model=True, offload_optimizer=True)
    assert trainer.roles.transport == "in_process" and trainer.roles.colocated
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["weight_sync/seconds"] > 0 for r in rows[:-1]) and all(r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["completions/mean_length"] > 0
    # check_weight_sync (on by default) compared vLLM's and the trainer's log-probs after the first sync


def needs_two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")


def test_rollout_tensor_parallel_2_loads_weights_in_every_worker(model_dir, tmp_path):
    needs_two_gpus()
    trainer, rows = run(model_dir, tmp_path, rollout={"gpus": 2, "vllm_tensor_parallel_size": 2}, max_steps=2)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["weight_sync/seconds"] > 0
    # check_weight_sync compared the TP=2 engine's log-probs with the trainer's after the first sync


@pytest.mark.parametrize("in_process", [True, False], ids=["in_actor", "core_processes"])
def test_separate_async_on_ray_broadcasts_over_nccl(model_dir, tmp_path, in_process):
    needs_two_gpus()
    import ray

    try:
        trainer, rows = run(model_dir, tmp_path, use_ray=True, async_generate=True,
                            rollout={"vllm_in_process": in_process})
    finally:
        ray.shutdown()
    assert trainer.roles.transport == "nccl"
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["off_policy_steps"] == 1.0 for r in rows)
    assert rows[0]["weight_sync/gb_per_s"] > 0 and rows[-1]["grad_norm"] > 0
