"""`gpus: auto`: resolved once for the visible GPUs (a real Ray on the CPU declares fake ones), into the plan and the
placement line; where none is visible, exactly what `gpus: 0` gives."""

from __future__ import annotations

import pytest

from rlcore import ConfigError, RoleSession, RoleSetup, load_plugins
from rlcore.cli import main
from rlcore.runtime import devices
from rlcore.runtime.resources import plan_from_config
from rlcore.runtime.roles import GenerateWorker, TrainWorker
from rlcore.testing import build_tiny_model


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("devices") / "tiny"))


def grpo(plugins, **keys):
    """A GRPO config of `keys` (dotted: {"train.gpus": 2}), validated as a run validates it."""
    data: dict = {"model": "m", "dataset": "d", "per_device_train_batch_size": 8, "num_generations": 8}
    for key, value in keys.items():
        section, _, name = key.rpartition(".")
        (data.setdefault(section, {}) if section else data)[name] = value
    return plugins.config_model("grpo").model_validate(data)


def placement(plugins, config, model, use_ray):
    """The plan of `config`'s roles and the placement line a run prints for it."""
    roles = plugins.algorithms.get("grpo").trainer.roles(config)
    plan = plan_from_config(config, roles=roles, plugins=plugins)
    kinds = {"train": TrainWorker, "rollout": GenerateWorker}
    setups = {r: RoleSetup(kinds[r], "hf", {"model": model, "dtype": getattr(config, r).dtype}) for r in roles}
    return plan, RoleSession(plan, setups, use_ray=use_ray, plugins=plugins).describe()


def test_auto_is_the_cpu_where_no_gpu_is_visible(plugins, model):
    config = grpo(plugins)
    assert config.train.gpus == "auto" and config.train.gpu_count == 0
    roles = plugins.algorithms.get("grpo").trainer.roles
    zero = grpo(plugins, **{"train.gpus": 0, "rollout.gpus": 0})
    for use_ray in (False, True):
        resolved = devices.resolve_gpus(config, roles, use_ray=use_ray, visible=0)
        assert resolved == zero and devices.resolved_auto(resolved) == {}
        assert resolved.reference.gpus == "auto"  # not a role of this run (beta 0): left as it is
        assert devices.resolve_gpus(zero, roles, use_ray=use_ray, visible=0) is zero  # nothing auto: as it is
    auto_plan, auto_line = placement(plugins, devices.resolve_gpus(config, roles, use_ray=False, visible=0), model, False)
    zero_plan, zero_line = placement(plugins, zero, model, False)
    assert auto_plan == zero_plan and auto_plan.gpu_ranks == ()
    assert auto_line == zero_line == ["train: 1 worker, in this process, engine hf, float32",
                                      "rollout: 1 worker, in this process, engine hf, float32"]


