"""Placement policies, and placement groups on a real Ray (fake GPUs): what each worker actually sees."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from rlcore import ConfigError, PlacementRequest, ResourceError, Slot, load_plugins
from rlcore.runtime.placement import allocate, colocate, pack, release, separate, spread
from rlcore.runtime.resources import plan_from_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray"


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def example(name: str, roles: list[str], plugins) -> object:
    return plan_from_config(yaml.safe_load((EXAMPLES / name).read_text()), roles=roles, plugins=plugins)


# -------------------------------------------------------------------------
# policies
# -------------------------------------------------------------------------


def test_builtin_policies_are_registered(plugins):
    assert {"pack", "spread", "colocate", "separate"} <= set(plugins.placements.names())
    assert plugins.placements.get("spread").place is spread
    assert plugins.placements.owner("pack") == "builtins"


def test_pack_fills_in_declaration_order_and_colocated_roles_share():
    request = PlacementRequest({"teacher": 2, "train": 3, "rollout": 3, "reference": 1}, (("train", "rollout"),), 8)
    assert pack(request) == {"teacher": [0, 1], "train": [2, 3, 4], "rollout": [2, 3, 4], "reference": [5]}


def test_spread_round_robins_over_nodes():
    request = PlacementRequest({"train": 4, "rollout": 3}, (), nproc_per_node=4, nnodes=2)
    assert spread(request) == {"train": [0, 4, 1, 5], "rollout": [2, 6, 3]}
    full = PlacementRequest({"train": 3}, (), nproc_per_node=1, nnodes=2)
    assert spread(full) == {"train": [0, 1, 2]}  # rank 2 is past the cluster: the plan reports it


def test_colocate_and_separate():
    assert colocate(PlacementRequest({"train": 2, "rollout": 2})) == {"train": [0, 1], "rollout": [0, 1]}
    with pytest.raises(ConfigError, match="all must ask the same count"):
        colocate(PlacementRequest({"train": 2, "rollout": 1}))
    assert separate(PlacementRequest({"train": 2, "rollout": 1})) == {"train": [0, 1], "rollout": [2]}
    with pytest.raises(ConfigError, match="remove colocate_groups or use placement 'pack'"):
        separate(PlacementRequest({"train": 2, "rollout": 2}, (("train", "rollout"),)))
    with pytest.raises(ConfigError, match="train.gpus=2, rollout.gpus=1"):
        pack(PlacementRequest({"train": 2, "rollout": 1}, (("train", "rollout"),)))


# -------------------------------------------------------------------------
# on Ray
# -------------------------------------------------------------------------


def probe(slots: dict[str, list[Slot]]) -> dict[str, list[tuple[str, str]]]:
    """Start one tiny actor per slot, as the worker runtime does; each says (node id, CUDA_VISIBLE_DEVICES)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    class Probe:
        def where(self) -> tuple[str, str]:
            gpus = ",".join(str(g) for g in ray.get_gpu_ids())
            assert os.environ.get("CUDA_VISIBLE_DEVICES", "") == gpus
            return ray.get_runtime_context().get_node_id(), gpus

    actors = {
        role: [
            Probe.options(
                num_gpus=s.num_gpus,
                num_cpus=s.num_cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(s.placement_group, placement_group_bundle_index=s.bundle_index),
            ).remote()
            for s in role_slots
        ]
        for role, role_slots in slots.items()
    }
    try:
        return {role: ray.get([a.where.remote() for a in group], timeout=90) for role, group in actors.items()}
    finally:
        for group in actors.values():
            for actor in group:
                ray.kill(actor)


def live_groups() -> dict[str, str]:
    from ray.util.placement_group import placement_group_table

    return {pg_id: t["state"] for pg_id, t in placement_group_table().items() if t["state"] != "REMOVED"}


