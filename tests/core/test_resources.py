"""Resource plans from both YAML forms, and every validation problem reported at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlcore import ConfigError, RoleConfig, RunConfig, load_plugins
from rlcore.runtime.resources import Group, ResourcePlan, parse_ranks, plan_from_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray"


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def load(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def problems_of(config, plugins, **kwargs) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        plan_from_config(config, plugins=plugins, **kwargs)
    assert str(info.value).startswith(f"the resource plan has {len(info.value.problems)} problem(s)")
    return info.value.problems


# -------------------------------------------------------------------------
# ranks
# -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (3, 3),
        ([0, 1, 2, 3], [0, 1, 2, 3]),
        ([5, 2], [5, 2]),
        ("list(range(0, 4))", [0, 1, 2, 3]),
        ("range(2, 4)", [2, 3]),
        ("range(2,4)", [2, 3]),
        ("list(range(0, 8, 2))", [0, 2, 4, 6]),
        ("range(3)", [0, 1, 2]),
        ("  list( range(1, 3) )  ", [1, 2]),
    ],
)
def test_parse_ranks_accepts_every_form(value, expected):
    assert parse_ranks(value) == expected


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("list(range(0, 4)", "ranks must be"),  # unbalanced
        ("range(0, 4))", "ranks must be"),
        ("__import__('os').system('echo hi')", "ranks must be"),
        ("[0, 1]", "ranks must be"),
        ("range(a, b)", "ranks must be"),
        ("range(0, 4, 0)", "step 0"),
        ("range(4, 2)", "is empty"),
        (0, "between 1 and 65536"),
        (-2, "between 1 and 65536"),
        (True, "ranks must be"),
        ([0, 0], "twice"),
        ([0, -1], "ints from 0 to 65535"),
        ([], "ints from 0 to 65535"),
        (2.5, "ranks must be"),
    ],
)
def test_parse_ranks_rejects_malformed(value, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        parse_ranks(value)


# -------------------------------------------------------------------------
# the device_groups form
# -------------------------------------------------------------------------


def test_device_groups_counts_follow_the_previous_gpu_group(plugins):
    plan = plan_from_config(
        {
            "device_groups": {
                "nproc_per_node": 8,
                "a": {"device": "GPU", "ranks": 2, "workers": ["sampler"]},
                "cpu": {"device": "CPU", "ranks": 3, "workers": ["orm"]},
                "b": {"device": "gpu", "ranks": 3, "workers": ["prm"]},
                "c": {"device": "GPU", "ranks": [6, 7], "workers": "teacher"},
            }
        },
        plugins=plugins,
    )
    assert plan.ranks_of("sampler") == (0, 1)
    assert plan.ranks_of("prm") == (2, 3, 4)
    assert plan.ranks_of("teacher") == (6, 7)
    assert plan.ranks_of("orm") == () and plan.num_workers("orm") == 3
    assert plan.group_of("orm") == Group("cpu", "CPU", 3, ("orm",))
    assert plan.roles == ("sampler", "orm", "prm", "teacher")
    assert plan.nodes == (0,) and plan.gpu_ranks == (0, 1, 2, 3, 4, 6, 7)


def test_device_groups_as_a_json_string_and_default_nproc(plugins):
    groups = {"g": {"device": "GPU", "ranks": "range(0, 3)", "workers": ["sampler", "prm"]}}
    plan = plan_from_config({"device_groups": json.dumps(groups)}, plugins=plugins)
    assert plan.nproc_per_node == 3 and plan.nnodes == 1
    assert plan.roles_on(1) == ("sampler", "prm")
    assert plan.roles_on(5) == ()


def test_device_groups_multi_node(plugins):
    plan = plan_from_config(
        {"nnodes": 2, "device_groups": {"nproc_per_node": 2, "g": {"ranks": [0, 3], "workers": ["default"]}}},
        plugins=plugins,
    )
    assert plan.nnodes == 2 and plan.nodes == (0, 1)


def test_device_groups_without_nnodes_span_the_nodes_their_ranks_need(plugins):
    """The seed's two-node layout as ms-swift writes it: rank r is on node r // nproc_per_node."""
    groups = {"nproc_per_node": 8, "default": {"device": "GPU", "ranks": "list(range(0, 16))", "workers": ["default"]}}
    plan = plan_from_config({"device_groups": groups}, roles=["default"], plugins=plugins)
    assert (plan.nnodes, plan.nodes, plan.num_workers("default")) == (2, (0, 1), 16)
    with pytest.raises(ConfigError, match=r"rank\(s\) \[8, 9, .* beyond nproc_per_node \* nnodes = 8 \* 1"):
        plan_from_config({"device_groups": {**groups, "nnodes": 1}}, roles=["default"], plugins=plugins)


