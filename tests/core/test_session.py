"""RoleSession: what the resource plan says about each role (no Ray needed), and the loop's phase timer."""

from __future__ import annotations

import time

import pytest

from rlcore import ConfigError, PhaseTimer, RoleSession, RoleSetup, load_plugins
from rlcore.resources import plan_from_config
from rlcore.roles import GenerateWorker, ScoreWorker, TrainWorker
from rlcore.session import _ranges


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def session(plugins, config, roles, use_ray=True, **options):
    plan = plan_from_config(config, roles=roles, plugins=plugins)
    kinds = {"train": TrainWorker, "reference": TrainWorker, "rollout": GenerateWorker, "orm": ScoreWorker}
    setups = {r: RoleSetup(kinds[r], "hf", {"model": "m"}) for r in roles}
    return RoleSession(plan, setups, use_ray=use_ray, plugins=plugins, **options)


def test_device_groups_give_workers_devices_and_colocation(plugins):
    s = session(plugins, {"device_groups": {
        "nproc_per_node": 4,
        "actor": {"device": "GPU", "ranks": "list(range(0, 2))", "workers": ["train", "rollout"]},
        "ref": {"device": "GPU", "ranks": [2, 3], "workers": ["reference"]},
        "rm": {"device": "CPU", "ranks": 3, "workers": ["orm"]},
    }}, ["train", "rollout", "reference", "orm"])
    assert [s.workers(r) for r in s.roles] == [2, 2, 2, 3]
    assert s.dp_size("train") == 2 and s.device("train") == "cuda" and s.device("orm") == "cpu"
    assert s.colocated("train", "rollout") and not s.colocated("train", "reference")
    assert s.describe() == [
        "train: 2 workers, GPU 0-1 (shared with rollout), engine hf",
        "rollout: 2 workers, GPU 0-1 (shared with train), engine hf",
        "reference: 2 workers, GPU 2-3, engine hf",
        "orm: 3 workers, CPU, engine hf",
    ]
    assert s.transport("train", "reference") == "nccl"  # separate GPU roles: a broadcast
    assert s.transport("train", "orm") == "object_store"


def test_per_role_form_and_local_runs(plugins):
    config = {"colocate_groups": [["train", "rollout"]], "train": {"gpus": 2}, "rollout": {"gpus": 2}}
    on_ray = session(plugins, config, ["train", "rollout"])
    assert on_ray.colocated("train", "rollout") and on_ray.dp_size("train") == 2
    local = session(plugins, config, ["train", "rollout"], use_ray=False)
    assert local.dp_size("train") == 1 and local.transport("train", "rollout") == "in_process"
    assert local.colocated("train", "rollout")  # the plan decides, in one process too: sleep/wake still apply
    assert local.describe()[0] == "train: 1 worker, in this process on cuda (shared with rollout), engine hf"
    forced = session(plugins, {"train": {"gpus": 1}, "rollout": {"gpus": 1}}, ["train", "rollout"],
                     weight_sync_backend="gloo")
    assert forced.transport("train", "rollout") == "gloo"


def test_an_engine_device_option_wins_and_bad_setups_are_refused(plugins):
    plan = plan_from_config({"train": {"gpus": 1}, "rollout": {"gpus": 1}}, roles=["train", "rollout"], plugins=plugins)
    s = RoleSession(plan, {"train": RoleSetup(TrainWorker, "hf", {"device": "cpu"}),
                           "rollout": RoleSetup(GenerateWorker, "hf", {"device": "cpu"})}, use_ray=True)
    assert s.device("train") == "cpu" and s.transport("train", "rollout") == "object_store"
    with pytest.raises(ConfigError, match="no place in the resource plan"):
        RoleSession(plan, {"teacher": RoleSetup(TrainWorker, "hf")}, use_ray=True)
    with pytest.raises(ConfigError, match="weight_sync_backend 'ipc' is unknown"):
        RoleSession(plan, {}, use_ray=True, weight_sync_backend="ipc")
    with pytest.raises(KeyError, match="role 'train' is not running"):
        s["train"]


def test_ranges_are_short():
    assert _ranges((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8" and _ranges((3,)) == "3"


def test_nested_phases_are_not_counted_twice():
    timer = PhaseTimer()
    with timer("reward"):
        time.sleep(0.02)
        with timer("generate"):
            time.sleep(0.1)
    times = timer.pop()
    assert times["time/generate"] >= 0.1 and 0.02 <= times["time/reward"] < 0.08
    assert timer.pop() == {}


def test_tensor_and_pipeline_sizes_split_a_roles_workers(plugins):
    from rlcore.dispatch import Mesh

    plan = plan_from_config({"train": {"gpus": 4}}, roles=["train"], plugins=plugins)

    def train(use_ray=True, **sizes):
        return RoleSession(plan, {"train": RoleSetup(TrainWorker, "megatron", sizes)}, use_ray=use_ray)

    both = train(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert both.mesh("train") == Mesh(dp=1, tp=2, pp=2) and both.dp_size("train") == 1
    assert train(tensor_model_parallel_size=2).dp_size("train") == 2 and train().dp_size("train") == 4
    with pytest.raises(ConfigError, match="tensor x pipeline = 3 x 1 does not divide the role's 4 worker"):
        train(tensor_model_parallel_size=3).dp_size("train")
    with pytest.raises(ConfigError, match="one worker in this process: run with --use-ray"):
        train(use_ray=False, tensor_model_parallel_size=2).dp_size("train")
