"""`gpus: auto`, a role's default: the GPUs this run can see, resolved once, before any GPU is taken.

`resolve_gpus` turns every `auto` of the roles a run has into a count: without Ray one GPU each (every role lives in
this one process, on its first visible GPU), with Ray the cluster's GPUs: roles in a colocate group share theirs
(an auto role colocated with a role given a count takes that count), a role apart (a rollout, a reference, a
teacher) gets one, and the first role apart (train) the rest. Where no GPU is visible (or `device_groups` places
the roles) `auto` is 0, the CPU, exactly as `gpus: 0`; so is a role that sets `cpus` and not `gpus` (CPU workers). The config is validated again with the counts, so checks that
depend on them (the generation batch over the train workers) see the real ones; until then they wait for them, and
an auto role the run does not have stays auto, asking no GPU (`rlcore.config.gpu_count`). The CLI resolves the config
it read for run, plan and `config show/validate` alike (`rlcore.cli`); a trainer built in Python resolves its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..config import DeviceKeys, config_from_data
from ..errors import ConfigError


def visible_gpus(use_ray: bool = False, ray_address: str | None = None) -> int:
    """The GPUs a run can place roles on: with Ray the cluster's (the one this process is connected to, or the one
    at `ray_address` / RLCORE_RAY_ADDRESS; a local Ray declares this machine's), else this process's visible CUDA
    devices (CUDA_VISIBLE_DEVICES applies). Counting creates no CUDA context."""
    if use_ray:
        from . import cluster

        address = None if ray_address == "local" else ray_address or os.environ.get(cluster.ADDRESS_ENV) or None
        try:
            import ray
        except ImportError:  # `--use-ray` without ray installed is reported by the run's extras check
            ray = None
        if ray is not None and (ray.is_initialized() or address is not None):
            return int(cluster.init(address).get("GPU", 0))
    import torch

    return torch.cuda.device_count()


def role_sections(config: Any) -> dict[str, DeviceKeys]:
    """The config's role sections (top-level keys holding `gpus`), by name."""
    return {name: getattr(config, name) for name in type(config).model_fields
            if isinstance(getattr(config, name), DeviceKeys)}


def auto_gpus(config: Any, roles: list[str], visible: int, use_ray: bool) -> dict[str, int]:
    """The GPUs each role of `roles` whose `gpus` is auto gets out of `visible` (see the module docstring): 0 each
    where there is no GPU or the config places roles with `device_groups`. Raises ConfigError when the roles apart
    outnumber the GPUs left, naming them and the fixes."""
    sections = role_sections(config)
    auto = [r for r in roles if r in sections and sections[r].gpus == "auto"]
    if visible < 1 or getattr(config, "device_groups", None):
        return {r: 0 for r in auto}
    # a role that gives `cpus` and leaves `gpus` unset asks for CPU workers, as it did before `auto`
    on_cpu = [r for r in auto if "cpus" in sections[r].model_fields_set]
    roles = [r for r in roles if r not in on_cpu]
    colocated = [tuple(r for r in group if r in roles) for group in getattr(config, "colocate_groups", None) or ()]
    units: list[tuple[str, ...]] = []
    for role in roles:
        if role in sections and not any(role in unit for unit in units):
            units.append(next((g for g in colocated if role in g), (role,)))
    counts: dict[str, int] = {}
    apart: list[tuple[str, ...]] = []  # units of auto roles only
    left = visible if use_ray else 1
    for unit in units:
        given = [sections[r].gpu_count for r in unit if r in sections and sections[r].gpus != "auto"]
        if not given:
            apart.append(unit)
            continue
        counts.update({r: max(given) for r in unit if r in auto})
        left -= max(given)
    counts.update({r: 0 for r in on_cpu})
    if not use_ray:  # one process: every role on its one GPU
        counts.update({r: 1 for unit in apart for r in unit})
        return counts
    if apart and left < len(apart):
        names = ", ".join("+".join(unit) for unit in apart)
        raise ConfigError(
            f"gpus: auto: {visible} GPU(s) visible, {max(left, 0)} left for {len(apart)} role group(s) apart ({names}); "
            f"share them (colocate_groups: [[{', '.join(r for unit in apart for r in unit)}]]), or set each role's gpus "
            "(0: the CPU)",
            [(f"{apart[-1][0]}.gpus", f"auto: {max(left, 0)} GPU(s) left for {len(apart)} role group(s) apart ({names}); "
              "colocate them or give counts")],
        )
    for i, unit in enumerate(apart):
        share = left - (len(apart) - 1) if i == 0 else 1
        counts.update({r: share for r in unit})
    return counts


def resolve_gpus(config: Any, roles_of: Callable[[Any], list[str]], *, use_ray: bool,
                 visible: int | None = None, source: str | None = None) -> Any:
    """`config` with each auto `gpus` of the roles `roles_of(config)` gives resolved into a count (`auto_gpus`),
    validated again as the config model validates (batch sizes follow the train workers); the config itself where
    no role of the run is auto. `visible`: the GPUs to resolve against (default: `visible_gpus`); `source`: the
    config's file, for errors. The roles auto gave GPUs are kept on the config (`resolved_auto`), for the placement
    line."""
    roles = roles_of(config)
    sections = role_sections(config)
    if not any(sections[r].gpus == "auto" for r in roles if r in sections):
        return config
    if visible is None:
        visible = visible_gpus(use_ray, getattr(config, "ray_address", None))
    counts = auto_gpus(config, roles, visible, use_ray)
    data = config.model_dump()
    for role, count in counts.items():
        data[role]["gpus"] = count
    on_gpus = {role: count for role, count in counts.items() if count}
    given = ", ".join(f"{role}.gpus={count}" for role, count in on_gpus.items())
    where = " ".join(filter(None, [source or "", f"with gpus: auto as {given}" if given else ""]))
    resolved = config_from_data(type(config), data, source=where or None)
    resolved._auto_gpus = on_gpus
    return resolved


def resolved_auto(config: Any) -> dict[str, int]:
    """The roles whose `gpus: auto` `resolve_gpus` resolved, with their counts ({} for none, or a plain mapping)."""
    return dict(getattr(config, "_auto_gpus", None) or {})
