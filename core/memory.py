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
from pathlib import Path
from typing import Any

from .model_shape import ModelShape, dtype_bytes, shape_of
from .runtime.resources import rank_ranges
from .memory_terms import (
    CHUNK_ROWS, CUDA_CONTEXT, GiB, EngineMemory, Fix, MemoryQuery, RoleUse, forward_terms, memory_function, teacher_terms,
    train_fixes, train_terms,
)

PHASES = ("generation", "scoring", "training", "weight sync")
DEFAULT_GPU_GIB = 80.0


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
    fixed: dict[str, Any] = field(default_factory=dict)  # the session keys the algorithm fixes (no fix may change them)

    @property
    def over(self) -> list[GpuPhase]:
        return [row for row in self.rows if not row.fits]

    @property
    def fits(self) -> bool:
        """No GPU's known components exceed its memory (see `known`: an unknown one may still)."""
        return not self.over

    @property
    def known(self) -> bool:
        """Every component of every GPU has a size: only then does `fits` say the run fits."""
        return not any(row.unknown for row in self.rows)

    def unknown_reason(self) -> str:
        """Why the plan cannot say whether the run fits: the roles whose sizes are unknown, and why each is."""
        roles = sorted({role for row in self.rows for role in row.unknown})
        why = [note.removesuffix(" (shown as unknown)") for note in self.notes if note.split(":")[0] in roles]
        why += [f"{role}: the algorithm describes no memory use of it" for role in roles
                if not any(note.startswith(f"{role}:") for note in self.notes)]
        return (f"the memory plan cannot size {', '.join(roles)}, so it cannot say whether the run fits: "
                f"{'; '.join(why)}")

    def peak(self) -> int:
        return max((row.peak for row in self.rows), default=0)

    def table(self) -> str:
        """The plan as text: per GPU and phase, each component, the peak and the headroom."""
        lines = [f"memory plan: GPU memory {gib(self.gpu_bytes)} ({self.source})"]
        for row in self.rows:
            head = self.gpu_bytes - row.peak
            unknown = f" + unknown ({', '.join(row.unknown)})" if row.unknown else ""
            state = "OVER" if head < 0 else "UNKNOWN" if row.unknown else "ok"
            lines.append(f"GPU {rank_ranges(row.gpus)} {row.phase}: peak {gib(row.peak)}{unknown} of {gib(self.gpu_bytes)}, "
                         f"headroom {gib(head)} [{state}]")
            for role, component, size in row.terms:
                lines.append(f"    {role:<10} {component:<28} {'unknown' if size is None else gib(size)}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"gpu_bytes": self.gpu_bytes, "source": self.source, "fits": self.fits and self.known,
                "known": self.known, "rows": [
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
                gpu_bytes: int | None = None, source: str = "", fixed: dict[str, Any] | None = None) -> MemoryPlan:
    """Sum each GPU's roles per phase (those some role on the GPU works in). A role works in its `RoleUse.phase`;
    in another phase it keeps what its engine says stays resident; in `weight sync`, the roles that send or receive
    hold their `sync` terms. The session's keys (`sleep_level`, the offloads) are the config's, or where the
    algorithm fixes them (`fixed`: its `session_fixed`), those."""
    if gpu_bytes is None:
        gpu_bytes, source = gpu_memory(config)
    fixed = fixed or {}

    def session(key: str, default: Any) -> Any:
        return fixed[key] if key in fixed else getattr(config, key, default)

    answers: dict[str, EngineMemory | None] = {}
    notes: list[str] = []
    for role, use in uses.items():
        ranks = resource_plan.ranks_of(role) if role in resource_plan.roles else ()
        if not ranks:
            continue
        shape = shape_of(use.model)  # None for a role that loads no model (use.model None) too
        fn = memory_function(plugins, use.engine, use.kind)
        if fn is None:
            answers[role] = None
            engine = use.engine if isinstance(use.engine, str) else getattr(use.engine, "__name__", use.engine)
            notes.append(f"{role}: engine {engine} reports no memory terms (shown as unknown)")
            continue
        if shape is None and use.model is not None:
            answers[role] = None
            notes.append(f"{role}: {use.model or 'the model'}'s config.json cannot be read here (shown as unknown)")
            continue
        colocated = any(set(ranks) & set(resource_plan.ranks_of(r)) for r in uses if r != role and r in resource_plan.roles)
        query = MemoryQuery(
            role=role, use=use, model=shape, gpu_bytes=gpu_bytes, workers=len(ranks), colocated=colocated,
            sleep_level=session("sleep_level", 1), offload_model=session("offload_model", False),
            offload_optimizer=session("offload_optimizer", False),
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
        roles = resource_plan.roles_on(rank)  # one the algorithm describes no use of (a reward model) is unknown
        if not any(r in answers for r in roles):
            continue
        described = [r for r in roles if r in answers]
        working = {uses[r].phase for r in described} | ({"weight sync"} if any(uses[r].sync for r in described) else set())
        for phase in (p for p in PHASES if p in working):  # the phases some role on this GPU works in
            terms: list[tuple[str, str, int | None]] = []
            for role in roles:
                answer, use = answers.get(role), uses.get(role)
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
    return MemoryPlan(rows, gpu_bytes, source, fixes, notes, dict(fixed))


def plan_of(plugins: Any, algorithm: str, config: Any) -> tuple[MemoryPlan | None, dict[str, RoleUse]]:
    """The memory plan of a run of `algorithm` with `config` and the roles' uses; (None, {}) where the algorithm
    describes none (no model named, or no `memory_use`), the model is a demo's tiny one, or no role has a GPU."""
    from .runtime.resources import plan_from_config
    from .testing import is_tiny

    trainer = plugins.algorithms.get(algorithm).trainer
    if not hasattr(trainer, "roles"):
        return None, {}
    # the resource plan first, whatever the model: a plan that cannot be made is refused, never "nothing to plan"
    resources = plan_from_config(config, roles=trainer.roles(config), policy=config.placement, plugins=plugins)
    if not hasattr(trainer, "memory_use") or is_tiny(getattr(config, "model", None)):
        return None, {}
    uses = trainer.memory_use(config)
    if not uses:
        return None, {}
    plan = plan_memory(config, resources, uses, plugins, fixed=getattr(trainer, "session_fixed", None))
    return (plan if plan.rows else None), uses


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

    def free(key: str, value: Any) -> bool:  # the config has the key at `value`, and the algorithm leaves it be
        return key not in plan.fixed and hasattr(config, key) and getattr(config, key) == value

    if colocated:
        if free("offload_optimizer", False):
            out.append((1, {"offload_optimizer": True}, "the optimizer state leaves the GPU while another role works"))
        if free("offload_model", False):
            out.append((1, {"offload_model": True}, "the train weights leave the GPU while another role works"))
        if free("sleep_level", 0):
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
    candidates, useful = candidate_changes(config, plan, uses), []
    seen_keys: set[str] = set()
    for candidate in candidates:
        _, changes, why = candidate
        key = ",".join(sorted(changes))
        if key in seen_keys and any(s.fits and ",".join(sorted(s.changes)) == key for s in tried):
            continue  # a cheaper value of the same key fits already
        new = replan(changes)
        if new is None or not _lowers(plan, new):  # an invalid config (the algorithm's rules), or no GPU lower
            continue
        useful.append(candidate)
        tried.append(Suggestion(changes, new.peak(), new.fits, why))
        seen_keys.add(key)
    fitting = [s for s in tried if s.fits]
    if fitting:
        return _one_per_key(fitting) + [s for s in tried if not s.fits and not _same_keys(s, fitting)]
    combined: dict[str, Any] = {}
    for _, changes, _ in useful:  # a later value of a key (a smaller micro-batch) replaces the earlier one
        combined.update(changes)
        new = replan(dict(combined))
        if new is not None and new.fits:
            return [Suggestion(dict(combined), new.peak(), True, "together")] + tried
    return tried


def _lowers(plan: MemoryPlan, new: MemoryPlan) -> bool:
    """Whether `new` predicts less on some GPU in some phase than `plan` (a change that lowers nothing, such as an
    offload with no train engine to offload, is no fix)."""
    after = {(row.gpus, row.phase): row.peak for row in new.rows}
    return any(after.get((row.gpus, row.phase), 0) < row.peak for row in plan.rows)


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
    lines = [f"the plan will not fit in GPU memory: GPU {rank_ranges(row.gpus)} in {row.phase} needs {gib(row.peak)} of "
             f"{gib(row.total)} (over by {gib(row.peak - row.total)}); its largest part is {role} {component} "
             f"({gib(size)})"]
    fitting = [s for s in found if s.fits]
    if fitting:
        lines.append("changes that fit, cheapest first (rlcore run --fit applies the first):")
        lines += [f"  {' '.join(s.overrides())}  -> peak {gib(s.peak)}" + (f"  ({s.why})" if s.why else "") for s in fitting]
    else:
        closest = "; ".join(f"{' '.join(s.overrides())} -> {gib(s.peak)}" for s in found[:3])
        lines.append("no change rlcore knows of fits; more GPUs (tensor or pipeline parallel), a smaller model, or "
                     "shorter sequences" + (f". Closest: {closest}" if closest else ""))
    return "\n".join(lines)


FIT_HEADER = "# rlcore --fit: the run's config with the change that fits its GPUs:"


def save_fitted(config: Any, changes: list[str], path: str | None = None) -> str:
    """Write the fitted config (`output_dir/config.fit.yaml` unless `path`), never over a file rlcore did not write."""
    from .yaml_io import render_config
    from .errors import ConfigError
    from .log import logger

    target = Path(path) if path else Path(config.output_dir) / "config.fit.yaml"
    if target.exists() and (path or not target.read_text().startswith(FIT_HEADER)):
        raise ConfigError(f"{target} exists; rlcore writes the fitted config only to a new file (give another path)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(f"{FIT_HEADER} {' '.join(changes)}\n" + render_config(config))
    tmp.replace(target)
    logger.info(f"the fitted config is in {target}")
    return str(target)


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


__all__ = [
    "CHUNK_ROWS", "CUDA_CONTEXT", "DEFAULT_GPU_GIB", "EngineMemory", "Fix", "GiB", "GpuPhase", "MemoryPlan", "MemoryQuery", "ModelShape",
    "PHASES", "RoleUse", "Suggestion", "candidate_changes", "dtype_bytes", "forward_terms", "gpu_memory", "plan_memory",
    "plan_of", "refusal", "save_fitted", "shape_of", "suggestions", "teacher_terms", "train_fixes", "train_terms",
]
