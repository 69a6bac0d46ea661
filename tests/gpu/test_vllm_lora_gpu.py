"""`rollout.vllm_enable_lora` on one GPU: GRPO with LoRA on the hf and the megatron train engine, vLLM colocated on
Ray, each sync sending only the adapter (a PEFT folder under output_dir/adapter_sync) that vLLM serves as a fresh
LoRARequest on the checkpoint's base weights. After every synced step vLLM's top-k log-probs must equal the train
engine's (check_weight_sync, within bf16's tolerance) and must have moved away from the first ones by far more than
that tolerance, so a stale adapter, a wrong module name or a dropped LoRA request fails here.

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_vllm_lora_gpu.py` (one vLLM per test: run.sh runs each
test in its own pytest process).
"""

from __future__ import annotations

import json

import pytest

from rlcore import hookimpl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("vllm-lora") / "tiny", hidden_size=256, num_heads=4,
                                num_kv_heads=2, intermediate_size=512, dtype="bfloat16"))


class AdapterProbe:
    """After every synced step: vLLM (with the adapter) scores the probe sequence as the train engine does, its
    scores moved from the first sync's, and output_dir/adapter_sync holds exactly one folder, a PEFT adapter."""

    def __init__(self):
        self.initial = None
        self.diffs: list[float] = []
        self.moved: list[float] = []
        self.folders: list[str] = []

    def topk(self, trainer):
        import torch

        sequence = trainer.experience.probe_sequence()
        self.diffs.append(trainer.session.check_weight_sync("train", "rollout", sequence))  # raises on a mismatch
        topk = trainer.session["rollout"].prompt_topk_logprobs([sequence], 4)
        return torch.as_tensor(topk.logprobs[0, 1 : len(sequence)]).float()

    @hookimpl
    def rlcore_train_start(self, trainer):
        self.initial = self.topk(trainer)

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        if step >= trainer.config.max_steps:  # the last step is not synced
            return
        self.moved.append(float((self.topk(trainer) - self.initial).abs().max()))
        (folder,) = (trainer.output_dir / "adapter_sync").iterdir()
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        self.folders.append(folder.name)


@pytest.mark.parametrize("engine", ["hf", "megatron"])
def test_vllm_serves_the_synced_adapter_with_the_train_engines_log_probs(model_dir, tmp_path, engine):
    import ray

    from rlcore import config_model, load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    GRPOConfig = config_model(GRPOConfig)  # with the engines' keys (vllm_*)

    if engine == "megatron":
        pytest.importorskip("megatron.core")
    config = GRPOConfig(
        model=model_dir, output_dir=str(tmp_path / "run"), max_steps=3, learning_rate=5e-2,
        num_generations=4, per_device_train_batch_size=16, max_completion_length=32,
        colocate_groups=[["train", "rollout"]], sleep_level=1, offload_optimizer=True,
        train={"gpus": 1, "engine": engine, "dtype": "bfloat16", "lora_rank": 8, "lora_alpha": 16},
        rollout={"gpus": 1, "engine": "vllm", "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.2,
                 "vllm_enforce_eager": True, "vllm_max_model_len": 256, "vllm_enable_lora": True,
                 "vllm_max_lora_rank": 8},
    )
    plugins, probe = load_plugins(), AdapterProbe()
    plugins.register(probe, "adapter-probe")
    try:
        trainer = GRPOTrainer(config, plugins, use_ray=True)
        trainer.fit()
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in rows)
    assert all(0 < r["weight_sync/bytes"] < 5 << 20 for r in rows[:-1])  # the adapter alone, not the model
    assert len(probe.moved) == 2 and len(set(probe.folders)) == 2  # a new folder each sync, the one before removed
    # the adapter arrived: vLLM moved far more than it differs from the train engine
    assert max(probe.moved) > 4 * max(probe.diffs), (probe.moved, probe.diffs)
    assert not (tmp_path / "run" / "adapter_sync").exists()  # the last sync's folder is gone with the run
    assert (tmp_path / "run" / "final" / "adapter" / "adapter_config.json").is_file()
