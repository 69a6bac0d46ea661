"""GRPO over multi-turn episodes: the loss mask of a round's batch, and the shipped demo through `rlcore run`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore import ConfigError, load_config, load_plugins
from rlcore.episodes import Episode
from rlcore.plugins.grpo.config import GRPOConfig
from rlcore.plugins.grpo.experience import ExperienceMaker
from rlcore.testing import resolve_tiny

ROOT = Path(__file__).parents[2]


def test_only_the_tokens_the_model_generated_are_in_the_loss_mask(tiny_model, tmp_path):
    """An episode's observation tokens (mask 0) stay out of completion_mask, the rollout's log-probs sit on the
    generated tokens; a truncated episode leaves the loss with mask_truncated_completions."""
    config = GRPOConfig(model=str(tiny_model), tools=["examples/multi_turn/tools.py:vowels"], output_dir=str(tmp_path),
                        mask_truncated_completions=True, per_device_train_batch_size=2, num_generations=2)
    maker = ExperienceMaker(resolve_tiny(config), load_plugins(), dp_size=1)  # its default dataset, tiny:toy, as a run
    mask = [1, 1, 0, 0, 0, 1, 1]
    episodes = [Episode(0, [5, 6, 7, 8, 9, 10, 11], [-0.1, -0.2, 0, 0, 0, -0.3, -0.4], "stop", prompt_ids=[1, 2, 3],
                        loss_mask=mask),
                Episode(0, [5, 6], [-0.5, -0.6], "length", prompt_ids=[1, 2, 3, 4], loss_mask=[1, 1])]
    batch = maker.build_batch([e.prompt_ids for e in episodes], episodes)
    assert batch["completion_mask"][0].tolist() == [0, 0, 0, *mask]
    assert batch["rollout_logprobs"][0, 3:].tolist() == pytest.approx([-0.1, -0.2, 0, 0, 0, -0.3, -0.4])
    assert batch["completion_mask"][1].sum() == 0  # truncated: masked out


def test_multi_turn_keys_are_checked_before_the_run(tmp_path):
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    config = GRPOConfig(model="tiny", multi_turn_scheduler="math_tip_trik", tools=["vowels"], output_dir=str(tmp_path))
    problems = dict(GRPOTrainer.problems(config, load_plugins()))
    assert "Did you mean 'math_tip_trick'" in problems["multi_turn_scheduler"]
    assert "module:function" in problems["tools.0"]
    with pytest.raises(ConfigError, match="max_turns"):
        load_config(GRPOConfig, overrides=["max_turns=0"])


def test_the_hint_demo_runs_episodes_through_rlcore_run(tmp_path):
    """The shipped examples/multi_turn/vowel_hint.yaml (a user's environment file), scaled to two steps: episodes
    take several turns, the train engine's log-probs of every generated token across turns are the sampler's (the
    sampling difference), and the environment's reward is the reward."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "--config", "examples/multi_turn/vowel_hint.yaml",
         "max_steps=2", "per_device_train_batch_size=8", "num_generations=4", f"output_dir={out}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["episodes/turns"] > 1.5 and row["episodes/environment_errors"] == 0
        assert row["episodes/generated_tokens"] < row["completions/mean_length"]  # the hints are in, not trained
        assert row["sampling/sampling_logp_difference/max"] < 1e-4
        assert row["reward"] == row["rewards/environment/mean"] > 0
    logged = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged] == [1, 1, 2, 2]  # two whole conversations per step
    assert logged[0]["messages"][0]["role"] == "assistant" and logged[0]["turns"] == len(
        [m for m in logged[0]["messages"] if m["role"] == "assistant"])


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "multi_turn").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_multi_turn_examples_load_and_name_what_exists(path, monkeypatch):
    from rlcore.runtime.resources import plan_from_config

    monkeypatch.chdir(ROOT)
    config = load_config(GRPOConfig, str(path))
    assert config.multi_turn and config.multi_turn_problems(load_plugins()) == []
    plan_from_config(config, roles=["train", "rollout"])
