"""The example reward: registered by the installed distribution, scoring known strings, and taking its option
from `reward_kwargs` in a short GRPO run on the CPU with rlcore's tiny model."""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest

import rlcore
from rlcore import ConfigError, RewardSpec, hookimpl
from rlcore.plugins.grpo import GRPOConfig, GRPOTrainer
from rlcore.testing import build_tiny_model
from rlcore_example.rewards import letter_ratio


@pytest.fixture(scope="module")
def plugins() -> rlcore.Plugins:
    try:
        md.distribution("rlcore-example-plugin")
    except md.PackageNotFoundError:
        pytest.fail("rlcore-example-plugin is not installed: run `pip install ./examples/plugin-template`")
    return rlcore.load_plugins()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def grpo(tmp_path, tiny: str, **overrides) -> GRPOConfig:
    """Two GRPO steps of 16 completions (4 prompts x 4) of at most 8 tokens: a few seconds on a CPU."""
    return GRPOConfig(model=tiny, output_dir=str(tmp_path / "run"), max_steps=2, learning_rate=1e-3,
                      max_completion_length=8, per_device_train_batch_size=16, num_generations=4, **overrides)


def test_letter_ratio_is_registered_by_the_distribution(plugins):
    assert plugins.rewards.owner("letter_ratio") == "example"
    assert plugins.rewards.get("letter_ratio").fn is letter_ratio


def test_letter_ratio_scores_known_strings():
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "see"}]
    assert letter_ratio(["p"] * 4, ["eel", "abc", "", conversation]) == [2 / 3, 0.0, 0.0, 2 / 3]
    assert letter_ratio(["p"] * 2, ["abba", "cab"], letter="a") == [0.5, 1 / 3]
    assert letter_ratio(prompts=["p"], completions=["eve"], completion_ids=[[1, 2]], solution=["x"]) == [2 / 3]


class Recorder:
    """A second reward, weighted 0, that keeps each step's completions so the test can score them itself."""

    def __init__(self):
        self.calls: list[list[str]] = []

    @hookimpl
    def rlcore_rewards(self):
        yield RewardSpec("recorded", fn=self.record)

    def record(self, prompts, completions, completion_ids=None, **columns):
        self.calls.append(list(completions))
        return [0.0] * len(completions)


def mean_ratio(completions: list[str], **option) -> float:
    return sum(letter_ratio([""] * len(completions), completions, **option)) / len(completions)


def test_a_grpo_run_passes_the_option_from_reward_kwargs(plugins, tmp_path, tiny):
    recorder, with_recorder = Recorder(), rlcore.load_plugins()
    with_recorder.register(recorder, "recorder")
    config = grpo(tmp_path, tiny, reward_funcs=["letter_ratio", "recorded"], reward_weights=[1.0, 0.0],
                  reward_kwargs={"letter_ratio": {"letter": " "}})
    GRPOTrainer(config, with_recorder).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(recorder.calls) == 2
    for row, completions in zip(rows, recorder.calls):
        assert row["rewards/letter_ratio/mean"] == pytest.approx(mean_ratio(completions, letter=" "), abs=1e-6)
        assert row["rewards/letter_ratio/mean"] != pytest.approx(mean_ratio(completions), abs=1e-6)  # "e", the default


def test_an_unknown_option_is_refused_before_the_run_starts(plugins, tmp_path, tiny):
    config = grpo(tmp_path, tiny, reward_funcs=["letter_ratio"], reward_kwargs={"letter_ratio": {"leter": "a"}})
    with pytest.raises(ConfigError, match=r"reward_kwargs.letter_ratio.leter: reward 'letter_ratio' has no option "
                                          r"'leter'; it takes letter. Did you mean 'letter'\?"):
        GRPOTrainer(config, plugins)
    assert not (tmp_path / "run").exists()