def test_sampling_example(plugins):
    plan = plan_from_config(load("sample/sampling.yaml"), roles=["sampler", "prm", "orm"], plugins=plugins)
    assert plan.nproc_per_node == 4
    assert plan.ranks_of("sampler") == (0, 1)
    assert plan.ranks_of("prm") == plan.ranks_of("orm") == (2, 3)
    assert plan.roles_on(2) == ("prm", "orm") and plan.roles_on(0) == ("sampler",)


def test_every_device_groups_problem_at_once(plugins):
    config = {
        "colocate_groups": [["train", "rollout"]],
        "train": {"gpus": 2},
        "device_groups": {
            "nproc_per_node": 4,
            "nnodes": 1,  # given: rank 9 is then beyond the cluster (left out, nnodes follows the ranks)
            "a": {"device": "GPU", "ranks": "list(range(0, 3))", "workers": ["samplr"]},
            "b": {"device": "GPU", "ranks": [2, 3, 9], "workers": ["prm"]},
            "c": {"device": "CPU", "ranks": [0, 1], "workers": ["orm"]},
            "d": {"device": "GPU", "ranks": "range(0, 2", "workers": ["teacher"]},
            "e": {"device": "TPU", "ranks": 1, "workers": ["reference"]},
            "f": {"device": "GPU", "rank": 1, "workers": ["default"]},
        },
    }
    problems = problems_of(config, plugins)
    text = "\n".join(f"{k}: {m}" for k, m in problems)
    expected = [
        ("device_groups", "both resource forms are given"),
        ("colocate_groups", "belongs to the per-role form"),
        ("device_groups.a.workers", "role 'samplr' is not registered by any plugin"),
        ("device_groups.a.workers", "Did you mean 'sampler'?"),
        ("device_groups.c.ranks", "a CPU group's ranks is a process count"),
        ("device_groups.d.ranks", "ranks must be"),
        ("device_groups.e.device", "must be GPU or CPU"),
        ("device_groups.f.rank", "unknown key"),
        ("device_groups.f.ranks", "is missing"),
        ("device_groups.b.ranks", "groups 'a' and 'b' both claim GPU rank(s) [2]"),
        ("device_groups", "group 'b' (prm) has rank(s) [9] beyond nproc_per_node * nnodes = 4 * 1 = 4"),
    ]
    for key, fragment in expected:
        assert any(k == key and fragment in m for k, m in problems), f"missing {key}: {fragment}\n{text}"
    assert len(problems) == len(expected) - 1  # the two 'a.workers' fragments are one message


def test_device_groups_roles_must_match_the_algorithm(plugins):
    config = {"device_groups": {"g": {"ranks": 1, "workers": ["sampler", "teacher"]},
                                "h": {"ranks": 1, "workers": ["sampler"]}}}
    problems = problems_of(config, plugins, roles=["sampler", "orm"])
    assert ("device_groups.h.workers", "role 'sampler' is already in group 'g'; a role belongs to one group") in problems
    assert ("device_groups", "role 'orm' is in no group; add it to a group's workers") in problems
    assert any(k == "device_groups.g.workers" and "role 'teacher' is not used here" in m for k, m in problems)


def test_nnodes_without_nproc_is_an_error(plugins):
    problems = problems_of({"device_groups": {"nnodes": 2, "g": {"ranks": 4, "workers": ["default"]}}}, plugins)
    assert problems == [("device_groups.nproc_per_node", "is required when nnodes is 2")]


