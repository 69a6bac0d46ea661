"""Config loading: a YAML file plus dotted overrides, every problem at once, a render that round-trips."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
from pydantic import Field

from rlcore import ConfigError, RoleConfig, RunConfig
from rlcore.config import load_config
from rlcore.yaml_io import render_config


class DemoConfig(RunConfig):
    """A config shaped like an algorithm's: scalars, a role section, an optional role section."""

    lr: float = Field(1e-5, description="learning rate")
    num_generations: int = Field(8, ge=1, description="completions per prompt")
    train: RoleConfig = Field(default_factory=RoleConfig, description="the train role")
    teacher: RoleConfig | None = Field(None, description="a separate teacher role")
    note: str = Field("1e-6", description="a string that looks like a number")


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def problems_of(excinfo) -> dict[str, str]:
    return dict(excinfo.value.problems)


def test_a_config_with_three_mistakes_reports_all_three(tmp_path):
    path = write(tmp_path, "lr: fast\nnum_generation: 4\ntrain:\n  gpus: 2\n  engnie: vllm\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(DemoConfig, path)
    problems = problems_of(excinfo)
    assert set(problems) == {"lr", "num_generation", "train.engnie"}
    assert "valid number" in problems["lr"] and "'fast'" in problems["lr"]
    assert "Did you mean 'num_generations'?" in problems["num_generation"]
    assert "Did you mean 'engine'?" in problems["train.engnie"]
    assert "3 problems" in str(excinfo.value) and str(path) in str(excinfo.value)


def test_overrides_win_over_the_file_and_parse_as_yaml(tmp_path):
    path = write(tmp_path, "lr: 0.5\ntrain: {gpus: 2, engine: hf}\ncolocate_groups: []\n")
    config = load_config(
        DemoConfig,
        path,
        ["lr=1e-6", "train.gpus=8", "colocate_groups=[[train,rollout]]", "teacher.gpus=4", "offload_model=true"],
    )
    assert config.lr == 1e-6 and isinstance(config.lr, float)
    assert config.train.gpus == 8 and config.train.engine == "hf"
    assert config.colocate_groups == [["train", "rollout"]]
    assert config.teacher == RoleConfig(gpus=4)
    assert config.offload_model is True


def test_a_json_string_sets_a_dict_valued_key():
    config = load_config(
        DemoConfig, None,
        ['device_groups={"nproc_per_node": 4, "sample_group": {"device": "GPU", "ranks": "list(range(0, 2))"}}'],
    )
    assert config.device_groups == {
        "nproc_per_node": 4, "sample_group": {"device": "GPU", "ranks": "list(range(0, 2))"},
    }


def test_nothing_is_evaluated():
    with pytest.raises(ConfigError) as excinfo:
        load_config(DemoConfig, None, ["seed=__import__('os').getpid()"])
    assert "__import__" in problems_of(excinfo)["seed"]


def test_an_unknown_nested_key_suggests_the_closest_one_also_on_the_command_line(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        load_config(DemoConfig, None, ["teacher.gpsu=2", "trian.gpus=1"])
    problems = problems_of(excinfo)
    assert problems["teacher.gpsu"].startswith("unknown key 'gpsu'. Did you mean 'gpus'?")
    assert "Did you mean 'train'?" in problems["trian"]
    assert all("[set on the command line]" in message for message in problems.values())


def test_an_unknown_key_without_a_close_match_lists_the_known_ones():
    with pytest.raises(ConfigError) as excinfo:
        load_config(DemoConfig, None, ["train.zzz=1"])
    assert "Known keys here: gpus, cpus, engine." in problems_of(excinfo)["train.zzz"]


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, "does not exist"),
        ("lr: 1\ntrain: [unclosed\n", "not valid YAML: line 3"),
        ("- a\n- b\n", "must be a mapping of keys to values, got list"),
    ],
)
def test_file_problems_are_config_errors(tmp_path, text, expected):
    path = tmp_path / "missing.yaml" if text is None else write(tmp_path, text)
    with pytest.raises(ConfigError, match=expected):
        load_config(DemoConfig, path)


