"""Memory plans: each GPU's predicted peak in each phase of a step (generation, training, weight sync), before
anything loads, from the resource plan and the models' config.json.

The terms live with the engines: an `EngineSpec.memory` (or a factory's `memory` attribute) is given a
`MemoryQuery` (the role's engine options, what the algorithm asks of it per step as a `RoleUse`, the model's
`ModelShape`, the GPU's size, the session's offload settings) and answers an `EngineMemory`: the bytes of each
component while the role works, while a colocated role holds the GPU, and during a weight sync, plus the option
changes that would lower them (`Fix`). Core only sums the roles on each GPU per phase and compares the peak with
the GPU's memory; an engine that gives no terms is shown as unknown, never as zero.

The GPU's memory is the config's `gpu_memory_gib` where set (a CPU-only machine plans for remote GPUs), else this
machine's GPU (nvidia-smi: torch.cuda's figure without a CUDA context in the driver), else 80 GiB (an A100/H100's;
an H200 has 140 GiB: `gpu_memory_gib: 140`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .model_shape import ModelShape, dtype_bytes, shape_of

GiB = 1 << 30
PHASES = ("generation", "training", "weight sync")
DEFAULT_GPU_GIB = 80.0
# one process's CUDA context, cuBLAS workspaces and the caching allocator's slack on a GPU (torch + NCCL)
CUDA_CONTEXT = GiB // 2
LORA_RANK = 16  # the rank a "use LoRA" fix proposes

Phase = Literal["generation", "training"]


@dataclass(frozen=True)
class RoleUse:
    """What an algorithm asks of one role per step (its `RoleTrainer.memory_use`): the role's engine and options
    (as its setup builds it), the model it loads, the phase it works in, and the workload's sizes.

    `micro_batch` sequences of at most `seq_len` tokens go through one forward/backward; `sequences` are generated
    at once (a KV cache engine's batch); `logits` is what a loss asks of the vocabulary (`full`, or `topk` with
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


# -- the plan -------------------------------------------------------------------------------------------------


@dataclass
class GpuPhase:
    """One GPU (or identical GPUs) in one phase: each role's components and the sum; None where unknown."""

    gpus: tuple[int, ...]
    phase: str
    terms: list[tuple[str, str, int | None]]
    total: int

    @property
    def peak(self) -> int:
        return sum(b for _, _, b in self.terms if b is not None)

    @property
    def unknown(self) -> list[str]:
        return sorted({role for role, _, b in self.terms if b is None})

    @property
    def fits(self) -> bool:
        return self.peak <= self.total

    def largest(self) -> tuple[str, str, int]:
        role, component, size = max(((r, c, b) for r, c, b in self.terms if b is not None), key=lambda t: t[2])
        return role, component, size


@dataclass
class MemoryPlan:
    """Every GPU's predicted peak per phase, with the GPU's memory it is set against."""

    rows: list[GpuPhase]
    gpu_bytes: int
    source: str
    fixes: dict[str, tuple[Fix, ...]] = field(default_factory=dict)  # per role
    notes: list[str] = field(default_factory=list)

    @property
    def over(self) -> list[GpuPhase]:
        return [row for row in self.rows if not row.fits]

    @property
    def fits(self) -> bool:
        return not self.over

    def peak(self) -> int:
        return max((row.peak for row in self.rows), default=0)

    def table(self) -> str:
        """The plan as text: per GPU and phase, each component, the peak and the headroom."""
        lines = [f"memory plan: GPU memory {gib(self.gpu_bytes)} ({self.source})"]
        for row in self.rows:
            head = self.gpu_bytes - row.peak
            unknown = f" + unknown ({', '.join(row.unknown)})" if row.unknown else ""
            state = "OVER" if head < 0 else "ok"
            lines.append(f"GPU {_ranges(row.gpus)} {row.phase}: peak {gib(row.peak)}{unknown} of {gib(self.gpu_bytes)}, "
                         f"headroom {gib(head)} [{state}]")
            for role, component, size in row.terms:
                lines.append(f"    {role:<10} {component:<28} {'unknown' if size is None else gib(size)}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"gpu_bytes": self.gpu_bytes, "source": self.source, "fits": self.fits, "rows": [
            {"gpus": list(r.gpus), "phase": r.phase, "peak_bytes": r.peak, "unknown": r.unknown,
             "terms": [{"role": role, "component": c, "bytes": b} for role, c, b in r.terms]} for r in self.rows]}


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def gpu_memory(config: Any) -> tuple[int, str]:
    """The GPU's memory in bytes and where it was read: `gpu_memory_gib` where set, else this machine's first
    visible GPU (NVML through nvidia-smi, as torch.cuda.mem_get_info would read it, without making a CUDA context
    in the driver), else 80 GiB."""
    given = getattr(config, "gpu_memory_gib", None)
    if given:
        return int(given * GiB), "gpu_memory_gib"
    found = _local_gpu()
    if found is not None:
        return found
    return int(DEFAULT_GPU_GIB * GiB), f"default {DEFAULT_GPU_GIB:g} GiB; set gpu_memory_gib"


