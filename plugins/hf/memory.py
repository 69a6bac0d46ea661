"""The hf engines' memory terms (`EngineSpec.memory`), from the options and the model's config.json.

Train: the model in its dtype, torch's AdamW on the params themselves (gradients and both moments in the params'
dtype; LoRA's adapters and their state in float32, as peft keeps them), DDP's gradient buckets across workers, the
activations of one micro-batch, the logits of the loss (the chunked head: 1024 rows at a time), a colocated
teacher. While a colocated role works the engine keeps its weights and optimizer state unless the session offloads
them (`offload_model`, `offload_optimizer`); gradients are always dropped. Rollout: the weights and a KV cache for
every sequence in flight.
"""

from __future__ import annotations

from rlcore.head import CHUNK_ROWS
from rlcore.memory import CUDA_CONTEXT, EngineMemory, Fix, MemoryQuery, dtype_bytes, teacher_terms, train_terms

LORA_RANK = 16  # the rank a "use LoRA" fix proposes


def train_memory(q: MemoryQuery) -> EngineMemory:
    d = dtype_bytes(q.options.get("dtype"), q.model)
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


def train_fixes(q: MemoryQuery) -> tuple[Fix, ...]:
    """Gradient checkpointing, the chunked head, a smaller micro-batch, top-k distillation, LoRA: cheapest first."""
    o, use, fixes = q.options, q.use, []
    if not o.get("gradient_checkpointing"):
        fixes.append(Fix({"gradient_checkpointing": True}, 2, "recompute activations in backward"))
    if not o.get("chunked_lm_head", True):
        fixes.append(Fix({"chunked_lm_head": True}, 2, "the loss's logits 1024 rows at a time"))
    size = use.micro_batch // 2
    while size >= 1 and "accumulation" in use.knobs:  # each halving, largest first; the step's batch stays
        more = use.accumulation * use.micro_batch // size
        fixes.append(Fix({"use.micro_batch": size, "use.accumulation": more}, 3, "fewer sequences per micro-batch, "
                         "more of them per step"))
        size //= 2
    if o.get("teacher") and use.logits == "full":
        fixes.append(Fix({"use.topk": 64}, 4, "the teacher's top-64 log-probs instead of the full vocabulary"))
    if not o.get("lora_rank"):
        fixes.append(Fix({"lora_rank": LORA_RANK}, 5, "LoRA: no gradients or optimizer state for the base weights"))
    return tuple(fixes)


def forward_memory(q: MemoryQuery) -> EngineMemory:
    """A forward-only model (a reference): its weights, one layer's activations and the chunked head's logits of
    `logprob_micro_batch_size` sequences; it keeps its weights on the GPU."""
    s = q.model
    d = dtype_bytes(q.options.get("dtype"), s)
    rows = int(q.options.get("logprob_micro_batch_size", 16)) * q.use.seq_len
    weights = s.params * d
    active = {"cuda context": CUDA_CONTEXT, "weights": weights,
              "activations": rows * s.activation_bytes_per_token(d) // s.layers,
              "logits": min(rows, CHUNK_ROWS) * s.vocab * (d + 4)}
    return EngineMemory(active, {"cuda context": CUDA_CONTEXT, "weights": weights})


def rollout_memory(q: MemoryQuery) -> EngineMemory:
    """transformers' sampling loop: the weights, a KV cache for every sequence in flight at its longest, and the
    last position's logits in float32; asleep it keeps nothing but its context."""
    s = q.model
    d = dtype_bytes(q.options.get("dtype"), s)
    weights = s.params * d
    sequences = max(q.use.sequences, 1)
    active = {"cuda context": CUDA_CONTEXT, "weights": weights,
              "kv cache": sequences * q.use.seq_len * s.kv_bytes_per_token(d), "logits": sequences * s.vocab * 4}
    asleep = q.colocated and q.sleep_level > 0
    resident = {"cuda context": CUDA_CONTEXT} if asleep else dict(active)
    return EngineMemory(active, resident, {"cuda context": CUDA_CONTEXT, "weights": weights})