def test_malformed_overrides_are_reported_with_the_rest():
    with pytest.raises(ConfigError) as excinfo:
        load_config(DemoConfig, None, ["seed", "lr=[1, 2", "train.gpus=3", "train.gpus.x=1", "num_generations=0"])
    problems = problems_of(excinfo)
    assert "is not of the form key=value" in problems["seed"]
    assert "not valid YAML" in problems["lr"]
    assert "'train.gpus' is 3, not a section" in problems["train.gpus.x"]
    assert "greater than or equal to 1" in problems["num_generations"]


def test_an_empty_file_gives_the_defaults(tmp_path):
    assert load_config(DemoConfig, write(tmp_path, "# nothing\n")) == DemoConfig()


def test_render_round_trips_the_defaults_with_a_comment_per_key(tmp_path):
    text = render_config(DemoConfig)
    assert load_config(DemoConfig, write(tmp_path, text)) == DemoConfig()
    lines = text.splitlines()
    for name, field in DemoConfig.model_fields.items():
        index = lines.index(next(line for line in lines if line.startswith(f"{name}:")))
        assert lines[index - 1] == f"# {field.description}"
    assert "train:\n  # GPUs for this role" in text  # nested sections are rendered as sections
    assert "note: '1e-6'" in text  # a number-like string stays a string


def test_render_of_an_instance_round_trips_its_values(tmp_path):
    config = DemoConfig(
        lr=3e-7, teacher=RoleConfig(gpus=4, engine="vllm"), colocate_groups=[["train", "rollout"]],
        device_groups={"nproc_per_node": 4, "g": {"ranks": [0, 1], "workers": ["sampler"]}}, output_dir="a: b",
    )
    assert load_config(DemoConfig, write(tmp_path, render_config(config))) == config


def test_cross_field_problems_are_reported_under_their_own_keys():
    from pydantic import model_validator

    from rlcore import ConfigProblems, RunConfig

    class Pair(RunConfig):
        low: int = 0
        high: int = 1

        @model_validator(mode="after")
        def _ordered(self):
            if self.low >= self.high:
                raise ConfigProblems([("low", f"({self.low}) must be below high ({self.high})")])
            return self

    with pytest.raises(ConfigError) as err:
        load_config(Pair, None, ["low=5", "high=2"])
    assert err.value.problems == [("low", "(5) must be below high (2)")]
    assert "(top level)" not in str(err.value) and "output_dir" not in str(err.value)  # no dump of the input


