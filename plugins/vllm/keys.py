"""The vllm engine's config keys, added to the sections of the roles it serves (`EngineSpec.keys`): a rollout
section (`rollout:`, a sampler) takes `VLLMRolloutKeys`, a served teacher's `VLLMKeys`. They keep ms-swift's and
TRL's `vllm_` names, at the section's top (`rollout.vllm_max_model_len`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from rlcore.bounds import MAX_TOKENS, MAX_WORKERS


class VLLMKeys(BaseModel):
    """What every vLLM engine takes: its parallelism, memory share, context and engine arguments."""

    vllm_tensor_parallel_size: int = Field(1, ge=1, le=MAX_WORKERS, description="vLLM tensor parallelism per engine (worker)")
    vllm_gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="share of GPU memory vLLM takes")
    vllm_max_model_len: int | None = Field(None, ge=1, le=MAX_TOKENS, description="vLLM context length (prompt + completion)")
    vllm_enforce_eager: bool = Field(False, description="disable CUDA graphs (faster start, slower decode)")
    vllm_engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to vllm.LLM as is")


class VLLMRolloutKeys(VLLMKeys):
    """A rollout engine's keys: where its engine core runs, how requests are seeded, how weights arrive."""

    vllm_in_process: bool = Field(
        True, description="vLLM's engine core in the worker's process (weights load in place); false: its own processes"
    )
    vllm_request_seeds: bool = Field(
        False, description="seed every vLLM request (samples independent of the batch; slower sampling)"
    )
    vllm_weight_replay: bool = Field(
        True, description="replay vLLM's weight loading as one batched copy after a bucket layout's first, traced load"
    )
    vllm_enable_lora: bool = Field(
        False, json_schema_extra={"engine_only": True}, description="with train LoRA: each sync sends only the adapter, which vLLM serves as a LoRA request "
        "(ms-swift's key); output_dir must be visible to the rollout nodes"
    )
    vllm_max_lora_rank: int = Field(16, ge=1, le=MAX_WORKERS, description="vLLM's max_lora_rank (>= train.lora_rank), with vllm_enable_lora")


__all__ = ["VLLMKeys", "VLLMRolloutKeys"]
