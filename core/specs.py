"""The descriptors that registration hooks yield: small frozen dataclasses, one per kind of thing.

A plugin says what it provides by yielding these from its `rlcore_*` registration hooks; the plugin
manager collects them into registries (see `rlcore.registry`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError


@dataclass(frozen=True)
class RoleSpec:
    """A role a resource plan can place: `train`, `rollout`, `teacher`, `sampler`, ..."""

    name: str
    description: str = ""
    worker: type | None = None  # the worker class that serves the role, when one class always does


@dataclass(frozen=True)
class DispatcherSpec:
    """A dispatch mode: how one call's arguments are split over a group's `n` workers, and how the results
    come back where the split needs a particular collect.

    `split(n, args, kwargs, mesh)` returns one `(args, kwargs)` per worker, or None for a worker that
    gets nothing (an empty shard). `mesh` describes the group's parallel layout (see `rlcore.runtime.dispatch`).
    `collect` is the collector the mode pairs with (a registered name or a callable; `@function(collect=...)`
    overrides it; None: `none`). `collect_ranks(n, mesh)`, where given, names the ranks whose results are
    collected (`dp`: one per data-parallel shard), the others' are dropped.
    """

    name: str
    split: Callable[..., list[tuple[tuple, dict] | None]]
    description: str = ""
    collect: str | Callable[[list[Any]], Any] | None = None
    collect_ranks: Callable[..., list[int]] | None = None


@dataclass(frozen=True)
class CollectorSpec:
    """How the workers' results come back: `collect(results) -> value`."""

    name: str
    collect: Callable[[list[Any]], Any]
    description: str = ""


@dataclass(frozen=True)
class PlacementSpec:
    """A GPU-allocation policy: `place(request: PlacementRequest) -> {role: [global GPU rank per worker]}`."""

    name: str
    place: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class AlgorithmSpec:
    """A runnable algorithm: its pydantic config model and the trainer class that runs it."""

    name: str
    config: type  # a pydantic BaseModel subclass
    trainer: type  # an rlcore.Trainer subclass
    description: str = ""
    roles: tuple[str, ...] = ()  # the roles its resource plan may name
    demo: str | None = None  # a YAML preset (a path) that `rlcore run --plugin NAME` runs when given no config


EngineKind = Literal["train", "forward", "rollout", "teacher", "reward"]


@dataclass(frozen=True)
class EngineSpec:
    """An engine implementation. `factory(**options)` builds one; it imports its heavy library lazily.

    Kinds: "train" (a `TrainEngine`), "forward" (a `TrainEngine` built without optimizer, for reference and
    colocated teacher models: forward passes only), "rollout" and "teacher" (a `RolloutEngine`; a teacher
    serves `prompt_topk_logprobs`), "reward" (a reward-model scorer).
    """

    name: str
    kind: EngineKind
    factory: Callable[..., Any]
    description: str = ""
    # the heavy modules `factory` imports ("vllm", "megatron.core"): on Ray each worker imports them as soon as
    # it starts, while the roles built before it build (their GPU memory is still taken one role at a time)
    imports: tuple[str, ...] = ()
    # `check(**options)`: the (key, message) problems of the options `factory` would be given, found without
    # building anything (no weights read, no device taken), so that a run and `rlcore config validate` report a
    # bad engine option before any worker starts; None: the options are checked when the engine is built
    check: Callable[..., list[tuple[str, str]]] | None = None
    # `memory(query: rlcore.memory.MemoryQuery) -> rlcore.memory.EngineMemory`: the bytes this engine holds on one
    # of its GPUs per phase, from the options and the model's config.json (nothing loaded), for `rlcore plan`;
    # None: its terms are shown as unknown
    memory: Callable[..., Any] | None = None
    # `layout(**options) -> (tensor, pipeline)`: how many of a group's workers one model replica spans, as the
    # engine built with `options` splits it (the rest of the group is data parallel); None: a whole replica per
    # worker, (1, 1). The session asks it for a role's mesh, so core never names an engine's parallel keys
    layout: Callable[..., tuple[int, int]] | None = None
    # the engine's own config keys: a pydantic model whose fields are added to the sections of roles of this kind
    # (`rlcore.config.with_engine_keys`), at the section's top (`rollout.vllm_max_model_len`); the engine is built
    # with those of them not None. A field marked `json_schema_extra={"engine_only": True}` asks for what only this
    # engine does: set under another engine it is refused (`rlcore.sections.other_engine_key_problems`), where a
    # tuning key is let be. None: the engine takes only the section's common keys and `engine_kwargs`
    keys: type | None = None
    # `config_check(config, role) -> [(key, message)]`: what in the whole config keeps this engine from serving the
    # role `role` (keys of other sections with its own), checked with `check` before any worker starts
    config_check: Callable[..., list[tuple[str, str]]] | None = None
    # `syncs_adapter(**options) -> bool`: whether this rollout engine, built with `options`, takes the train
    # engine's LoRA adapter alone at each weight sync (`RoleSession.sync_adapter`) instead of merged weights
    syncs_adapter: Callable[..., bool] | None = None
    # `advice(failure: rlcore.failures.Failure) -> str`: one line saying which of its keys to change for a failure this
    # engine's library reports (vLLM's context longer than the model's), or '' where it knows none
    advice: Callable[..., str] | None = None


