"""Placement: policies that choose each role's GPU ranks, and Ray placement groups that hold them.

A policy answers a `PlacementRequest` with `{role: [global GPU rank per worker]}`; the built-in ones
(`pack`, `spread`, `colocate`, `separate`) are registered through the `rlcore_placements` hook.
`allocate(plan)` turns a `ResourcePlan` into `Slot`s: one STRICT_PACK placement group of
`nproc_per_node` one-GPU bundles per node, each node's group on a different Ray node, so rank r is
bundle r % nproc_per_node of node r // nproc_per_node. Ray is imported only inside these functions.
"""

from __future__ import annotations

import time
from typing import Any

from . import cluster
from .. import watchdog
from ..errors import ConfigError, ResourceError
from ..log import logger
from .resources import ResourcePlan
from ..specs import PlacementRequest, Slot

GPU_BUNDLE = {"GPU": 1, "CPU": 1}
CPU_BUNDLE = {"CPU": 1}
NODE_ID_LABEL = "ray.io/node-id"


# -------------------------------------------------------------------------
# policies: PlacementRequest -> {role: [global GPU ranks]}
# -------------------------------------------------------------------------


def _units(request: PlacementRequest) -> list[tuple[tuple[str, ...], int]]:
    """Roles in declaration order, colocated ones merged into one unit at the first one's place."""
    units: list[tuple[tuple[str, ...], int]] = []
    done: set[str] = set()
    for role, count in request.roles.items():
        if role in done:
            continue
        group = next((tuple(g) for g in request.colocate_groups if role in g), (role,))
        counts = {request.roles.get(r) for r in group}
        if len(counts) > 1:
            asked = ", ".join(f"{r}.gpus={request.roles.get(r)}" for r in group)
            raise ConfigError(f"colocated roles must ask the same number of GPUs; got {asked}",
                              [("colocate_groups", f"colocated roles must ask the same number of GPUs; got {asked}")])
        units.append((group, count))
        done.update(group)
    return units


def pack(request: PlacementRequest) -> dict[str, list[int]]:
    """Roles in declaration order fill ranks 0, 1, ... contiguously; colocated roles share theirs."""
    placed: dict[str, list[int]] = {}
    start = 0
    for group, count in _units(request):
        for role in group:
            placed[role] = list(range(start, start + count))
        start += count
    return placed


def spread(request: PlacementRequest) -> dict[str, list[int]]:
    """Each role's workers go round-robin over the nodes (worker i to node i % nnodes, or the next with room)."""
    used = [0] * request.nnodes
    overflow = request.nproc_per_node * request.nnodes
    placed: dict[str, list[int]] = {}
    for group, count in _units(request):
        ranks = []
        for i in range(count):
            node = next((n % request.nnodes for n in range(i, i + request.nnodes)
                         if used[n % request.nnodes] < request.nproc_per_node), None)
            if node is None:  # no room anywhere: a rank past the cluster, which the plan reports
                ranks.append(overflow)
                overflow += 1
                continue
            ranks.append(node * request.nproc_per_node + used[node])
            used[node] += 1
        for role in group:
            placed[role] = ranks
    return placed


def colocate(request: PlacementRequest) -> dict[str, list[int]]:
    """Every role shares ranks 0..n-1; every role must ask the same n."""
    counts = set(request.roles.values())
    if len(counts) > 1:
        asked = ", ".join(f"{r}.gpus={n}" for r, n in request.roles.items())
        message = f"placement 'colocate' puts every role on the same GPUs, so all must ask the same count; got {asked}"
        raise ConfigError(message, [("placement", message)])
    return {role: list(range(count)) for role, count in request.roles.items()}


def separate(request: PlacementRequest) -> dict[str, list[int]]:
    """Every role gets its own contiguous ranks; colocate_groups contradict this policy."""
    if request.colocate_groups:
        message = (f"placement 'separate' gives every role its own GPUs, but colocate_groups is "
                   f"{[list(g) for g in request.colocate_groups]}; remove colocate_groups or use placement 'pack'")
        raise ConfigError(message, [("placement", message)])
    return pack(request)


POLICIES = {
    "pack": (pack, "roles in declaration order fill ranks 0.. contiguously; colocated roles share ranks"),
    "spread": (spread, "each role's workers round-robin over the nodes"),
    "colocate": (colocate, "every role shares ranks 0..n-1 (all roles ask the same count)"),
    "separate": (separate, "disjoint ranks for every role; colocate_groups are an error"),
}


# -------------------------------------------------------------------------
# allocation on a Ray cluster
# -------------------------------------------------------------------------


def _cluster_summary(ray: Any) -> str:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    parts = [f"{n['NodeID'][:8]}: {n['Resources'].get('GPU', 0):g} GPU, {n['Resources'].get('CPU', 0):g} CPU"
             for n in nodes]
    free = ray.available_resources()
    return (f"{len(nodes)} node(s) [{'; '.join(parts) or 'none'}]; available now "
            f"{free.get('GPU', 0):g} GPU, {free.get('CPU', 0):g} CPU")


def _ask_summary(plan: ResourcePlan) -> str:
    cpu_workers = sum(g.size for g in plan.cpu_groups)
    gpu = len(plan.nodes) * plan.nproc_per_node
    return (f"{len(plan.nodes)} node(s) with nproc_per_node={plan.nproc_per_node} GPUs and as many CPUs each, "
            f"plus {cpu_workers} CPU(s) for CPU workers ({gpu} GPU, {gpu + cpu_workers} CPU in all)")


