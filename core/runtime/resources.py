"""Resource plans: which GPU ranks (or how many CPU processes) each role gets.

Users bring one of two YAML forms, both turned into one `ResourcePlan` by `plan_from_config`:

- ms-swift's per-group form, `device_groups: {nproc_per_node, GROUP: {device, ranks, workers}}`, where a
  group's roles share its ranks;
- the per-role form, `train: {gpus: 4}`, `rollout: {gpus: 4}`, `colocate_groups: [[train, rollout]]`,
  whose ranks a placement policy (`rlcore.runtime.placement`) chooses.

Every mistake in either form is collected and reported at once as one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..config import gpu_count
from .devices import resolved_auto
from ..errors import ConfigError, NotRegistered, did_you_mean
from ..manager import load_plugins
from ..specs import PlacementRequest

Device = Literal["GPU", "CPU"]
GROUP_KEYS = ("device", "ranks", "workers")
_RANGE = re.compile(r"^\s*(list\(\s*)?range\(\s*(\d+)\s*(?:,\s*(\d+)\s*(?:,\s*(\d+)\s*)?)?\)\s*(\))?\s*$")
MAX_RANKS = 1 << 16  # GPU ranks one plan may name: far beyond any cluster, small enough to check at once
_RANKS_FORMS = "an int (a count), a list of ints, or 'list(range(a, b))' / 'range(a, b[, step])'"


@dataclass(frozen=True)
class Group:
    """Workers of `roles` on `ranks`: global GPU ranks for a GPU group, a process count for a CPU group."""

    name: str
    device: Device
    ranks: tuple[int, ...] | int
    roles: tuple[str, ...]

    @property
    def size(self) -> int:
        """Workers each of the group's roles gets."""
        return self.ranks if isinstance(self.ranks, int) else len(self.ranks)


