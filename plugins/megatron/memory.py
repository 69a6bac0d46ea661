"""The megatron engine's memory terms (`EngineSpec.memory`).

Each GPU holds 1 / (tensor x pipeline) of the model. With `master_weights` (megatron's mixed precision) it keeps
bf16 weights, an fp32 gradient buffer (`main_grad`, 4 bytes a parameter), fp32 master weights (4) and Adam's two
fp32 moments (8); `use_distributed_optimizer` splits the master weights and moments over the data-parallel ranks.
Without master weights AdamW steps on the bf16 params (gradients and moments in bf16). Activations are split over
the tensor ranks. Offloading and sleeping follow the hf engine's.
"""

from __future__ import annotations

from rlcore.memory import (
    CHUNK_ROWS, CUDA_CONTEXT, EngineMemory, MemoryQuery, dtype_bytes, forward_terms, teacher_terms, train_fixes, train_terms,
)


def _split(q: MemoryQuery) -> tuple[int, int]:
    tp = int(q.options.get("tensor_model_parallel_size", 1) or 1)
    pp = int(q.options.get("pipeline_model_parallel_size", 1) or 1)
    return tp * pp, max(q.workers // (tp * pp), 1)


def train_memory(q: MemoryQuery) -> EngineMemory:
    shards, dp = _split(q)
    d = dtype_bytes(q.options.get("dtype"))
    master = bool(q.options.get("master_weights", True)) and d < 4
    state = dp if q.options.get("use_distributed_optimizer", True) else 1
    terms = train_terms(q, grad_bytes=4 if master else d, moment_bytes=8 if master else 2 * d,
                        master_bytes=4 if master else 0, shard_state=state, shards=shards)
    teacher_active, teacher_resident = teacher_terms(q)
    teacher_active = {k: v // shards for k, v in teacher_active.items()}
    teacher_resident = {k: v // shards for k, v in teacher_resident.items()}
    active = {"cuda context": CUDA_CONTEXT, **terms, **teacher_active}
    resident = {"cuda context": CUDA_CONTEXT, **teacher_resident}
    if not q.offload_model:
        resident["weights"] = terms["weights"]
    if not q.offload_optimizer:
        resident["optimizer state"] = terms["optimizer state"]
        resident["master weights"] = terms["master weights"]
    sync = {"cuda context": CUDA_CONTEXT, "weights": terms["weights"], "optimizer state": terms["optimizer state"],
            "master weights": terms["master weights"], "sync buckets": 2 * q.bucket_bytes, **teacher_resident}
    return EngineMemory(active, resident, sync, train_fixes(q))


def megatron_forward_memory(q: MemoryQuery) -> EngineMemory:
    return forward_terms(q, shards=_split(q)[0], chunk_rows=CHUNK_ROWS)