def _local_gpu() -> tuple[int, str] | None:
    """(total bytes, name) of the first GPU CUDA_VISIBLE_DEVICES shows; None without nvidia-smi or a GPU."""
    import os
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if smi is None or visible == "":
        return None
    first = (visible or "0").split(",")[0].strip()
    try:
        out = subprocess.run([smi, f"--id={first}", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        mib, name = out.strip().splitlines()[0].split(",", 1)
        return int(float(mib)) << 20, f"nvidia-smi: {name.strip()}"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def plan_memory(config: Any, resource_plan: Any, uses: dict[str, RoleUse], plugins: Any,
                gpu_bytes: int | None = None, source: str = "") -> MemoryPlan:
    """Sum each GPU's roles per phase (those some role on the GPU works in). A role works in its `RoleUse.phase`;
    in another phase it keeps what its engine says stays resident; in `weight sync`, the roles that send or receive
    hold their `sync` terms."""
    if gpu_bytes is None:
        gpu_bytes, source = gpu_memory(config)
    answers: dict[str, EngineMemory | None] = {}
    notes: list[str] = []
    for role, use in uses.items():
        ranks = resource_plan.ranks_of(role) if role in resource_plan.roles else ()
        if not ranks:
            continue
        shape = shape_of(use.model)
        fn = memory_function(plugins, use.engine, use.kind)
        if fn is None:
            answers[role] = None
            engine = use.engine if isinstance(use.engine, str) else getattr(use.engine, "__name__", use.engine)
            notes.append(f"{role}: engine {engine} reports no memory terms (shown as unknown)")
            continue
        if shape is None:
            answers[role] = None
            notes.append(f"{role}: {use.model or 'the model'}'s config.json cannot be read here (shown as unknown)")
            continue
        colocated = any(set(ranks) & set(resource_plan.ranks_of(r)) for r in uses if r != role and r in resource_plan.roles)
        query = MemoryQuery(
            role=role, use=use, model=shape, gpu_bytes=gpu_bytes, workers=len(ranks), colocated=colocated,
            sleep_level=getattr(config, "sleep_level", 1), offload_model=getattr(config, "offload_model", False),
            offload_optimizer=getattr(config, "offload_optimizer", False),
            bucket_bytes=int(getattr(config, "weight_sync_bucket_mb", 512)) << 20)
        try:
            answers[role] = fn(query)
        except LookupError as exc:  # a model the engine reads beside its own (a colocated teacher) is not readable
            answers[role] = None
            notes.append(f"{role}: the {exc.args[0] if exc.args else 'other'} model's config.json cannot be read here "
                         "(shown as unknown)")
    by_gpu: dict[tuple, list[int]] = {}
    rows: list[GpuPhase] = []
    for rank in resource_plan.gpu_ranks:
        roles = tuple(r for r in resource_plan.roles_on(rank) if r in answers)
        if not roles:
            continue
        working = {uses[r].phase for r in roles} | ({"weight sync"} if any(uses[r].sync for r in roles) else set())
        for phase in (p for p in PHASES if p in working):  # the phases some role on this GPU works in
            terms: list[tuple[str, str, int | None]] = []
            for role in roles:
                answer, use = answers[role], uses[role]
                if answer is None:
                    terms.append((role, "(unknown)", None))
                    continue
                if phase == "weight sync":
                    part = answer.sync if use.sync and answer.sync is not None else answer.resident
                else:
                    part = answer.active if use.phase == phase else answer.resident
                terms += [(role, component, size) for component, size in part.items() if size]
            key = (phase, tuple(terms))
            if key in by_gpu:
                by_gpu[key].append(rank)
            else:
                by_gpu[key] = [rank]
                rows.append(GpuPhase((rank,), phase, terms, gpu_bytes))
    for row in rows:
        row.gpus = tuple(by_gpu[(row.phase, tuple(row.terms))])
    rows.sort(key=lambda r: (r.gpus, PHASES.index(r.phase)))
    fixes = {role: answer.fixes for role, answer in answers.items() if answer is not None}
    return MemoryPlan(rows, gpu_bytes, source, fixes, notes)


# -- what fits ------------------------------------------------------------------------------------------------


def option_key(config: Any, role: str, option: str, knobs: dict[str, str]) -> str | None:
    """The config key that sets a role's engine option (`train.gradient_checkpointing`, `train.engine_kwargs.X`, a
    top-level key), or a workload knob (`use.micro_batch`: the algorithm's key); None where the config has none."""
    if option.startswith("use."):
        return knobs.get(option[4:])
    section = getattr(config, role, None)
    if section is not None and option in type(section).model_fields:
        return f"{role}.{option}"
    if option in type(config).model_fields:
        return option
    if section is not None and "engine_kwargs" in type(section).model_fields:
        return f"{role}.engine_kwargs.{option}"
    return None


def candidate_changes(config: Any, plan: MemoryPlan, uses: dict[str, RoleUse]) -> list[tuple[int, dict[str, Any], str]]:
    """Config changes that may lower the peak, cheapest first: the session's offloads (core's keys), then each
    engine's fixes as config keys. Each is (cost, {key: value}, why)."""
    out: list[tuple[int, dict[str, Any], str]] = []
    colocated = any(len(row.terms) and len({r for r, _, _ in row.terms}) > 1 for row in plan.rows)
    if colocated:
        if not getattr(config, "offload_optimizer", True):
            out.append((1, {"offload_optimizer": True}, "the optimizer state leaves the GPU while another role works"))
        if not getattr(config, "offload_model", True):
            out.append((1, {"offload_model": True}, "the train weights leave the GPU while another role works"))
        if getattr(config, "sleep_level", 1) == 0:
            out.append((1, {"sleep_level": 1}, "vLLM frees its weights and KV cache while another role works"))
    for role, fixes in plan.fixes.items():
        for fix in fixes:
            keys = {option_key(config, role, k, uses[role].knobs): v for k, v in fix.options.items()}
            if None not in keys:
                out.append((fix.cost, keys, fix.why))
    return sorted(out, key=lambda item: item[0])


@dataclass
class Suggestion:
    changes: dict[str, Any]
    peak: int
    fits: bool
    why: str = ""

    def overrides(self) -> list[str]:
        return [f"{k}={_yaml(v)}" for k, v in self.changes.items()]


def suggestions(config: Any, plan: MemoryPlan, uses: dict[str, RoleUse],
                replan: Callable[[dict[str, Any]], MemoryPlan | None]) -> list[Suggestion]:
    """Each candidate change with the peak its plan predicts (`replan`; None: the change is not a valid config),
    those that fit first (cheapest first); where no one change fits, the candidates added up in cost order (a
    key's later, stronger value replacing its earlier one) until they fit, as one suggestion."""
    tried: list[Suggestion] = []
    candidates = candidate_changes(config, plan, uses)
    seen_keys: set[str] = set()
    for _, changes, why in candidates:
        key = ",".join(sorted(changes))
        if key in seen_keys and any(s.fits and ",".join(sorted(s.changes)) == key for s in tried):
            continue  # a cheaper value of the same key fits already
        new = replan(changes)
        if new is None:  # the change makes the config invalid (the algorithm's own rules)
            continue
        tried.append(Suggestion(changes, new.peak(), new.fits, why))
        seen_keys.add(key)
    fitting = [s for s in tried if s.fits]
    if fitting:
        return _one_per_key(fitting) + [s for s in tried if not s.fits and not _same_keys(s, fitting)]
    combined: dict[str, Any] = {}
    for _, changes, _ in candidates:  # a later value of a key (a smaller micro-batch) replaces the earlier one
        combined.update(changes)
        new = replan(dict(combined))
        if new is not None and new.fits:
            return [Suggestion(dict(combined), new.peak(), True, "together")] + tried
    return tried


def _one_per_key(found: list[Suggestion]) -> list[Suggestion]:
    out, keys = [], set()
    for s in found:
        key = ",".join(sorted(s.changes))
        if key not in keys:
            keys.add(key)
            out.append(s)
    return out


def _same_keys(s: Suggestion, others: list[Suggestion]) -> bool:
    return any(set(s.changes) == set(o.changes) for o in others)


def refusal(plan: MemoryPlan, found: list[Suggestion]) -> str:
    """The message of a plan that will not fit: where, by how much, the largest component, and what fits."""
    row = max(plan.over, key=lambda r: r.peak - r.total)
    role, component, size = row.largest()
    lines = [f"the plan will not fit in GPU memory: GPU {_ranges(row.gpus)} in {row.phase} needs {gib(row.peak)} of "
             f"{gib(row.total)} (over by {gib(row.peak - row.total)}); its largest part is {role} {component} "
             f"({gib(size)})"]
    fitting = [s for s in found if s.fits]
    if fitting:
        lines.append("changes that fit, cheapest first (rlcore run --fit applies the first):")
        lines += [f"  {' '.join(s.overrides())}  -> peak {gib(s.peak)}" + (f"  ({s.why})" if s.why else "") for s in fitting]
    else:
        lines.append("no change rlcore knows of fits; more GPUs (tensor or pipeline parallel), a smaller model, or "
                     "shorter sequences. Closest: "
                     + "; ".join(f"{' '.join(s.overrides())} -> {gib(s.peak)}" for s in found[:3]))
    return "\n".join(lines)


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _ranges(ranks: tuple[int, ...]) -> str:
    out, ordered = [], sorted(ranks)
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return ",".join(out)


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
    trainable = s.lora_params(rank) if rank else s.params
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


__all__ = [
    "CUDA_CONTEXT", "DEFAULT_GPU_GIB", "EngineMemory", "Fix", "GiB", "GpuPhase", "MemoryPlan", "MemoryQuery", "ModelShape",
    "PHASES", "RoleUse", "Suggestion", "candidate_changes", "gpu_memory", "plan_memory", "refusal", "shape_of",
    "forward_terms", "suggestions", "teacher_terms", "train_fixes", "train_terms",
]