def wait_removed(before: dict[str, str], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while live_groups().keys() - before.keys() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not live_groups().keys() - before.keys(), live_groups()


@pytest.mark.ray
def test_colocated_roles_share_gpus_and_separate_roles_do_not(ray_local, plugins):
    before = live_groups()
    slots = allocate(example("grpo/colocate.yaml", ["train", "rollout"], plugins), timeout_s=30)
    assert [(s.rank, s.world_size, s.gpu_rank, s.bundle_index, s.num_gpus) for s in slots["rollout"]] == [
        (i, 4, i, i, 0.5) for i in range(4)
    ]
    seen = probe(slots)
    release(slots)
    assert [g for _, g in seen["train"]] == [g for _, g in seen["rollout"]]
    assert len({g for _, g in seen["train"]}) == 4 and all(g for _, g in seen["train"])
    wait_removed(before)

    slots = allocate(example("grpo/separate.yaml", ["train", "rollout"], plugins), timeout_s=30)
    assert {s.num_gpus for group in slots.values() for s in group} == {1.0}
    seen = probe(slots)
    release(slots)
    train, rollout = {g for _, g in seen["train"]}, {g for _, g in seen["rollout"]}
    assert len(train) == len(rollout) == 4 and not train & rollout
    wait_removed(before)


@pytest.mark.ray
def test_sampling_example_places_sampler_apart_from_the_reward_models(ray_local, plugins):
    slots = allocate(example("sample/sampling.yaml", ["sampler", "prm", "orm"], plugins), timeout_s=30)
    try:
        assert [s.gpu_rank for s in slots["sampler"]] == [0, 1] and [s.gpu_rank for s in slots["orm"]] == [2, 3]
        assert {s.num_gpus for s in slots["prm"] + slots["orm"]} == {0.5}
        seen = probe(slots)
    finally:
        release(slots)
    sampler = {g for _, g in seen["sampler"]}
    assert len(sampler) == 2 and seen["prm"] == seen["orm"] and not sampler & {g for _, g in seen["prm"]}


@pytest.mark.ray
def test_gkd_teacher_layouts(ray_local, plugins):
    from ray.util.placement_group import placement_group_table

    roles = ["train", "rollout", "teacher"]
    colocated = allocate(example("gkd/teacher_colocated.yaml", ["train", "rollout"], plugins), timeout_s=30)
    assert set(colocated) == {"train", "rollout"} and colocated["train"][0].num_gpus == 0.5
    release(colocated)

    standalone = allocate(example("gkd/teacher_standalone.yaml", roles, plugins), timeout_s=30)
    try:
        teacher = standalone["teacher"]
        assert [(s.gpu_rank, s.bundle_index, s.num_gpus) for s in teacher] == [(r, r, 1.0) for r in range(4, 8)]
        assert placement_group_table(teacher[0].placement_group)["state"] == "CREATED"
    finally:
        release(standalone)

    shared = allocate(example("gkd/teacher_shared.yaml", roles, plugins), timeout_s=30)
    try:
        assert [s.num_gpus for group in shared.values() for s in group] == [pytest.approx(1 / 3)] * 12
        seen = probe({"train": shared["train"][:2], "teacher": shared["teacher"][:2]})
        assert seen["train"] == seen["teacher"]
    finally:
        release(shared)


@pytest.mark.ray
def test_cpu_workers_get_cpu_bundles(ray_local, plugins):
    plan = plan_from_config({"train": {"gpus": 2}, "orm": {"gpus": 0, "cpus": 2}}, plugins=plugins)
    slots = allocate(plan, timeout_s=30)
    try:
        orm = slots["orm"]
        assert [(s.gpu_rank, s.num_gpus, s.num_cpus, s.bundle_index) for s in orm] == [(None, 0.0, 1.0, 0), (None, 0.0, 1.0, 1)]
        assert orm[0].placement_group.bundle_specs == [{"CPU": 1.0}, {"CPU": 1.0}]
        assert orm[0].node_index == 0  # the only node, the one the GPU group is on
        assert [g for _, g in probe({"orm": orm})["orm"]] == ["", ""]
    finally:
        release(slots)


@pytest.mark.ray
def test_infeasible_plan_fails_before_creating_anything(ray_local, plugins):
    before = live_groups()
    plan = plan_from_config({"train": {"gpus": 8}, "rollout": {"gpus": 4}}, plugins=plugins)
    with pytest.raises(ResourceError) as info:
        allocate(plan, timeout_s=5)
    message = str(info.value)
    assert "only 0 node(s) have 12 GPUs and 12 CPUs" in message
    assert "Asked: 1 node(s) with nproc_per_node=12 GPUs" in message and "8 GPU, 8 CPU" in message
    assert live_groups() == before


@pytest.mark.ray
def test_busy_cluster_times_out_with_what_was_asked(ray_local, plugins):
    from ray.util.placement_group import placement_group, remove_placement_group

    holder = placement_group([{"GPU": 6}], strategy="STRICT_PACK")
    assert holder.wait(30)
    before = live_groups()
    plan = plan_from_config({"train": {"gpus": 4}}, plugins=plugins)
    start = time.monotonic()
    try:
        with pytest.raises(ResourceError, match=r"was not ready within 1.5s .*available now 2 GPU"):
            allocate(plan, timeout_s=1.5)
        assert time.monotonic() - start < 10
        wait_removed(before)
    finally:
        remove_placement_group(holder)


@pytest.mark.ray
def test_allocate_needs_ray(plugins):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with pytest.raises(ResourceError, match="Ray is not running"):
        allocate(plan_from_config({"train": {"gpus": 1}}, plugins=plugins))


@pytest.fixture
def two_nodes(monkeypatch):
    """A two-node Ray cluster on this machine (ray.cluster_utils.Cluster), 4 fake GPUs and 4 CPUs each."""
    import ray
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # Keep every address on the loopback, and the "latest cluster" file out of the shared /tmp/ray.
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    temp_dir = tempfile.mkdtemp(prefix="rlc", dir="/tmp")  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", temp_dir)
    node = {"num_cpus": 4, "num_gpus": 4, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.ray
def test_two_nodes(two_nodes, plugins):
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    ray = two_nodes
    plan = plan_from_config({"nnodes": 2, "train": {"gpus": 4}, "rollout": {"gpus": 4}}, plugins=plugins)
    assert plan.nproc_per_node == 4
    slots = allocate(plan, timeout_s=30)
    try:
        assert [s.node_index for s in slots["train"]] == [0] * 4 and [s.node_index for s in slots["rollout"]] == [1] * 4
        seen = probe(slots)
    finally:
        release(slots)
    train_nodes, rollout_nodes = {n for n, _ in seen["train"]}, {n for n, _ in seen["rollout"]}
    assert len(train_nodes) == len(rollout_nodes) == 1 and train_nodes != rollout_nodes
    assert len({g for _, g in seen["train"]}) == 4

    # Node 1's group must not join node 0's, even where it fits and the other node is still busy: with one
    # node held, node 0's 2-GPU group fills half of the free node; node 1's waits for the held one.
    holder = placement_group([{"GPU": 4}], strategy="STRICT_PACK")
    assert holder.wait(30)
    held_node = placement_group_table(holder)["bundles_to_node_id"][0]
    threading.Timer(2.0, remove_placement_group, [holder]).start()
    narrow = plan_from_config({"nnodes": 2, "nproc_per_node": 2, "train": {"gpus": 2}, "rollout": {"gpus": 2}},
                              plugins=plugins)
    slots = allocate(narrow, timeout_s=30)
    try:
        hosts = [set(placement_group_table(slots[r][0].placement_group)["bundles_to_node_id"].values()) for r in slots]
        assert hosts[0] != {held_node} and hosts[1] == {held_node}
    finally:
        release(slots)

    spread_plan = plan_from_config({"nnodes": 2, "nproc_per_node": 4, "train": {"gpus": 4}}, policy="spread", plugins=plugins)
    slots = allocate(spread_plan, timeout_s=30)
    try:
        where = [placement_group_table(s.placement_group)["bundles_to_node_id"][s.bundle_index] for s in slots["train"]]
        assert [s.node_index for s in slots["train"]] == [0, 1, 0, 1]
        assert where[0] == where[2] != where[1] == where[3]
    finally:
        release(slots)

    before = live_groups()
    too_wide = plan_from_config({"train": {"gpus": 8}}, plugins=plugins)  # 8 GPUs on one node; the nodes have 4
    with pytest.raises(ResourceError, match=r"only 0 node\(s\) have 8 GPUs.*2 node\(s\) \[.*4 GPU, 4 CPU; .*4 GPU, 4 CPU\]"):
        allocate(too_wide, timeout_s=5)
    assert live_groups() == before

    # Fragmented: 2 GPUs taken on each node leave 4 free in all, but no node has 4 free.
    holder = placement_group([{"GPU": 2}, {"GPU": 2}], strategy="STRICT_SPREAD")
    assert holder.wait(30)
    before = live_groups()
    try:
        with pytest.raises(ResourceError, match=r"node 0 \(4 x \{'GPU': 1, 'CPU': 1\} on one node\) was not ready within 2s"):
            allocate(plan_from_config({"train": {"gpus": 4}}, plugins=plugins), timeout_s=2)
        wait_removed(before)
    finally:
        remove_placement_group(holder)
    assert ray.cluster_resources()["GPU"] == 8
