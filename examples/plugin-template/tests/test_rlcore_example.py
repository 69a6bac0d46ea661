"""The example plugin's pieces, called directly and through rlcore's plugin loading."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest

import rlcore
from rlcore import NotRegistered, PlacementRequest, ResourceError, function, worker
from rlcore_example.policies import reverse_placement, reverse_slice, sum_results
from rlcore_example.scorer import Scorer, square


@pytest.fixture(scope="module")
def plugins() -> rlcore.Plugins:
    try:
        md.distribution("rlcore-example-plugin")
    except md.PackageNotFoundError:
        pytest.fail("rlcore-example-plugin is not installed: run `pip install ./examples/plugin-template`")
    return rlcore.load_plugins()


def test_reverse_slice_gives_worker_zero_the_last_shard():
    calls = reverse_slice(3, ([1, 2, 3, 4, 5, 6, 7], "whole"), {"w": [10, 20, 30, 40, 50, 60, 70]}, None)
    assert calls == [
        (([6, 7], "whole"), {"w": [60, 70]}),
        (([4, 5], "whole"), {"w": [40, 50]}),
        (([1, 2, 3], "whole"), {"w": [10, 20, 30]}),
    ]


def test_reverse_slice_skips_workers_with_empty_shards():
    assert reverse_slice(3, ([1],), {}, None) == [None, None, (([1],), {})]
    with pytest.raises(ValueError, match="n=0"):
        reverse_slice(0, ([1],), {}, None)


def test_sum_adds_numbers_and_tuples_and_skips_none():
    assert sum_results([1, None, 2.5]) == 3.5
    assert sum_results([(1, 2), (3, 4)]) == (4, 6)


def test_reverse_placement_fills_from_the_last_rank_and_shares_colocated_gpus():
    request = PlacementRequest(
        roles={"train": 2, "rollout": 2, "reference": 3, "orm": 0},
        colocate_groups=(("train", "rollout"),),
        nproc_per_node=4,
        nnodes=2,
    )
    assert reverse_placement(request) == {"train": [7, 6], "rollout": [7, 6], "reference": [5, 4, 3], "orm": []}


def test_reverse_placement_errors_name_the_role():
    with pytest.raises(ResourceError, match="'rollout' ask for 2 and 3 GPUs"):
        reverse_placement(PlacementRequest({"train": 2, "rollout": 3}, (("train", "rollout"),), 8))
    with pytest.raises(ResourceError, match="role 'teacher' asks for 5 GPUs but only 4 of 8"):
        reverse_placement(PlacementRequest({"train": 4, "teacher": 5}, (), 8))


def test_registered_under_the_entry_point(plugins):
    info = plugins.info["example"]
    assert info.distribution == "rlcore-example-plugin"
    assert plugins.dispatchers.get("reverse_slice").split is reverse_slice
    assert plugins.collectors.get("sum").collect is sum_results
    assert plugins.placements.get("reverse").place is reverse_placement
    assert plugins.algorithm_of("example") == "example"


def test_trainer_fits_the_line_and_writes_metrics(plugins, tmp_path):
    spec = plugins.algorithms.get("example")
    config = spec.config(output_dir=str(tmp_path), steps=150, lr=0.3, slope=-3.0, intercept=0.5)
    summary = spec.trainer(config, plugins).fit()
    assert summary["w"] == pytest.approx(-3.0, abs=0.1)
    assert summary["b"] == pytest.approx(0.5, abs=0.05)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 151))
    assert rows[-1]["loss"] < rows[0]["loss"] / 100


def test_resume_continues_where_the_checkpoint_left_off(plugins, tmp_path):
    spec = plugins.algorithms.get("example")
    straight = spec.trainer(spec.config(output_dir=str(tmp_path / "a"), steps=60), plugins).fit()
    spec.trainer(spec.config(output_dir=str(tmp_path / "b"), steps=40, save_steps=20), plugins).fit()
    with pytest.raises(rlcore.ConfigError, match="already holds checkpoint-40"):  # never overwritten
        spec.trainer(spec.config(output_dir=str(tmp_path / "b"), steps=60), plugins)
    resumed = spec.trainer(spec.config(output_dir=str(tmp_path / "b"), steps=60, resume="auto"), plugins)
    assert resumed.resume_from.name == "checkpoint-40"
    summary = resumed.fit()
    assert summary["step"] == 60 and summary["w"] == pytest.approx(straight["w"], abs=1e-12)
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 61))


# -------------------------------------------------------------------------
# a worker class of the plugin's own, run through rlcore.RoleSession
# -------------------------------------------------------------------------

RLCORE = Path(sys.executable).with_name("rlcore")
VALUES = [1.0, 2.0, 3.0, 4.0, 5.0]


def scorer_session(plugins, use_ray: bool, worker: type = Scorer) -> rlcore.RoleSession:
    """The `scorer` role as the resource plan places it: 2 CPU workers on Ray, one in-process without."""
    plan = rlcore.plan_from_config({"scorer": {"cpus": 2}}, roles=["scorer"], plugins=plugins)
    setup = rlcore.RoleSetup(worker, square, {"scale": 2.0})  # -> worker(engine, options), options + device
    return rlcore.RoleSession(plan, {"scorer": setup}, use_ray=use_ray, plugins=plugins)


@pytest.mark.parametrize("use_ray", [False, True], ids=["in-process", "ray"])
def test_a_worker_class_calls_through_the_plugins_dispatcher_and_collector(plugins, use_ray, request):
    if use_ray:
        request.getfixturevalue("local_ray")
    session = scorer_session(plugins, use_ray)
    with session.start():
        scorer = session["scorer"]
        assert scorer.score(VALUES) == 2.0 * sum(v * v for v in VALUES)  # collect="sum" joins the shards' scores
        if use_ray:  # dispatch="reverse_slice": worker 0 gets the last shard
            assert scorer.shard(VALUES) == [(0, [4.0, 5.0]), (1, [1.0, 2.0, 3.0])]
        else:
            assert scorer.shard(VALUES) == [(0, VALUES)]
    assert session.describe() == [f"scorer: {2 if use_ray else 1} worker{'s' if use_ray else ''}, "
                                  f"{'CPU' if use_ray else 'in this process'}, engine square"]


@pytest.mark.parametrize("use_ray", [False, True], ids=["in-process", "ray"])
def test_a_misspelled_dispatcher_fails_when_the_group_is_made(plugins, use_ray, request):
    if use_ray:
        request.getfixturevalue("local_ray")
    calls = []

    @worker(group="scorer")
    class Misspelled:
        def __init__(self, engine, options):
            calls.append("__init__")

        @function(dispatch="reverse_slcie", collect="sum")
        def score(self, values):
            calls.append("score")

    with pytest.raises(NotRegistered, match=r"Misspelled\.score\(\): dispatch 'reverse_slcie' is not registered; "
                       r"known: .*reverse_slice.* Did you mean 'reverse_slice'\?"):
        with scorer_session(plugins, use_ray, Misspelled).start():
            pass
    assert calls == []  # neither built nor called


def test_a_misspelled_dispatcher_in_the_config_is_refused_before_the_run(tmp_path):
    (tmp_path / "run.yaml").write_text("steps: 3\n")
    done = subprocess.run(
        [str(RLCORE), "config", "validate", "--plugin", "example", "--config", "run.yaml",
         "dispatch=reverse_slcie", "collect=summ"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "dispatch: dispatch 'reverse_slcie' is not registered" in done.stderr
    assert "Did you mean 'reverse_slice'?" in done.stderr and "Did you mean 'sum'?" in done.stderr


# -------------------------------------------------------------------------
# plain files: a subclass replacing GRPO, and a hook-only file, in one run
# -------------------------------------------------------------------------

MY_GRPO = """
from rlcore import AlgorithmSpec, hookimpl
from rlcore.plugins.grpo import GRPOConfig, GRPOTrainer