# -------------------------------------------------------------------------
# the per-role form
# -------------------------------------------------------------------------


def test_grpo_examples(plugins):
    colocated = plan_from_config(load("grpo/colocate.yaml"), roles=["train", "rollout"], plugins=plugins)
    assert colocated.nproc_per_node == 4
    assert colocated.ranks_of("train") == colocated.ranks_of("rollout") == (0, 1, 2, 3)
    assert colocated.groups == (Group("train+rollout", "GPU", (0, 1, 2, 3), ("train", "rollout")),)
    assert colocated.colocate_groups == (("train", "rollout"),)

    separate = plan_from_config(load("grpo/separate.yaml"), roles=["train", "rollout"], plugins=plugins)
    assert separate.nproc_per_node == 8
    assert separate.ranks_of("train") == (0, 1, 2, 3) and separate.ranks_of("rollout") == (4, 5, 6, 7)
    assert separate.roles_on(5) == ("rollout",)


def test_gkd_examples(plugins):
    colocated = plan_from_config(load("gkd/teacher_colocated.yaml"), roles=["train", "rollout"], plugins=plugins)
    assert colocated.roles == ("train", "rollout") and colocated.nproc_per_node == 4

    standalone = plan_from_config(load("gkd/teacher_standalone.yaml"), roles=["train", "rollout", "teacher"],
                                  plugins=plugins)
    assert standalone.ranks_of("train") == standalone.ranks_of("rollout") == (0, 1, 2, 3)
    assert standalone.ranks_of("teacher") == (4, 5, 6, 7) and standalone.nproc_per_node == 8

    shared = plan_from_config(load("gkd/teacher_shared.yaml"), roles=["train", "rollout", "teacher"], plugins=plugins)
    assert shared.roles_on(3) == ("train", "rollout", "teacher") and shared.nproc_per_node == 4


def test_cpu_roles_and_declaration_order(plugins):
    plan = plan_from_config({"teacher": {"gpus": 2}, "orm": {"gpus": 0, "cpus": 3}, "train": {"gpus": 1}},
                            plugins=plugins)
    assert plan.roles == ("teacher", "orm", "train")
    assert plan.ranks_of("teacher") == (0, 1) and plan.ranks_of("train") == (2,)
    assert plan.group_of("orm") == Group("orm", "CPU", 3, ("orm",))
    assert plan.nproc_per_node == 3


def test_roles_without_a_section_get_one_cpu_worker(plugins):
    plan = plan_from_config({"train": {"gpus": 2}}, roles=["train", "reference"], plugins=plugins)
    assert plan.group_of("reference") == Group("reference", "CPU", 1, ("reference",))


def test_a_pydantic_config(plugins):
    class Config(RunConfig):
        train: RoleConfig = RoleConfig(gpus=2)
        rollout: RoleConfig = RoleConfig(gpus=2)

    plan = plan_from_config(Config(colocate_groups=[["train", "rollout"]], placement="separate",
                                   nproc_per_node=8), plugins=plugins, policy="pack")
    assert plan.ranks_of("rollout") == (0, 1) and plan.nproc_per_node == 8
    with pytest.raises(ConfigError, match="placement 'separate' gives every role its own GPUs"):
        plan_from_config(Config(colocate_groups=[["train", "rollout"]], placement="separate"), plugins=plugins)


def test_policies_pick_ranks(plugins):
    config = {"nnodes": 2, "nproc_per_node": 4, "train": {"gpus": 4}, "rollout": {"gpus": 2}}
    assert plan_from_config(config, plugins=plugins, policy="pack").ranks_of("rollout") == (4, 5)
    spread = plan_from_config(config, plugins=plugins, policy="spread")
    assert spread.ranks_of("train") == (0, 4, 1, 5) and spread.ranks_of("rollout") == (2, 6)
    with pytest.raises(ConfigError, match="all must ask the same count; got train.gpus=4, rollout.gpus=2"):
        plan_from_config(config, plugins=plugins, policy="colocate")
    config["rollout"]["gpus"] = 4
    assert plan_from_config(config, plugins=plugins, policy="colocate").roles_on(0) == ("train", "rollout")


