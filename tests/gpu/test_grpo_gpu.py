"""GRPO with the vLLM rollout engine on the GPU: colocated in one process (sleep/wake, offload, in-process
sync), with a tensor-parallel rollout, and separate on Ray (NCCL broadcast, async generation). Each test
starts a vLLM of its own and one process holds one in-process vLLM: tests/gpu/run.sh runs each in its own
pytest process.
"""

from __future__ import annotations

import json

import pytest

from rlcore import hookimpl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("grpo-gpu") / "tiny", hidden_size=256, num_heads=4,
                                num_kv_heads=2, intermediate_size=512, dtype="bfloat16"))


class SyncProbe:
    """After every sync: the rollout engine's top-k log-probs of a fixed sequence must match the trainer's
    (check_weight_sync) and must have moved away from the initial weights', so the trained weights arrived."""

    def __init__(self):
        self.initial = None
        self.moved: list[float] = []
        self.ipc_packed = False  # an in-process engine packed CUDA IPC buckets for workers of its own

    def topk(self, trainer):
        import torch

        sequence = trainer.experience.probe_sequence()
        trainer.session.check_weight_sync("train", "rollout", sequence)  # raises on a mismatch; wakes the KV cache
        topk = trainer.session["rollout"].prompt_topk_logprobs([sequence], 4)  # [1, T, 4]
        return torch.as_tensor(topk.logprobs[0, 1 : len(sequence)]).float()

    @hookimpl
    def rlcore_train_start(self, trainer):
        self.initial = self.topk(trainer)

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        if step < trainer.config.max_steps:  # the last step is not synced
            self.moved.append(float((self.topk(trainer) - self.initial).abs().max()))
        engine = getattr(trainer.session["rollout"], "engine", None)  # without Ray, the worker itself
        self.ipc_packed = self.ipc_packed or getattr(engine, "_ipc_sender", None) is not None


def run(model_dir, tmp_path, use_ray=False, rollout=None, probe=None, hooks=(), **overrides):
    from rlcore import config_model, load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    GRPOConfig = config_model(GRPOConfig)  # with the engines' keys (vllm_*)

    overrides = {"max_steps": 3, "learning_rate": 1e-2 if probe else 1e-5, **overrides}
    config = GRPOConfig(
        model=model_dir, output_dir=str(tmp_path / "run"),
        num_generations=4, per_device_train_batch_size=16, max_completion_length=32,
        train={"gpus": 1, "dtype": "bfloat16"},
        rollout={"gpus": 1, "engine": "vllm", "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.2,
                 "vllm_enforce_eager": True, "vllm_max_model_len": 256, **(rollout or {})},
        **overrides,
    )
    plugins = load_plugins()
    if probe is not None:
        plugins.register(probe, "sync-probe")
    for i, hook in enumerate(hooks):
        plugins.register(hook, f"hook-{i}")
    trainer = GRPOTrainer(config, plugins, use_ray=use_ray)
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return trainer, rows


def test_colocated_vllm_sleeps_offloads_and_syncs_in_process(model_dir, tmp_path):
    trainer, rows = run(model_dir, tmp_path, colocate_groups=[["train", "rollout"]], sleep_level=1,
                        offload_model=True, offload_optimizer=True)
    assert trainer.session.transports[("train", "rollout")] == "in_process"
    assert trainer.session.colocated("train", "rollout")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["weight_sync/seconds"] > 0 for r in rows[:-1]) and all(r["grad_norm"] > 0 for r in rows)
    assert rows[-1]["completions/mean_length"] > 0
    # check_weight_sync (on by default) compared vLLM's and the trainer's log-probs after the first sync


def test_colocated_on_ray_hands_weights_over_cuda_ipc(model_dir, tmp_path):
    import ray

    probe = SyncProbe()
    try:
        trainer, rows = run(model_dir, tmp_path, use_ray=True, probe=probe, colocate_groups=[["train", "rollout"]],
                            sleep_level=1, offload_optimizer=True)
    finally:
        ray.shutdown()
    assert trainer.session.transports[("train", "rollout")] == "cuda_ipc"
    assert trainer.session.ipc_sources[("train", "rollout")] == [[0]]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["weight_sync/gb_per_s"] > 0
    # a sync that moved the rollout further than check_weight_sync tolerates, and the check passed: it arrived
    assert len(probe.moved) == 2 and max(probe.moved) > 0.5


def needs_two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")


def test_rollout_tensor_parallel_2_loads_weights_in_every_worker(model_dir, tmp_path):
    """One process: the trainer on GPU 0, vLLM's two TP workers in processes of their own on GPUs 0 and 1;
    each maps the trainer's CUDA IPC buffer (the second over peer access)."""
    needs_two_gpus()
    probe = SyncProbe()
    trainer, rows = run(model_dir, tmp_path, probe=probe, rollout={"gpus": 2, "vllm_tensor_parallel_size": 2})
    assert probe.ipc_packed  # the IPC path, not the CPU copy
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["weight_sync/seconds"] > 0
    assert len(probe.moved) == 2 and max(probe.moved) > 0.5


