"""What an engine is asked and answers for the memory plan (`MemoryQuery`, `EngineMemory`, `Fix`), what an algorithm
says of each role (`RoleUse`), and the terms the train engines share: a decoder trained with Adam, a colocated
teacher, a forward-only model, and the changes that lower them. `rlcore.memory` sums them per GPU and phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .model_shape import ModelShape, dtype_bytes, shape_of

GiB = 1 << 30
# one process's CUDA context, cuBLAS workspaces and the caching allocator's slack on a GPU (torch + NCCL)
CUDA_CONTEXT = GiB // 2
LORA_RANK = 16  # the rank a "use LoRA" fix proposes
# rows of one [chunk, V] logits block the chunked head (rlcore.head) computes at once, unless a call says:
# 1024 x 151,936 x 4 bytes = 0.6 GiB
CHUNK_ROWS = 1024

Phase = Literal["generation", "scoring", "training"]


@dataclass(frozen=True)
class RoleUse:
    """What an algorithm asks of one role per step (its `RoleTrainer.memory_use`): the role's engine and options
    (as its setup builds it), the model it loads (None: it loads none, and its engine is asked with no shape), the
    phase it works in, and the workload's sizes. A forward-only role that works between generation and the update
    (a reference's log-probs, GRPO's reward model) works in `training`: its peak is added to the train role's, an
    upper bound; `scoring` is the phase of roles that score after generation with no training (best-of-N).

    `micro_batch` sequences of at most `seq_len` tokens go through one forward/backward; `sequences` are generated
    at once per GPU of the role (a KV cache engine's batch; an engine spanning several GPUs holds theirs together); `logits` is what a loss asks of the vocabulary (`full`, or `topk` with
    `topk` ids; a colocated teacher's too). `sync` says whether the role sends or receives weights. `knobs` maps
    the workload's names (`micro_batch`, `accumulation`, `topk`) to the config keys that set them, so a fix can
    name them (a smaller micro-batch with more accumulation keeps the step's batch).
    """

    engine: Any
    kind: str
    options: dict[str, Any]
    phase: Phase
    model: str | None = None
    micro_batch: int = 1
    accumulation: int = 1
    seq_len: int = 0
    sequences: int = 0
    logits: Literal["full", "topk"] = "full"
    topk: int = 0
    sync: Literal["send", "receive"] | None = None
    knobs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryQuery:
    """What an engine's memory function is asked: the role, its use, the model's shape and the GPU."""

    role: str
    use: RoleUse
    model: ModelShape | None
    gpu_bytes: int
    workers: int
    colocated: bool
    sleep_level: int = 1
    offload_model: bool = False
    offload_optimizer: bool = False
    bucket_bytes: int = 512 << 20

    @property
    def options(self) -> dict[str, Any]:
        return self.use.options


@dataclass(frozen=True)
class Fix:
    """An option change that lowers an engine's peak: `options` (engine options, or `use.KNOB` for a workload
    knob), `cost` (lower is tried and shown first: 1 costs time, 3 changes the batch, 5 changes what is trained)."""

    options: dict[str, Any]
    cost: int
    why: str = ""


@dataclass(frozen=True)
class EngineMemory:
    """An engine's answer, bytes per component on one of its GPUs: while it works (`active`), while a colocated
    role holds the GPU (`resident`), while weights are synced (`sync`; None: as `resident`)."""

    active: dict[str, int]
    resident: dict[str, int]
    sync: dict[str, int] | None = None
    fixes: tuple[Fix, ...] = ()


def memory_function(plugins: Any, engine: Any, kind: str) -> Callable[[MemoryQuery], EngineMemory] | None:
    """The engine's memory function: its `EngineSpec.memory` (a registered name), or a factory's `memory`."""
    if not isinstance(engine, str):
        return getattr(engine, "memory", None)
    for spec in getattr(plugins, "engines", ()) or ():
        if spec.name == engine and spec.kind == kind:
            return getattr(spec, "memory", None)
    return None


# -- terms the engines share: a decoder's training state and activations ---------------------------------------


def train_terms(q: MemoryQuery, *, grad_bytes: int, moment_bytes: int, master_bytes: int = 0,
                shard_state: int = 1, shards: int = 1, chunk_rows: int = 1024) -> dict[str, int]:
    """The bytes of a decoder trained with Adam on one GPU: weights, gradients, Adam's two moments, master
    weights (per trainable parameter `grad_bytes`, `moment_bytes` for both moments, `master_bytes`), the
    optimizer state split over `shard_state` ranks (a distributed optimizer), the model over `shards` (tensor x
    pipeline); activations of one micro-batch at `seq_len`; the logits of the loss (chunked head: `chunk_rows`
    rows at a time; else [B, T, V] in float32 with its gradient)."""
    s, o = q.model, q.options
    assert s is not None
    d = dtype_bytes(o.get("dtype"))
    rank = int(o.get("lora_rank") or 0)
    trainable = s.lora_params(rank, o.get("lora_target_modules", "all-linear")) if rank else s.params
    adapter_bytes = 4 if rank else d  # peft keeps the adapters in float32
    tokens = q.use.micro_batch * q.use.seq_len
    terms = {
        "weights": s.params * d // shards + (trainable * adapter_bytes // shards if rank else 0),
        "gradients": trainable * (4 if rank else grad_bytes) // shards,
        "optimizer state": trainable * (8 if rank else moment_bytes) // shards // shard_state,
        "master weights": 0 if rank else trainable * master_bytes // shards // shard_state,
        "activations": tokens * s.activation_bytes_per_token(d, bool(o.get("gradient_checkpointing"))) // shards,
    }
    rows = min(tokens, chunk_rows) if o.get("chunked_lm_head", True) else tokens
    terms["logits"] = rows * s.vocab * (d + 8) // shards
    return terms


def teacher_terms(q: MemoryQuery, chunk_rows: int = 1024) -> tuple[dict[str, int], dict[str, int]]:
    """A colocated teacher in a train worker (option `teacher`: {engine, options, offload}): its weights and its
    forward's output over the student's micro-batch (top-k ids and log-probs; the full vocabulary as its hidden
    states for the chunked heads, or as [B, T, V] float32 log-probs: an offloaded teacher's, or without the chunked
    head), while training; what stays resident while another role works (nothing when `offload`)."""
    teacher = q.options.get("teacher")
    if not teacher:
        return {}, {}
    shape = shape_of(teacher.get("options", {}).get("model"))
    if shape is None:
        raise LookupError("teacher")
    d = dtype_bytes(teacher.get("options", {}).get("dtype"))
    weights = shape.params * d
    tokens = q.use.micro_batch * q.use.seq_len
    if q.use.logits == "topk":  # int64 ids and float32 log-probs
        part, out = "teacher top-k", tokens * q.use.topk * 12
    elif q.options.get("chunked_lm_head", True) and not teacher.get("offload"):
        # its last hidden states; both heads applied `chunk_rows` rows at a time (two float32 [rows, V] blocks)
        part, out = "teacher hidden + chunk", tokens * shape.hidden * d + 2 * min(tokens, chunk_rows) * shape.vocab * 4
    else:
        part, out = "teacher logits", tokens * shape.vocab * 4
    active = {"teacher weights": weights, part: out}
    return active, ({} if teacher.get("offload") else {"teacher weights": weights})


def train_fixes(q: MemoryQuery) -> tuple[Fix, ...]:
    """A train engine's fixes, cheapest first: gradient checkpointing, the chunked head, a smaller micro-batch with
    more accumulation (each halving; the algorithm's knobs name the keys), a colocated teacher's top-k, LoRA."""
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


def forward_terms(q: MemoryQuery, shards: int = 1, chunk_rows: int = 1024) -> EngineMemory:
    """A forward-only model (a reference) over `shards` GPUs: its weights, one layer's activations and the chunked
    head's logits of `logprob_micro_batch_size` sequences; it keeps its weights on the GPU."""
    s = q.model
    d = dtype_bytes(q.options.get("dtype"))
    rows = int(q.options.get("logprob_micro_batch_size", 16)) * q.use.seq_len
    weights = s.params * d // shards
    active = {"cuda context": CUDA_CONTEXT, "weights": weights,
              "activations": rows * s.activation_bytes_per_token(d) // s.layers // shards,
              "logits": min(rows, chunk_rows) * s.vocab * (d + 4) // shards}
    return EngineMemory(active, {"cuda context": CUDA_CONTEXT, "weights": weights})