@dataclass(frozen=True)
class RewardSpec:
    """A reward function with TRL's signature: `fn(prompts, completions, completion_ids, **columns)`.

    It returns one float (or None, for "cannot judge") per completion. `kind="model"` marks a reward
    served by a reward-model role (orm/prm) rather than computed in the driver.
    """

    name: str
    fn: Callable[..., list[float | None]]
    description: str = ""
    kind: Literal["function", "model"] = "function"
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class EnvironmentSpec:
    """A multi-turn environment (ms-swift's `multi_turn_scheduler` names it): `factory(**environment_kwargs)`
    returns a fresh `rlcore.Environment` for each episode (`reset(row)`, `step(turn) -> Step`)."""

    name: str
    factory: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class SettingSpec:
    """A config key a plugin adds to every algorithm's config: `report_to`, `logging_dir`, ...

    `type` is any annotation pydantic validates (`int`, `list[str]`, `Literal[...]`, or a `BaseConfig`
    subclass for a section of keys). The key is validated, rendered by `config show` and checked by
    `config validate` with the algorithm's own keys; hooks read it from the config (`trainer.config.NAME`).
    The default is checked against `type` when the descriptor is made, so a wrong one fails at load.
    """

    name: str
    type: Any
    default: Any = field(default=None, hash=False)
    description: str = ""

    def __post_init__(self) -> None:
        try:
            TypeAdapter(self.type).validate_python(self.default)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"] if exc.errors() else str(exc)
            raise ValueError(f"setting '{self.name}': default {self.default!r} is not valid: {reason}") from None


@dataclass(frozen=True)
class PlacementRequest:
    """What a placement policy is asked: each role's GPU count (in declaration order) and the layout.

    A policy returns `{role: [global GPU rank per worker]}`; rank r lives on node r // nproc_per_node.
    Roles in one colocate group must receive the same ranks.
    """

    roles: dict[str, int]
    colocate_groups: tuple[tuple[str, ...], ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1


@dataclass(frozen=True)
class Slot:
    """Where one worker of a role runs: filled by placement, consumed by the worker runtime."""

    role: str
    rank: int  # rank within the role's group
    world_size: int
    node_index: int
    gpu_rank: int | None  # global GPU rank of the plan; None for a CPU worker
    num_gpus: float  # the share of the bundle's GPU this worker asks (1/k when k roles share it)
    num_cpus: float
    placement_group: Any = None  # a ray.util.placement_group.PlacementGroup; None without Ray
    bundle_index: int | None = None