def test_vllm_worker_process_takes_weights_over_cuda_ipc(model_dir, tmp_path):
    """One process and one GPU, vLLM's worker in a process of its own: a bucket travels as a CUDA IPC handle."""
    probe = SyncProbe()
    trainer, rows = run(model_dir, tmp_path, probe=probe, rollout={"vllm_in_process": False})
    assert probe.ipc_packed
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert len(probe.moved) == 2 and max(probe.moved) > 0.5


def test_colocated_on_ray_ipc_into_vllm_worker_processes(model_dir, tmp_path):
    """On Ray, colocated, vLLM's worker in a process of its own: the train rank on its GPU packs, the vLLM
    worker maps the handle (the path a tensor-parallel vLLM's workers take, one per GPU)."""
    import ray

    probe = SyncProbe()
    try:
        trainer, rows = run(model_dir, tmp_path, use_ray=True, probe=probe, colocate_groups=[["train", "rollout"]],
                            sleep_level=1, rollout={"vllm_in_process": False})
    finally:
        ray.shutdown()
    assert trainer.session.transports[("train", "rollout")] == "cuda_ipc"
    assert trainer.session.ipc_sources[("train", "rollout")] == [[0]]
    assert len(probe.moved) == 2 and max(probe.moved) > 0.5


@pytest.mark.parametrize("in_process", [True, False], ids=["in_actor", "core_processes"])
def test_separate_async_on_ray_broadcasts_over_nccl(model_dir, tmp_path, in_process):
    needs_two_gpus()
    import ray

    probe = SyncProbe()
    try:
        trainer, rows = run(model_dir, tmp_path, use_ray=True, async_generate=True, probe=probe,
                            rollout={"vllm_in_process": in_process})
    finally:
        ray.shutdown()
    assert trainer.session.transports[("train", "rollout")] == "nccl"
    # a sync that moved the rollout further than check_weight_sync tolerates, and the check passed: it arrived
    assert len(probe.moved) == 2 and max(probe.moved) > 0.5
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["off_policy_steps"] == 1.0 for r in rows)
    assert rows[0]["weight_sync/gb_per_s"] > 0 and rows[-1]["grad_norm"] > 0


class KillRollout:
    """SIGKILL of rollout rank 0's process once step `after` ended (its sync done): max_restarts must bring it back."""

    def __init__(self, after: int = 1):
        self.after, self.killed = after, None

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        import os
        import signal

        from rlcore.runtime.workers import remote_group

        if step == self.after:
            self.killed = remote_group(trainer.session["rollout"], "rollout").infos[0]["pid"]
            os.kill(self.killed, signal.SIGKILL)


def restarted_run(model_dir, tmp_path, **overrides):
    """`run` on Ray with max_restarts=1, the rollout worker killed after step 1, the sync probe checking each later
    sync; the killed pid, the probe and the rows."""
    import ray

    killer, probe = KillRollout(), SyncProbe()
    try:
        trainer, rows = run(model_dir, tmp_path, use_ray=True, probe=probe, hooks=(killer,), max_restarts=1, **overrides)
    finally:
        ray.shutdown()
    return trainer, killer, probe, rows


def test_a_lost_vllm_rollout_worker_is_restarted_and_takes_the_weights_over_nccl(model_dir, tmp_path):
    """Separate train and vLLM rollout (NCCL broadcast): the rollout worker killed after step 1 is restarted at step
    2's generation, joins a new broadcast group with the train rank, takes the trained weights and generates again;
    the later syncs arrive (the probe), every step is logged once and the restart counted once."""
    needs_two_gpus()
    trainer, killer, probe, rows = restarted_run(model_dir, tmp_path)
    assert killer.killed and trainer.session.transports[("train", "rollout")] == "nccl"
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["restarts/rollout"] for r in rows] == [0, 1, 1]
    assert len(probe.moved) == 2 and max(probe.moved) > 0.5


def test_a_lost_colocated_vllm_rollout_worker_sleeps_again_and_takes_weights_over_cuda_ipc(model_dir, tmp_path):
    """Colocated train and vLLM rollout on one GPU (sleep_level 1, CUDA IPC): the rollout worker killed after step 1
    comes back on the same GPU, released what its role released, is paired again for IPC and takes the weights."""
    trainer, killer, probe, rows = restarted_run(model_dir, tmp_path, colocate_groups=[["train", "rollout"]],
                                                 sleep_level=1)
    assert killer.killed and trainer.session.transports[("train", "rollout")] == "cuda_ipc"
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["restarts/rollout"] for r in rows] == [0, 1, 1]
    assert len(probe.moved) == 2 and max(probe.moved) > 0.5