@dataclass(frozen=True)
class ResourcePlan:
    """Where every role runs. Rank r lives on node r // nproc_per_node, in bundle r % nproc_per_node."""

    groups: tuple[Group, ...]
    nproc_per_node: int
    nnodes: int = 1
    colocate_groups: tuple[tuple[str, ...], ...] = ()
    auto: tuple[str, ...] = ()  # the roles whose GPUs `gpus: auto` chose (rlcore.runtime.devices)

    @property
    def roles(self) -> tuple[str, ...]:
        """Every role of the plan, in declaration order."""
        return tuple(role for group in self.groups for role in group.roles)

    def group_of(self, role: str) -> Group:
        for group in self.groups:
            if role in group.roles:
                return group
        raise KeyError(f"role '{role}' is not in the plan; its roles: {', '.join(self.roles)}")

    def ranks_of(self, role: str) -> tuple[int, ...]:
        """The global GPU ranks of `role`'s workers, in worker order; () for a CPU role."""
        group = self.group_of(role)
        return () if group.device == "CPU" else group.ranks  # type: ignore[return-value]

    def num_workers(self, role: str) -> int:
        return self.group_of(role).size

    def roles_on(self, rank: int) -> tuple[str, ...]:
        """The roles whose workers share GPU rank `rank` (each then asks 1/k of it)."""
        return tuple(r for g in self.groups if g.device == "GPU" and rank in g.ranks for r in g.roles)  # type: ignore[operator]

    @property
    def gpu_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups if g.device == "GPU" for r in g.ranks}))  # type: ignore[union-attr]

    @property
    def nodes(self) -> tuple[int, ...]:
        """The node indices holding at least one GPU rank of the plan."""
        return tuple(sorted({r // self.nproc_per_node for r in self.gpu_ranks}))

    @property
    def cpu_groups(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.device == "CPU")

    def describe(self) -> str:
        """One line per group, for logs: `train+rollout: GPU ranks [0, 1, 2, 3]`."""
        lines = [f"nnodes={self.nnodes} nproc_per_node={self.nproc_per_node}"]
        for g in self.groups:
            where = f"GPU ranks {list(g.ranks)}" if g.device == "GPU" else f"{g.ranks} CPU process(es)"  # type: ignore[arg-type]
            lines.append(f"{g.name} ({', '.join(g.roles)}): {where}")
        return "\n".join(lines)


def short(values: list[Any], most: int = 8) -> str:
    """A list for an error message: the first `most` items, then how many there are in all."""
    if len(values) <= most:
        return repr(values)
    return "[" + ", ".join(repr(v) for v in values[:most]) + f", ... ({len(values)} in all)]"


def rank_ranges(ranks: Any) -> str:
    """[0, 1, 2, 5] -> '0-2,5': ranks as the placement line and the memory plan print them."""
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


def parse_ranks(value: Any) -> int | list[int]:
    """An int count, a list of ranks, or a `range(...)` string parsed by a regex (never evaluated).

    Raises ValueError with the accepted forms when `value` is none of them.
    """
    if isinstance(value, bool):
        raise ValueError(f"ranks must be {_RANKS_FORMS}; got {value!r}")
    if isinstance(value, int):
        if not 1 <= value <= MAX_RANKS:
            raise ValueError(f"a ranks count must be between 1 and {MAX_RANKS}; got {value}")
        return value
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_RANKS:
            raise ValueError(f"a ranks list names {len(value)} ranks; a plan holds at most {MAX_RANKS}")
        if not value or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_RANKS for r in value):
            raise ValueError(f"a ranks list must hold ints from 0 to {MAX_RANKS - 1}; got {short(list(value))}")
        if len(set(value)) != len(value):
            raise ValueError(f"a ranks list names a rank twice: {short(list(value))}")
        return list(value)
    if isinstance(value, str):
        match = _RANGE.match(value)
        if match and bool(match.group(1)) == bool(match.group(5)):
            numbers = [int(n) for n in match.group(2, 3, 4) if n is not None]
            if len(numbers) == 3 and numbers[2] == 0:
                raise ValueError(f"ranks {value!r} has step 0")
            span = range(*numbers)  # lazy: its length is known before anything is expanded
            if len(span) > MAX_RANKS:
                raise ValueError(f"ranks {value!r} names {len(span)} ranks; a plan holds at most {MAX_RANKS}")
            if span and max(span[0], span[-1]) >= MAX_RANKS:
                raise ValueError(f"ranks {value!r} names rank {max(span[0], span[-1])}; ranks go from 0 to "
                                 f"{MAX_RANKS - 1}")
            ranks = list(span)
            if not ranks:
                raise ValueError(f"ranks {value!r} is empty")
            return ranks
    raise ValueError(f"ranks must be {_RANKS_FORMS}; got {value!r:.200}")


def plan_from_config(
    config: Any,
    roles: list[str] | None = None,
    policy: str | None = None,
    *,
    plugins: Any = None,
) -> ResourcePlan:
    """The `ResourcePlan` of a config (a dict or a pydantic model), validated before anything is allocated.

    `roles`: the roles the algorithm runs (all must be placed; others are errors); None takes the role
    sections the config has. `policy`: the placement policy for the per-role form (default: the config's
    `placement`, else `pack`). `plugins`: a loaded `rlcore.Plugins`, loaded here when None.
    Raises ConfigError with every problem found, each with its key path.
    """
    if plugins is None:
        plugins = load_plugins()
    cfg = _as_dict(config)
    problems: list[tuple[str, str]] = []
    known_roles = plugins.roles.names()
    for role in roles or ():
        if role not in plugins.roles:
            problems.append(("roles", f"role '{role}' is not registered by any plugin; known: "
                             f"{', '.join(known_roles)}.{did_you_mean(role, known_roles)}"))
    sections = _role_sections(cfg, known_roles, problems)
    device_groups = cfg.get("device_groups")
    if isinstance(device_groups, str):
        try:
            device_groups = json.loads(device_groups)
        except json.JSONDecodeError as exc:
            problems.append(("device_groups", f"is a string but not valid JSON ({exc}); pass a mapping"))
            device_groups = None
    if device_groups:
        plan = _from_device_groups(cfg, device_groups, sections, roles, known_roles, problems)
    else:
        plan = _from_roles(cfg, sections, roles, known_roles, policy or cfg.get("placement") or "pack",
                           plugins, problems)
    if problems:
        raise ConfigError(_summary(problems), problems)
    assert plan is not None
    auto = tuple(role for role in resolved_auto(config) if role in plan.roles)
    return dataclasses.replace(plan, auto=auto) if auto else plan


def _summary(problems: list[tuple[str, str]]) -> str:
    lines = [f"the resource plan has {len(problems)} problem(s):"]
    lines += [f"  {key}: {message}" for key, message in problems]
    return "\n".join(lines)


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "model_dump"):
        return config.model_dump()
    raise ConfigError(f"expected a mapping or a pydantic config, got {type(config).__name__}")


def _role_sections(cfg: dict[str, Any], known: list[str], problems: list) -> dict[str, dict[str, Any]]:
    """Role sections in declaration order; a dict with `gpus` under an unregistered name is a typo."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in cfg.items():
        if hasattr(value, "model_dump"):
            value = value.model_dump()
        if not isinstance(value, Mapping):
            continue
        if key in known:
            sections[key] = dict(value)
        elif "gpus" in value:
            problems.append((key, f"'{key}' has `gpus` but no plugin registers a role '{key}'; known roles: "
                             f"{', '.join(known)}.{did_you_mean(key, known)}"))
    return sections


def _check_role(role: Any, key: str, known: list[str], problems: list) -> bool:
    if role in known:
        return True
    problems.append((key, f"role '{role}' is not registered by any plugin; known: {', '.join(known)}."
                     f"{did_you_mean(str(role), known)}"))
    return False


def _positive_int(value: Any, key: str, problems: list) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        problems.append((key, f"must be an int from 1 to {MAX_RANKS}; got {value!r:.100}"))
        return None
    return value


# -------------------------------------------------------------------------
# ms-swift's per-group form
# -------------------------------------------------------------------------


def _from_device_groups(
    cfg: dict, device_groups: Any, sections: dict, roles: list[str] | None, known: list[str], problems: list
) -> ResourcePlan | None:
    if not isinstance(device_groups, Mapping):
        problems.append(("device_groups", f"must be a mapping of groups; got {type(device_groups).__name__}"))
        return None
    with_gpus = [r for r, s in sections.items() if gpu_count(s.get("gpus"))]
    if with_gpus:
        problems.append(("device_groups", "both resource forms are given: device_groups and per-role gpus "
                         f"({', '.join(f'{r}.gpus' for r in with_gpus)}); use one of them"))
    if cfg.get("colocate_groups"):
        problems.append(("colocate_groups", "belongs to the per-role form; with device_groups, put roles that "
                         "share GPUs into one group's `workers`"))
    nproc = _positive_int(device_groups.get("nproc_per_node"), "device_groups.nproc_per_node", problems)
    top_nproc = _positive_int(cfg.get("nproc_per_node"), "nproc_per_node", problems)
    if nproc and top_nproc and nproc != top_nproc:
        problems.append(("device_groups.nproc_per_node",
                         f"is {nproc} but nproc_per_node is {top_nproc}; give it once"))
    nproc = nproc or top_nproc
    given_nnodes = device_groups.get("nnodes", cfg.get("nnodes"))
    nnodes = _positive_int(1 if given_nnodes is None else given_nnodes, "device_groups.nnodes", problems) or 1

    groups: list[Group] = []
    owner: dict[str, str] = {}
    next_rank = 0
    for name, spec in device_groups.items():
        if name in ("nproc_per_node", "nnodes"):
            continue
        key = f"device_groups.{name}"
        if not isinstance(spec, Mapping):
            problems.append((key, f"must be a mapping with {', '.join(GROUP_KEYS)}; got {spec!r}"))
            continue
        for extra in set(spec) - set(GROUP_KEYS):
            problems.append((f"{key}.{extra}", f"unknown key; a group has {', '.join(GROUP_KEYS)}."
                             f"{did_you_mean(extra, GROUP_KEYS)}"))
        device = str(spec.get("device", "GPU")).upper()
        if device not in ("GPU", "CPU"):
            problems.append((f"{key}.device", f"must be GPU or CPU; got {spec.get('device')!r}"))
            continue
        workers = spec.get("workers")
        if isinstance(workers, str):
            workers = [workers]
        if not workers or not isinstance(workers, list):
            problems.append((f"{key}.workers", "must list the group's roles, e.g. workers: [sampler]"))
            continue
        for role in workers:
            if _check_role(role, f"{key}.workers", known, problems) and role in owner:
                problems.append((f"{key}.workers", f"role '{role}' is already in group '{owner[role]}'; "
                                 "a role belongs to one group"))
            owner.setdefault(role, name)
        if "ranks" not in spec:
            problems.append((f"{key}.ranks", f"is missing; give {_RANKS_FORMS}"))
            continue
        try:
            ranks = parse_ranks(spec["ranks"])
        except ValueError as exc:
            problems.append((f"{key}.ranks", str(exc)))
            continue
        if device == "CPU":
            if not isinstance(ranks, int):
                problems.append((f"{key}.ranks", f"a CPU group's ranks is a process count (e.g. ranks: "
                                 f"{len(ranks)}), not a list of ranks; got {spec['ranks']!r}"))
                continue
            groups.append(Group(name, "CPU", ranks, tuple(workers)))
            continue
        if isinstance(ranks, int):
            if next_rank + ranks > MAX_RANKS:
                problems.append((f"{key}.ranks", f"{ranks} ranks after rank {next_rank - 1} go beyond rank "
                                 f"{MAX_RANKS - 1}, the most a plan holds"))
                continue
            ranks = list(range(next_rank, next_rank + ranks))
        next_rank = max(ranks) + 1
        groups.append(Group(name, "GPU", tuple(ranks), tuple(workers)))

    gpu_groups = [g for g in groups if g.device == "GPU"]
    for i, a in enumerate(gpu_groups):
        for b in gpu_groups[i + 1:]:
            shared = sorted(set(a.ranks) & set(b.ranks))  # type: ignore[arg-type]
            if shared:
                problems.append((f"device_groups.{b.name}.ranks",
                                 f"groups '{a.name}' and '{b.name}' both claim GPU rank(s) {short(shared)}; groups are "
                                 "not colocated: give them disjoint ranks, or put their workers in one group"))
    highest = max((max(g.ranks) for g in gpu_groups), default=-1)  # type: ignore[type-var]
    if nproc is None:
        if nnodes > 1 and gpu_groups:
            problems.append(("device_groups.nproc_per_node", f"is required when nnodes is {nnodes}"))
        nproc = max(1, math.ceil((highest + 1) / nnodes))
    elif given_nnodes is None:  # as ms-swift reads it: rank r is on node r // nproc_per_node
        nnodes = max(1, math.ceil((highest + 1) / nproc))
    _check_capacity(gpu_groups, nproc, nnodes, "device_groups", problems)
    for role in roles or ():
        if role in known and role not in owner:
            problems.append(("device_groups", f"role '{role}' is in no group; add it to a group's workers"))
    if roles is not None:
        for role, group in owner.items():
            if role in known and role not in roles:
                problems.append((f"device_groups.{group}.workers",
                                 f"role '{role}' is not used here; the roles are: {', '.join(roles)}"))
    return ResourcePlan(tuple(groups), nproc, nnodes)


def _check_capacity(groups: list[Group], nproc: int, nnodes: int, key: str, problems: list) -> None:
    capacity = nproc * nnodes
    for g in groups:
        beyond = [r for r in g.ranks if r >= capacity]  # type: ignore[union-attr]
        if beyond:
            problems.append((key, f"group '{g.name}' ({', '.join(g.roles)}) has rank(s) {short(beyond)} beyond "
                             f"nproc_per_node * nnodes = {nproc} * {nnodes} = {capacity}; raise "
                             "nproc_per_node or nnodes, or ask fewer GPUs"))


# -------------------------------------------------------------------------
# the per-role form
# -------------------------------------------------------------------------


def _from_roles(
    cfg: dict, sections: dict, roles: list[str] | None, known: list[str], policy: str, plugins: Any,
    problems: list,
) -> ResourcePlan | None:
    if roles is not None:
        for role in sections:
            if role not in roles and gpu_count(sections[role].get("gpus")):
                problems.append((f"{role}.gpus", f"role '{role}' is not used here; the roles are: "
                                 f"{', '.join(roles)}. Remove the section"))
        order = [r for r in sections if r in roles] + [r for r in roles if r not in sections and r in known]
    else:
        order = list(sections)
    gpus: dict[str, int] = {}
    cpus: dict[str, int] = {}
    for role in order:
        section = sections.get(role, {})
        count = section.get("gpus", 0) or 0
        count = 0 if count == "auto" else count  # unresolved: no GPU visible (`rlcore.runtime.devices`)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            problems.append((f"{role}.gpus", f"must be an int >= 0; got {count!r}"))
        elif count:
            gpus[role] = count
        else:
            workers = section.get("cpus", 1)
            if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
                problems.append((f"{role}.cpus", f"must be an int >= 1; got {workers!r}"))
            else:
                cpus[role] = workers

    colocate = _colocate_groups(cfg.get("colocate_groups") or [], gpus, known, problems)
    nnodes = _positive_int(1 if cfg.get("nnodes") is None else cfg["nnodes"], "nnodes", problems) or 1
    nproc = _positive_int(cfg.get("nproc_per_node"), "nproc_per_node", problems)
    try:
        place = plugins.placements.get(policy).place
    except NotRegistered as exc:
        problems.append(("placement", str(exc)))
        return None
    if problems:
        return None
    try:
        if nproc is None:  # enough for the plan on one node
            wide = place(PlacementRequest(gpus, colocate, sum(gpus.values()) or 1, 1))
            nproc = max(1, math.ceil((max((max(r) for r in wide.values() if r), default=-1) + 1) / nnodes))
        placed = place(PlacementRequest(gpus, colocate, nproc, nnodes))
    except ConfigError as exc:
        problems.extend(exc.problems or [("placement", str(exc))])
        return None
    _check_placed(placed, gpus, colocate, policy, problems)
    if problems:
        return None

    groups: list[Group] = []
    seen: set[str] = set()
    for role in order:
        if role in seen:
            continue
        if role in cpus:
            groups.append(Group(role, "CPU", cpus[role], (role,)))
            seen.add(role)
            continue
        unit = next((g for g in colocate if role in g), (role,))
        groups.append(Group("+".join(unit), "GPU", tuple(placed[role]), unit))
        seen.update(unit)
    gpu_groups = [g for g in groups if g.device == "GPU"]
    _check_capacity(gpu_groups, nproc, nnodes, "nproc_per_node", problems)
    return ResourcePlan(tuple(groups), nproc, nnodes, colocate)


def _colocate_groups(value: Any, gpus: dict[str, int], known: list[str], problems: list) -> tuple[tuple[str, ...], ...]:
    if not isinstance(value, list) or not all(isinstance(g, (list, tuple)) for g in value):
        problems.append(("colocate_groups", f"must be a list of role lists, e.g. [[train, rollout]]; got {value!r}"))
        return ()
    out: list[tuple[str, ...]] = []
    seen: dict[str, int] = {}
    for i, group in enumerate(value):
        key = f"colocate_groups[{i}]"
        ok = True
        for role in group:
            if not _check_role(role, key, known, problems):
                ok = False
            elif role in seen:
                problems.append((key, f"role '{role}' is also in colocate_groups[{seen[role]}]; merge the two"))
                ok = False
            elif role not in gpus:
                problems.append((key, f"role '{role}' has no GPUs (set {role}.gpus); only GPU roles share GPUs"))
                ok = False
            seen.setdefault(role, i)
        if not ok:
            continue
        counts = {role: gpus[role] for role in group}
        if len(set(counts.values())) > 1:
            asked = ", ".join(f"{r}.gpus={n}" for r, n in counts.items())
            problems.append((key, f"colocated roles must ask the same number of GPUs; got {asked}. Set them "
                             f"equal (e.g. all {max(counts.values())}), or remove the colocate group to "
                             "give them separate GPUs"))
            continue
        out.append(tuple(group))
    return tuple(out)


def _check_placed(placed: Any, gpus: dict[str, int], colocate: tuple, policy: str, problems: list) -> None:
    """A policy's answer must give every role its count of distinct ranks, colocated roles the same ones."""
    if not isinstance(placed, Mapping):
        problems.append(("placement", f"policy '{policy}' returned {type(placed).__name__}, not {{role: ranks}}"))
        return
    for role, count in gpus.items():
        ranks = placed.get(role)
        if ranks is None or len(ranks) != count or len(set(ranks)) != count or min(ranks) < 0:
            problems.append(("placement", f"policy '{policy}' gave role '{role}' ranks {ranks!r}; it asks "
                             f"{count} distinct non-negative rank(s)"))
    for group in colocate:
        if len({tuple(placed.get(r) or ()) for r in group}) > 1:
            problems.append(("placement", f"policy '{policy}' gave the colocated roles {list(group)} different ranks"))
