"""The GRPO config: the reference examples load and place; the demo defaults apply only to the demo."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore import ConfigError, load_config
from rlcore.plugins.grpo.config import DEMO_DEFAULTS, GRPOConfig
from rlcore.resources import plan_from_config

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "ray" / "grpo").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_load_and_place(path):
    config = load_config(GRPOConfig, str(path))
    plan = plan_from_config(config, roles=["train", "rollout"])
    train, rollout = plan.ranks_of("train"), plan.ranks_of("rollout")
    if config.device_groups:  # ms-swift's form: the roles of one group share its GPUs
        colocated = plan.group_of("train") == plan.group_of("rollout")
    else:
        assert len(train) == config.train.gpus and len(rollout) == config.rollout.gpus
        colocated = [["train", "rollout"]] == config.colocate_groups
    assert (train == rollout) if colocated else not set(train) & set(rollout)
    assert config.rollout.engine == "vllm"


@pytest.mark.parametrize("layout", ["colocate", "separate"])
def test_device_groups_examples_mirror_the_per_role_ones(layout):
    """`<layout>_device_groups.yaml` is `<layout>.yaml` in ms-swift's form: the same keys, the same GPUs."""
    folder = EXAMPLES[0].parent
    per_role = load_config(GRPOConfig, str(folder / f"{layout}.yaml"))
    per_group = load_config(GRPOConfig, str(folder / f"{layout}_device_groups.yaml"))
    placement = {"device_groups": True, "colocate_groups": True, "train": {"gpus"}, "rollout": {"gpus"}}
    assert per_group.model_dump(exclude=placement) == per_role.model_dump(exclude=placement)
    one, other = (plan_from_config(c, roles=["train", "rollout"]) for c in (per_role, per_group))
    assert one.nproc_per_node == other.nproc_per_node
    assert [one.ranks_of(r) for r in ("train", "rollout")] == [other.ranks_of(r) for r in ("train", "rollout")]


def test_demo_defaults_apply_only_without_a_model_or_dataset():
    assert GRPOConfig().learning_rate == DEMO_DEFAULTS["learning_rate"]
    assert GRPOConfig(max_steps=3).max_steps == 3  # what the user sets wins
    assert GRPOConfig(lr=0.5).learning_rate == 0.5  # also through the alias
    real = GRPOConfig(model="some/model")
    assert real.learning_rate == 1e-6 and real.max_completion_length == 256  # TRL's defaults


def test_inconsistent_keys_are_reported_with_their_names():
    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, None, ["reward_weights=[1, 2]", "async_generate=true",
                                       "colocate_groups=[[train, rollout]]"])
    text = str(err.value)
    assert "reward_weights has 2 weights for 1 reward_funcs" in text
    assert "async_generate needs train and rollout on separate devices" in text


GPU_ROLES = {"train": {"gpus": 1}, "rollout": {"gpus": 1, "engine": "vllm"}}


@pytest.mark.parametrize(
    ("overrides", "transport"),
    [
        ({**GPU_ROLES, "colocate_groups": [["train", "rollout"]]}, "cuda_ipc"),
        ({"train": {"gpus": 2}, "rollout": {"gpus": 2, "engine": "vllm", "vllm_tensor_parallel_size": 2},
          "colocate_groups": [["train", "rollout"]]}, "object_store"),
        (GPU_ROLES, "nccl"),
        ({"train": {"gpus": 1, "engine_kwargs": {"device": "cpu"}}, "rollout": {"gpus": 1, "engine_kwargs": {"device": "cpu"}}},
         "object_store"),
    ],
    ids=["colocated", "colocated-tp2", "separate", "cpu"],
)
def test_weight_sync_transport_follows_the_layout(overrides, transport):
    from rlcore.plugins.grpo.runtime import RoleRuntime

    config = GRPOConfig(model="m", output_dir="unused", **overrides)
    assert RoleRuntime(config, use_ray=True).transport == transport
    assert RoleRuntime(config, use_ray=False).transport == "in_process"


def test_cuda_ipc_without_colocated_gpus_names_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, None, ["model=m", "weight_sync_backend=cuda_ipc", "train.gpus=1", "rollout.gpus=1"])
    assert "weight_sync_backend cuda_ipc hands GPU memory between processes on one GPU" in str(err.value)