def test_default_nnodes_splits_the_need(plugins):
    plan = plan_from_config({"nnodes": 2, "train": {"gpus": 4}, "rollout": {"gpus": 4}}, plugins=plugins)
    assert plan.nproc_per_node == 4 and plan.nodes == (0, 1)


def test_every_role_form_problem_at_once(plugins):
    config = {
        "colocate_groups": [["train", "rollout"], ["teachr"], ["reference", "train"], ["orm"]],
        "train": {"gpus": 4},
        "rollout": {"gpus": 2},
        "reference": {"gpus": -1},
        "orm": {"cpus": 0},
        "trian": {"gpus": 1},
        "nnodes": 0,
        "placement": "pakc",
    }
    problems = problems_of(config, plugins)
    text = "\n".join(f"{k}: {m}" for k, m in problems)
    expected = [
        ("trian", "no plugin registers a role 'trian'"),
        ("reference.gpus", "must be an int >= 0; got -1"),
        ("orm.cpus", "must be an int >= 1; got 0"),
        ("colocate_groups[0]", "colocated roles must ask the same number of GPUs; got train.gpus=4, rollout.gpus=2"),
        ("colocate_groups[1]", "Did you mean 'teacher'?"),
        ("colocate_groups[2]", "role 'reference' has no GPUs"),
        ("colocate_groups[2]", "role 'train' is also in colocate_groups[0]"),
        ("colocate_groups[3]", "role 'orm' has no GPUs"),
        ("nnodes", "must be an int from 1 to 65536; got 0"),
        ("placement", "placement 'pakc' is not registered; known: colocate, pack, "),
        ("placement", "Did you mean 'pack'?"),
    ]
    for key, fragment in expected:
        assert any(k == key and fragment in m for k, m in problems), f"missing {key}: {fragment}\n{text}"
    assert len(problems) == len(expected) - 1  # the two 'placement' fragments are one message


def test_rank_beyond_the_cluster(plugins):
    problems = problems_of({"nproc_per_node": 4, "train": {"gpus": 4}, "rollout": {"gpus": 2}}, plugins)
    assert problems == [("nproc_per_node", "group 'rollout' (rollout) has rank(s) [4, 5] beyond nproc_per_node * "
                         "nnodes = 4 * 1 = 4; raise nproc_per_node or nnodes, or ask fewer GPUs")]


def test_role_form_roles_must_match_the_algorithm(plugins):
    problems = problems_of({"train": {"gpus": 2}, "teacher": {"gpus": 2}}, plugins, roles=["train", "critic"])
    assert ("teacher.gpus", "role 'teacher' is not used here; the roles are: train, critic. Remove the section") in problems
    assert any(k == "roles" and "role 'critic' is not registered" in m for k, m in problems)


def test_plan_queries():
    plan = ResourcePlan((Group("g", "GPU", (2, 3), ("prm", "orm")),), nproc_per_node=2, nnodes=2)
    assert plan.nodes == (1,) and plan.num_workers("orm") == 2
    assert "g (prm, orm): GPU ranks [2, 3]" in plan.describe()
    with pytest.raises(KeyError, match="role 'train' is not in the plan"):
        plan.ranks_of("train")


def test_import_rlcore_imports_no_ray():
    code = "import sys, rlcore, rlcore.runtime.resources, rlcore.runtime.placement; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_huge_ranges_are_refused_before_they_are_expanded_and_errors_stay_short():
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match="names 200000000 ranks; a plan holds at most 65536"):
        parse_ranks("range(0, 200000000)")
    assert time.perf_counter() - start < 1
    with pytest.raises(ConfigError) as err:  # a million ranks on 8 GPUs: the error lists a few, not all
        plan_from_config({"device_groups": {"nproc_per_node": 8, "nnodes": 1, "g": {"ranks": "range(0, 60000)", "workers": ["train"]}}},
                         roles=["train"])
    assert len(str(err.value)) < 2000 and "(59992 in all)" in str(err.value)
