"""Configuration models shared by every algorithm. (Loading, overrides and `config show` are added below.)"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class BaseConfig(BaseModel):
    """Every config section forbids unknown keys, so a typo is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class RoleConfig(BaseConfig):
    """A role's section (`train:`, `rollout:`, `teacher:` ...): its devices and its engine's options."""

    gpus: int = Field(0, ge=0, description="GPUs for this role (0: one CPU worker, or `cpus` workers)")
    cpus: int = Field(1, ge=1, description="CPU workers when gpus is 0 (Ray only)")
    engine: str = Field("hf", description="engine implementation (see `rlcore plugins`)")


class RunConfig(BaseConfig):
    """Keys every algorithm has: where outputs go, seeding, and how roles are placed on devices."""

    output_dir: str = Field("output", description="metrics.jsonl, checkpoints and samples go here")
    seed: int = Field(42, description="seed for data order, sampling and initialisation")
    nnodes: int = Field(1, ge=1, description="nodes of the Ray cluster the plan spans")
    nproc_per_node: int | None = Field(None, ge=1, description="GPUs per node (default: the role form's largest need)")
    device_groups: dict[str, Any] | None = Field(
        None, description="ms-swift's per-group form: {nproc_per_node, GROUP: {device, ranks, workers}}"
    )
    colocate_groups: list[list[str]] = Field(
        default_factory=list, description="roles that share GPUs, e.g. [[train, rollout]]"
    )
    placement: str = Field("pack", description="placement policy (see `rlcore plugins`)")
    placement_timeout_s: float = Field(60.0, gt=0, description="fail if the placement group is not ready by then")
    ray_address: str | None = Field(None, description="attach to this Ray cluster ('auto' for a running one)")
    sleep_level: Literal[0, 1, 2] = Field(1, description="rollout sleep level while colocated training runs")
    offload_model: bool = Field(False, description="offload train weights while colocated rollout runs")
    offload_optimizer: bool = Field(False, description="offload optimizer state while colocated rollout runs")
