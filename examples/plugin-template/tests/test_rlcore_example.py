"""The example plugin's pieces, called directly and through rlcore's plugin loading."""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest

import rlcore
from rlcore import PlacementRequest, ResourceError
from rlcore_example.policies import reverse_placement, reverse_slice, sum_results


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