def check_feasible(plan: ResourcePlan) -> None:
    """Raise ResourceError, naming what was asked and what the cluster has, when it can never fit."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = plan.nproc_per_node
    fitting = [n for n in nodes if n["Resources"].get("GPU", 0) >= per_node and n["Resources"].get("CPU", 0) >= per_node]
    total = ray.cluster_resources()
    cpu_needed = len(plan.nodes) * per_node + sum(g.size for g in plan.cpu_groups)
    problems = []
    if plan.nodes and len(fitting) < len(plan.nodes):
        problems.append(f"only {len(fitting)} node(s) have {per_node} GPUs and {per_node} CPUs")
    if total.get("CPU", 0) < cpu_needed:
        problems.append(f"the cluster has {total.get('CPU', 0):g} CPUs, the plan needs {cpu_needed}")
    if problems:
        raise ResourceError(f"the cluster cannot hold this plan: {'; '.join(problems)}. Asked: {_ask_summary(plan)}. "
                            f"The cluster has {_cluster_summary(ray)}. Ask fewer GPUs per node "
                            "(nproc_per_node, gpus) or add nodes.")


def _wait_ready(ray: Any, pg: Any, what: str, plan: ResourcePlan, deadline: float, timeout_s: float) -> None:
    if not pg.wait(max(0.0, deadline - time.monotonic())):
        raise ResourceError(f"{what} was not ready within {timeout_s:g}s (placement_timeout_s). Asked: "
                            f"{_ask_summary(plan)}. The cluster has {_cluster_summary(ray)}. Other jobs or "
                            "placement groups may hold the resources (see `ray status`).")


def allocate(plan: ResourcePlan, timeout_s: float = 60.0) -> dict[str, list[Slot]]:
    """Reserve the plan's GPUs and CPUs on the running Ray cluster; one Slot per worker of each role.

    Feasibility is checked before anything is created; a group not ready within `timeout_s` raises
    ResourceError after every group made so far is removed. Free the slots with `release`.
    """
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    if not ray.is_initialized():
        raise ResourceError("Ray is not running: call ray.init() (or set ray_address) before allocating")
    check_feasible(plan)
    deadline = time.monotonic() + timeout_s
    created: list[Any] = []
    try:
        node_groups: dict[int, Any] = {}
        ray_nodes: list[str] = []
        for node in plan.nodes:
            selector = None
            if ray_nodes:  # every node's group on another Ray node than the previous ones
                selector = [{NODE_ID_LABEL: f"!in({', '.join(ray_nodes)})"}] * plan.nproc_per_node
            pg = placement_group([dict(GPU_BUNDLE)] * plan.nproc_per_node, strategy="STRICT_PACK",
                                 bundle_label_selector=selector)
            created.append(pg)
            _wait_ready(ray, pg, f"the placement group of node {node} ({plan.nproc_per_node} x {GPU_BUNDLE} "
                        "on one node)", plan, deadline, timeout_s)
            node_groups[node] = pg
            ray_nodes.append(placement_group_table(pg)["bundles_to_node_id"][0])
        cpu_groups: dict[str, tuple[Any, list[int]]] = {}
        for group in plan.cpu_groups:
            pg = placement_group([dict(CPU_BUNDLE)] * group.size, strategy="PACK")
            created.append(pg)
            _wait_ready(ray, pg, f"the placement group of CPU group '{group.name}' ({group.size} x {CPU_BUNDLE})",
                        plan, deadline, timeout_s)
            where = placement_group_table(pg)["bundles_to_node_id"]
            for i in range(group.size):
                if where[i] not in ray_nodes:
                    ray_nodes.append(where[i])
            cpu_groups[group.name] = (pg, [ray_nodes.index(where[i]) for i in range(group.size)])
    except BaseException:
        release_groups(created)
        raise
    return _slots(plan, node_groups, cpu_groups)


def _slots(plan: ResourcePlan, node_groups: dict[int, Any], cpu_groups: dict[str, tuple[Any, list[int]]]) -> dict[str, list[Slot]]:
    slots: dict[str, list[Slot]] = {}
    for group in plan.groups:
        share = 1.0 / len(group.roles)
        for role in group.roles:
            if group.device == "CPU":
                pg, node_of = cpu_groups[group.name]
                slots[role] = [Slot(role, i, group.size, node_of[i], None, 0.0, share, pg, i) for i in range(group.size)]
                continue
            role_slots = []
            for i, rank in enumerate(group.ranks):  # type: ignore[union-attr]
                node, bundle = divmod(rank, plan.nproc_per_node)
                k = len(plan.roles_on(rank))
                role_slots.append(Slot(role, i, group.size, node, rank, 1.0 / k, 1.0 / k, node_groups[node], bundle))
            slots[role] = role_slots
    return slots


def release_groups(groups: list[Any]) -> None:
    """Remove placement groups (ignoring ones already gone). With the cluster's GCS gone (killed, or out of
    memory) there is nothing to remove them from: a warning, instead of Ray's 60 s wait and exit."""
    from ray.util.placement_group import remove_placement_group

    if groups and watchdog.stuck() is not None:
        logger.warning(f"Ray does not answer; {len(groups)} placement group(s) not removed (they end with the cluster)")
        return
    if groups and not cluster.gcs_answers():
        logger.warning(f"Ray's GCS does not answer; {len(groups)} placement group(s) not removed (they "
                       f"end with the cluster)")
        return
    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or the cluster is gone: nothing left to free
            pass


def release(slots: dict[str, list[Slot]] | list[Slot]) -> None:
    """Remove the placement groups behind `slots` (what `allocate` returned, or a list of Slots)."""
    flat = [s for group in slots.values() for s in group] if isinstance(slots, dict) else list(slots)
    unique: dict[Any, Any] = {}
    for slot in flat:
        if slot.placement_group is not None:
            unique.setdefault(slot.placement_group.id, slot.placement_group)
    release_groups(list(unique.values()))