class MyGRPO(GRPOTrainer):
    def train_step(self):
        return {**super().train_step(), "my_metric": 1.0}

@hookimpl
def rlcore_algorithms():
    yield AlgorithmSpec("grpo", config=GRPOConfig, trainer=MyGRPO)
"""

POST_METRICS = """
import json
from rlcore import hookimpl

@hookimpl
def rlcore_step_end(trainer, step, metrics):
    with open("posted.jsonl", "a") as f:  # stands in for posting the metrics to a service
        f.write(json.dumps({"step": step, "reward": metrics["reward"], "trainer": type(trainer).__name__}) + "\\n")
"""


def test_a_grpo_subclass_replaces_grpo_and_a_hook_only_file_joins_the_run(tmp_path):
    (tmp_path / "my_grpo.py").write_text(MY_GRPO)
    (tmp_path / "post_metrics.py").write_text(POST_METRICS)
    done = subprocess.run(
        [str(RLCORE), "run", "--plugin", "./my_grpo.py", "--with", "./post_metrics.py", "output_dir=out",
         "max_steps=2", "max_completion_length=8", "per_device_train_batch_size=16", "num_generations=4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "rlcore: algorithm 'grpo' from ./my_grpo.py (MyGRPO) replaces the built-in one for this run" in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["my_metric"] for r in rows] == [1.0, 1.0]
    posted = [json.loads(line) for line in (tmp_path / "posted.jsonl").read_text().splitlines()]
    assert posted == [{"step": r["step"], "reward": r["reward"], "trainer": "MyGRPO"} for r in rows]


def test_an_engine_adds_its_key_to_every_rollout_section(plugins, tmp_path):
    """`EngineSpec(keys=EchoKeys)`: `rollout.echo_repeat` is a key of GRPO's config (core names it nowhere), checked
    by pydantic, shown by `config show`, and given to the engine where `rollout.engine: echo`, only there."""
    from rlcore import SamplingParams, rollout_options

    model = plugins.config_model("grpo")
    config = rlcore.load_config(model, None, ["rollout.engine=echo", "rollout.echo_repeat=3"], plugins=plugins)
    options = rollout_options(config.rollout, "m", 0)
    assert options["echo_repeat"] == 3
    engine = plugins.engines.get("echo", kind="rollout").factory(**options)
    (done,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8))
    assert done.token_ids == [7, 7, 7]
    assert "echo_repeat" not in rollout_options(rlcore.load_config(model, None, ["rollout.echo_repeat=3"], plugins=plugins).rollout, "m", 0)
    with pytest.raises(rlcore.ConfigError) as refused:
        rlcore.load_config(model, None, ["rollout.echo_repeat=0"], plugins=plugins)
    assert [key for key, _ in refused.value.problems] == ["rollout.echo_repeat"]
    shown = subprocess.run([sys.executable, "-m", "rlcore", "config", "show", "--plugin", "grpo"], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.strip().startswith("echo_repeat:")]
    assert lines[at].strip() == "echo_repeat: 2" and "repeats a prompt's last token" in lines[at - 1]