def test_min_lr_is_the_floor_of_the_cosine_schedule_and_reaches_the_engines():
    """Megatron's `min_lr` is an optimizer key of every training algorithm: the engines' options carry it, and a
    value the cosine schedule cannot decay to is refused under its own key."""
    from rlcore import OptimizerOptions
    from rlcore.sections import TrainingConfig

    class Run(TrainingConfig):
        max_steps: int = 10

    config = load_config(Run, None, ["lr=1e-5", "min_lr=1e-7", "lr_scheduler_type=cosine", "warmup_steps=1"])
    assert config.optimizer_options() == OptimizerOptions(
        learning_rate=1e-5, min_lr=1e-7, lr_scheduler_type="cosine", warmup_steps=1, max_steps=10)
    assert load_config(Run, None, []).optimizer_options().min_lr == 0.0  # decays to zero, as before
    for overrides, message in (
        (["min_lr=1e-7"], "(1e-07) is the floor of the cosine schedule, but lr_scheduler_type is 'constant'"),
        (["lr_scheduler_type=cosine", "lr=1e-4", "min_lr=1e-3"], "(0.001) is above learning_rate (0.0001)"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(Run, None, overrides)
        assert err.value.problems == [("min_lr", err.value.problems[0][1])] and message in err.value.problems[0][1]


def test_booleans_are_not_numbers():
    from typing import Literal

    class Numbers(RunConfig):
        beta: float = 0.0
        steps: int | None = None
        level: Literal[0, 1, 2] = 1
        flag: bool | int = False  # a key that takes a boolean keeps taking one

    with pytest.raises(ConfigError) as err:
        load_config(Numbers, None, ["beta=true", "steps=false", "level=true", "flag=true"])
    assert sorted(k for k, _ in err.value.problems) == ["beta", "level", "steps"]
    assert "is a number, not a boolean" in str(err.value) and "Value error" not in str(err.value)
    assert load_config(Numbers, None, ["beta=1", "flag=true"]).beta == 1.0


def test_nan_and_infinities_are_refused_in_every_section_and_inside_free_form_options():
    from typing import Any

    class Options(RoleConfig):
        engine_kwargs: dict[str, Any] = Field(default_factory=dict)

    class Numbers(RunConfig):
        lr: float = 1e-5
        weights: list[float] | None = None
        train: Options = Field(default_factory=Options)

    given = ["lr=.inf", "weights=[1, .nan]", "train.engine_kwargs={eps: -.inf, betas: [0.9, .nan]}",
             "device_groups={g: {x: .inf}}", "placement_timeout_s=nan"]
    with pytest.raises(ConfigError) as err:
        load_config(Numbers, None, given)
    problems = problems_of(err)
    assert sorted(problems) == ["device_groups", "lr", "placement_timeout_s", "train.engine_kwargs", "weights.1"]
    assert "finite number" in problems["lr"] and "holds eps = -inf" in problems["train.engine_kwargs"]
    assert "holds g.x = inf" in problems["device_groups"]
    assert load_config(Numbers, None, ["lr=1e300", "train.engine_kwargs={eps: 1e-8}"]).lr == 1e300


# -------------------------------------------------------------------------
# `config show` loads back, from the CLI, for every installed algorithm
# -------------------------------------------------------------------------

ALGORITHMS = ["grpo", "gkd", "sft", "pt", "sample", "distill", "example", "bandit"]  # every one `rlcore plugins` lists


def test_every_installed_algorithm_is_tested_for_loading_back(python_m_rlcore):
    listed = json.loads(python_m_rlcore("plugins", "--json").stdout)
    assert sorted(a for row in listed for a in row["provides"].get("algorithms", [])) == sorted(ALGORITHMS)


# what a shown config leaves unset and a run needs: the model (and data), named on the command line; the tiny model's
# context is 1024 positions, below sampling's default prompt length
NAMED = {"grpo": ["model=tiny"], "gkd": ["model=tiny", "teacher_model=tiny:teacher"],
         "sft": ["model=tiny", "dataset=tiny:sft"], "pt": ["model=tiny", "dataset=tiny:pt"],
         "sample": ["model=tiny", "max_prompt_length=512"], "distill": ["model=tiny", "max_prompt_length=512"]}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_config_show_loads_back_to_the_same_values(python_m_rlcore, tmp_path, algorithm):
    shown = python_m_rlcore("config", "show", "--plugin", algorithm)
    assert shown.returncode == 0, shown.stderr
    (tmp_path / "my.yaml").write_text(shown.stdout)
    valid = python_m_rlcore("config", "validate", "--plugin", algorithm, "--config", "my.yaml", *NAMED.get(algorithm, ()))
    assert (valid.returncode, valid.stdout) == (0, f"my.yaml: valid for algorithm '{algorithm}'\n"), valid.stderr
    again = python_m_rlcore("config", "show", "--plugin", algorithm, "--config", "my.yaml")
    assert again.stdout == shown.stdout  # every value, as written


def test_the_demo_preset_validates_and_a_config_without_a_model_says_how_to_name_one(python_m_rlcore, tmp_path):
    """The GRPO demo preset runs 32 x 2 completions a step, so 16 per group divide it, though TRL's default batch
    (8 x 1) would not; its `tiny` model and dataset are checked as what they build (nothing left behind). A config
    naming no model is told what to set."""
    import rlcore

    preset = str(Path(rlcore.__file__).resolve().parent.parent / "examples" / "demo" / "grpo.yaml")
    done = python_m_rlcore("config", "validate", "--plugin", "grpo", "--config", preset, "num_generations=16")
    assert (done.returncode, done.stdout) == (0, f"{preset}: valid for algorithm 'grpo'\n"), done.stderr
    (tmp_path / "mine.yaml").write_text("seed: 1\ndataset: tiny:toy\n")
    done = python_m_rlcore("config", "validate", "--plugin", "grpo", "--config", "mine.yaml")
    assert done.returncode == 2
    assert done.stderr.splitlines()[0] == "rlcore: error: invalid configuration (1 problem):", done.stderr
    assert "model: is unset; name one" in done.stderr and "tiny" in done.stderr
    done = python_m_rlcore("config", "validate", "--plugin", "grpo", "--config", preset, "num_generations=16",
                           "per_device_train_batch_size=8", "gradient_accumulation_steps=1")
    assert done.returncode == 2
    assert "per_device_train_batch_size (8) x train workers (1) x steps_per_generation (1) = 8" in done.stderr


def laughs(levels: int) -> str:
    """A billion laughs: each level an alias list of ten of the level below, `levels` of them: 10**(levels + 1) values."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\nseed: 1\n"


def test_yaml_that_expands_is_refused_in_one_line_naming_the_limit_before_it_is_built(tmp_path, monkeypatch):
    """Nested aliases, a file over the size limit, an integer of thousands of digits, nesting thousands deep: one
    problem naming the limit, from the composed nodes (a billion laughs is its 100 nodes), nothing built. Aliases
    within the limit still read as before."""
    import yaml

    from rlcore import config as config_module

    built = []
    monkeypatch.setattr(config_module._Loader, "construct_object",
                        lambda self, node, deep=False: built.append(node) or yaml.SafeLoader.construct_object(self, node, deep))
    path = tmp_path / "c.yaml"
    path.write_text(laughs(5))  # 10**6 values: without the limit it is built, and read slowly, not hung
    with pytest.raises(ConfigError) as refused:
        load_config(RunConfig, str(path))
    assert "expand to more than 100,000 values, over rlcore's limit of 100,000" in str(refused.value)
    assert len(str(refused.value).splitlines()) == 2 and not built  # the summary and the problem; nothing built
    monkeypatch.undo()
    path.write_text("base: &b {nproc_per_node: 2}\ndevice_groups: *b\nseed: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'base'"):  # aliases within the limit work
        load_config(RunConfig, str(path))
    for text, said in [("seed: 1\n" + "#" * (4 << 20), "over rlcore's limit of 4 MiB"),
                       ("seed: " + "9" * 5000 + "\n", "an integer of 5000 digits"),
                       ("seed: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deep")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=said) as refused:
            load_config(RunConfig, str(path))
        assert len(str(refused.value).splitlines()) <= 2, str(refused.value)


def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_the_key_and_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-3\ntrain:\n  gpus: 1\n  gpus: 2\nseed: 1\nlearning_rate: 2e-3\n")
    with pytest.raises(ConfigError, match=r"line 6, column 1: key 'learning_rate' is given twice, on line 1 and line 6"):
        load_config(RunConfig, str(path))
    path.write_text("learning_rate: 1e-3\ntrain:\n  gpus: 1\n  gpus: 2\n")
    with pytest.raises(ConfigError, match=r"key 'gpus' is given twice, on line 3 and line 4; keep one"):
        load_config(RunConfig, str(path))
    path.write_text("device_groups: &g {nproc_per_node: 1}\nseed: 3\nx: {<<: *g, nproc_per_node: 2}\n")
    with pytest.raises(ConfigError, match="unknown key 'x'"):  # a merge's keys overridden are not duplicates
        load_config(RunConfig, str(path))
