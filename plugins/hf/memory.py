"""The hf engines' memory terms (`EngineSpec.memory`), from the options and the model's config.json.

Train: the model in its dtype, torch's AdamW on the params themselves (gradients and both moments in the params'
dtype; LoRA's adapters and their state in float32, as peft keeps them), DDP's gradient buckets across workers, the
activations of one micro-batch, the logits of the loss (the chunked head: 1024 rows at a time), a colocated
teacher. While a colocated role works the engine keeps its weights and optimizer state unless the session offloads
them (`offload_model`, `offload_optimizer`); gradients are always dropped. Rollout: the weights and a KV cache for
every sequence in flight.
"""

from __future__ import annotations

from rlcore.memory import (
    CHUNK_ROWS, CUDA_CONTEXT, EngineMemory, MemoryQuery, dtype_bytes, forward_terms, teacher_terms, train_fixes, train_terms,
)


def train_memory(q: MemoryQuery) -> EngineMemory:
    d = dtype_bytes(q.options.get("dtype"))
    terms = train_terms(q, grad_bytes=d, moment_bytes=2 * d, chunk_rows=CHUNK_ROWS)
    if q.workers > 1:  # DDP's gradient buckets beside the gradients
        terms["ddp buckets"] = terms["gradients"]
    teacher_active, teacher_resident = teacher_terms(q)
    active = {"cuda context": CUDA_CONTEXT, **terms, **teacher_active}
    resident = {"cuda context": CUDA_CONTEXT, **teacher_resident}
    if not q.offload_model:
        resident["weights"] = terms["weights"]
    if not q.offload_optimizer:
        resident["optimizer state"] = terms["optimizer state"]
    sync = {"cuda context": CUDA_CONTEXT, "weights": terms["weights"], "optimizer state": terms["optimizer state"],
            "sync buckets": 2 * q.bucket_bytes, **teacher_resident}
    return EngineMemory(active, resident, sync, train_fixes(q))


def forward_memory(q: MemoryQuery) -> EngineMemory:
    """A forward-only model (a reference): see `rlcore.memory.forward_terms`."""
    return forward_terms(q, chunk_rows=CHUNK_ROWS)


def rollout_memory(q: MemoryQuery) -> EngineMemory:
    """transformers' sampling loop: the weights, a KV cache for every sequence in flight at its longest, and the
    last position's logits in float32; asleep it keeps nothing but its context."""
    s = q.model
    d = dtype_bytes(q.options.get("dtype"))
    weights = s.params * d
    sequences = max(q.use.sequences, 1)
    active = {"cuda context": CUDA_CONTEXT, "weights": weights,
              "kv cache": sequences * q.use.seq_len * s.kv_bytes_per_token(d), "logits": sequences * s.vocab * 4}
    asleep = q.colocated and q.sleep_level > 0
    resident = {"cuda context": CUDA_CONTEXT} if asleep else dict(active)
    return EngineMemory(active, resident, {"cuda context": CUDA_CONTEXT, "weights": weights})
