"""The role sections every algorithm with a trained policy shares (`train:`, `rollout:`, and a served
`teacher:` is a rollout section too), and the engine options built from them and the run's keys.

GRPO and GKD both read these; an algorithm with a role of its own subclasses them (adding keys) and keeps
the option builders.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .config import RoleConfig


class TrainRoleConfig(RoleConfig):
    """The `train:` section: the policy's train engine."""

    dtype: str = Field("float32", description="float32, bfloat16, float16 or auto")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    lora_rank: int = Field(0, ge=0, description="LoRA rank; 0 trains all weights")
    lora_alpha: int = Field(32, description="LoRA scaling numerator")
    lora_target_modules: list[str] | str = Field("all-linear", description="modules LoRA adapts")
    tensor_model_parallel_size: int = Field(1, ge=1, description="tensor parallel size (engine megatron)")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="pipeline parallel size (engine megatron)")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="further options for the engine")

    def parallel_options(self) -> dict[str, int]:
        """The tensor and pipeline sizes, for an engine that takes them (megatron, or any with sizes > 1)."""
        if self.engine == "megatron" or self.tensor_model_parallel_size * self.pipeline_model_parallel_size > 1:
            return {"tensor_model_parallel_size": self.tensor_model_parallel_size,
                    "pipeline_model_parallel_size": self.pipeline_model_parallel_size}
        return {}


class RolloutRoleConfig(RoleConfig):
    """The `rollout:` section: the engine that generates completions."""

    dtype: str = Field("float32", description="float32, bfloat16, float16 or auto")
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism per rollout engine")
    vllm_gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="share of GPU memory vLLM takes")
    vllm_max_model_len: int | None = Field(None, description="vLLM context length (prompt + completion)")
    vllm_enforce_eager: bool = Field(False, description="disable CUDA graphs (faster start, slower decode)")
    vllm_in_process: bool = Field(
        True, description="vLLM's engine core in the worker's process (weights load in place); false: its own processes"
    )
    vllm_request_seeds: bool = Field(
        False, description="seed every vLLM request (samples independent of the batch; slower sampling)"
    )
    vllm_weight_replay: bool = Field(
        True, description="replay vLLM's weight loading as one batched copy after a bucket layout's first, traced load"
    )
    vllm_engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to vllm.LLM as is")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="further options for the engine")


def train_options(config: Any, model: str) -> dict[str, Any]:
    """The train engine's options: the model, `config.train`'s keys and the run's optimizer keys
    (`learning_rate`, `weight_decay`, `max_grad_norm`, `lr_scheduler_type`, `warmup_steps`, `max_steps`)."""
    train: TrainRoleConfig = config.train
    return {
        "model": model, "dtype": train.dtype, "seed": config.seed, "learning_rate": config.learning_rate,
        "weight_decay": config.weight_decay, "max_grad_norm": config.max_grad_norm,
        "lr_scheduler_type": config.lr_scheduler_type, "warmup_steps": config.warmup_steps,
        "max_steps": config.max_steps, "gradient_checkpointing": train.gradient_checkpointing,
        "lora_rank": train.lora_rank, "lora_alpha": train.lora_alpha, "lora_target_modules": train.lora_target_modules,
        **train.parallel_options(), **train.engine_kwargs,
    }


def rollout_options(section: RoleConfig, model: str, seed: int) -> dict[str, Any]:
    """A generating engine's options from its section (a `RolloutRoleConfig`, or one like it: a served
    teacher's): the model, dtype and seed, the section's `vllm_*` keys when its engine is vllm, then its
    `engine_kwargs`."""
    options: dict[str, Any] = {"model": model, "dtype": section.dtype, "seed": seed}
    if section.engine == "vllm":
        options.update({k: getattr(section, k) for k in type(section).model_fields if k.startswith("vllm_")})
    return {**options, **section.engine_kwargs}


__all__ = ["RolloutRoleConfig", "TrainRoleConfig", "rollout_options", "train_options"]
