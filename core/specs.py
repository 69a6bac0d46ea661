"""The descriptors that registration hooks yield: small frozen dataclasses, one per kind of thing.

A plugin says what it provides by yielding these from its `rlcore_*` registration hooks; the plugin
manager collects them into registries (see `rlcore.registry`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class RoleSpec:
    """A role a resource plan can place: `train`, `rollout`, `teacher`, `sampler`, ..."""

    name: str
    description: str = ""
    worker: type | None = None  # the worker class that serves the role, when one class always does


@dataclass(frozen=True)
class DispatcherSpec:
    """How one call's arguments are split over a group's `n` workers.

    `split(n, args, kwargs, mesh)` returns one `(args, kwargs)` per worker, or None for a worker that
    gets nothing (an empty shard). `mesh` describes the group's parallel layout (see `rlcore.dispatch`).
    """

    name: str
    split: Callable[..., list[tuple[tuple, dict] | None]]
    description: str = ""


@dataclass(frozen=True)
class CollectorSpec:
    """How the workers' results come back: `collect(results) -> value`."""

    name: str
    collect: Callable[[list[Any]], Any]
    description: str = ""


@dataclass(frozen=True)
class PlacementSpec:
    """A GPU-allocation policy: `place(plan, cluster) -> {role: [Bundle per worker]}`."""

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


EngineKind = Literal["train", "rollout", "teacher", "reward"]


@dataclass(frozen=True)
class EngineSpec:
    """An engine implementation. `factory(**options)` builds one; it imports its heavy library lazily."""

    name: str
    kind: EngineKind
    factory: Callable[..., Any]
    description: str = ""


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
