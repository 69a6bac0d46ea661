"""The megatron engine's config keys, added to the sections of its train and forward roles (`EngineSpec.keys`):
how many GPUs one model replica spans (the rest of a role's GPUs are data parallel), as Megatron and ms-swift name
them (`train.tensor_model_parallel_size`). Expert parallelism is an option (`train.engine_kwargs`)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from rlcore.bounds import MAX_WORKERS


class MegatronKeys(BaseModel):
    tensor_model_parallel_size: int = Field(1, ge=1, le=MAX_WORKERS, json_schema_extra={"engine_only": True}, description="tensor parallel size (engine megatron)")
    pipeline_model_parallel_size: int = Field(1, ge=1, le=MAX_WORKERS, json_schema_extra={"engine_only": True}, description="pipeline parallel size (engine megatron)")


__all__ = ["MegatronKeys"]