def test_without_ray_each_role_takes_the_visible_gpu(plugins, model, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.visible_gpus(use_ray=False) == 2
    config = devices.resolve_gpus(grpo(plugins), plugins.algorithms.get("grpo").trainer.roles, use_ray=False)
    assert (config.train.gpus, config.rollout.gpus, config.reference.gpus) == (1, 1, "auto")  # no reference: beta 0
    plan, line = placement(plugins, config, model, use_ray=False)
    assert plan.auto == ("train", "rollout") and plan.ranks_of("train") == (0,)
    assert line == ["train: 1 worker, in this process on cuda (gpus: auto), engine hf, bfloat16",
                    "rollout: 1 worker, in this process on cuda (gpus: auto), engine hf, bfloat16"]
    kept = devices.resolve_gpus(grpo(plugins, **{"train.gpus": 0}), plugins.algorithms.get("grpo").trainer.roles,
                                use_ray=False)
    assert (kept.train.gpus, kept.rollout.gpus) == (0, 1)  # gpus: 0 keeps the CPU


def test_with_ray_the_cluster_gpus_are_shared_or_split(plugins, model, ray_local):
    roles = plugins.algorithms.get("grpo").trainer.roles
    assert devices.visible_gpus(use_ray=True) == ray_local.cluster_resources()["GPU"] == 8
    apart = devices.resolve_gpus(grpo(plugins), roles, use_ray=True)  # the cluster's 8 fake GPUs
    assert (apart.train.gpus, apart.rollout.gpus, apart.train_workers) == (7, 1, 7)
    plan, line = placement(plugins, apart, model, use_ray=True)
    assert plan.ranks_of("train") == tuple(range(7)) and plan.ranks_of("rollout") == (7,)
    assert line == ["train: 7 workers, GPU 0-6 (gpus: auto), engine hf, bfloat16",
                    "rollout: 1 worker, GPU 7 (gpus: auto), engine hf, bfloat16"]

    shared = devices.resolve_gpus(grpo(plugins, colocate_groups=[["train", "rollout"]]), roles, use_ray=True)
    assert (shared.train.gpus, shared.rollout.gpus) == (8, 8)
    assert placement(plugins, shared, model, use_ray=True)[1][0] == (
        "train: 8 workers, GPU 0-7 (gpus: auto; shared with rollout), engine hf, bfloat16")

    given = devices.resolve_gpus(grpo(plugins, colocate_groups=[["train", "rollout"]], **{"train.gpus": 2}), roles,
                                 use_ray=True)
    assert (given.train.gpus, given.rollout.gpus) == (2, 2)  # an explicit count works as before; colocated share it
    plan, line = placement(plugins, given, model, use_ray=True)
    assert plan.auto == ("rollout",) and line[0] == "train: 2 workers, GPU 0-1 (shared with rollout), engine hf, bfloat16"


def test_too_few_gpus_for_the_roles_apart_is_one_clear_error(plugins):
    roles = plugins.algorithms.get("grpo").trainer.roles
    with pytest.raises(ConfigError, match=r"1 GPU\(s\) visible, 1 left for 2 role group\(s\) apart \(train, rollout\); "
                                          r"share them \(colocate_groups: \[\[train, rollout\]\]\)"):
        devices.resolve_gpus(grpo(plugins), roles, use_ray=True, visible=1)
    batch = {"num_generations": 16, "per_device_train_batch_size": 4}  # 4 x 1 CPU worker: waits for the count
    assert devices.resolve_gpus(grpo(plugins, **batch), roles, use_ray=True, visible=5).train_workers == 4
    with pytest.raises(ConfigError, match="train workers \\(1\\)"):  # checked with the resolved workers
        devices.resolve_gpus(grpo(plugins, **batch), roles, use_ray=False, visible=0)
    with pytest.raises(ConfigError, match="train workers \\(3\\)"):
        devices.resolve_gpus(grpo(plugins, **batch), roles, use_ray=True, visible=4)


def test_the_cli_resolves_show_as_run_does(ray_local, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    # a model named: not the demo preset (whose roles stay on the CPU, gpus: 0)
    assert main(["config", "show", "--plugin", "grpo", "--use-ray", "model=Qwen/Qwen2.5-0.5B-Instruct",
                 "per_device_train_batch_size=8", "num_generations=8"]) == 0
    shown = capsys.readouterr().out
    train, rollout = shown.index("\ntrain:"), shown.index("\nrollout:")
    assert "gpus: 7" in shown[train:rollout] and "gpus: 1" in shown[rollout:]
    assert main(["config", "show", "--plugin", "grpo", "model=Qwen/Qwen2.5-0.5B-Instruct"]) == 0
    shown = capsys.readouterr().out  # without Ray: this machine's GPUs, none here
    assert "gpus: 0" in shown[shown.index("\ntrain:"):shown.index("\nrollout:")]


def test_a_role_that_gives_cpus_and_no_gpus_stays_on_the_cpu(plugins):
    """`orm: {cpus: 2}` asked for two CPU workers before `auto` was the default; it still does, beside GPU roles."""
    config = grpo(plugins, **{"reward_funcs": ["toy", "orm"], "orm.model": "some/orm", "orm.cpus": 2})
    counts = devices.auto_gpus(config, plugins.algorithms.get("grpo").trainer.roles(config), visible=4, use_ray=True)
    assert counts["orm"] == 0 and counts["train"] == 3 and counts["rollout"] == 1
