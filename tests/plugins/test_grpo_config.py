"""The GRPO config: the reference examples load and place; the demo defaults apply only to the demo."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlcore import ConfigError, load_config
from rlcore.plugins.grpo.config import GRPOConfig
from rlcore.runtime.resources import plan_from_config

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


def test_the_demo_is_a_preset_the_config_keeps_the_real_defaults():
    """The demo's settings live in its preset (examples/demo/grpo.yaml); GRPOConfig has TRL's defaults."""
    from pathlib import Path

    import rlcore

    assert GRPOConfig().learning_rate == 1e-6 and GRPOConfig().max_completion_length == 256
    preset = Path(rlcore.__file__).resolve().parent.parent / "examples" / "demo" / "grpo.yaml"
    demo = load_config(GRPOConfig, str(preset), ["max_steps=3"])
    assert (demo.model, demo.dataset, demo.learning_rate, demo.max_steps) == ("tiny", "tiny:toy", 1e-3, 3)


def test_config_show_then_a_model_in_the_file_trains_with_the_real_defaults(tmp_path, capsys):
    """`rlcore config show --plugin grpo model=some/model > my.yaml`: TRL's defaults, not the demo's (a bare
    `config show` prints the demo preset a bare run uses, issue 54's one story)."""
    from rlcore.cli import main

    assert main(["config", "show", "--plugin", "grpo", "model=some/model"]) == 0
    shown = capsys.readouterr().out
    assert "learning_rate: 1.0e-06" in shown and "\nmodel: some/model" in shown
    path = tmp_path / "my.yaml"
    path.write_text(shown)
    from rlcore import load_plugins
    from rlcore.config import with_settings

    model = with_settings(GRPOConfig, load_plugins().settings, "grpo")  # the keys plugins add (report_to, ...)
    config = load_config(model, str(path))
    assert config.model == "some/model" and config.learning_rate == 1e-6 and config.max_completion_length == 256


def test_inconsistent_keys_are_reported_with_their_names():
    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, None, ["reward_weights=[1, 2]", "async_generate=true",
                                       "colocate_groups=[[train, rollout]]"])
    text = str(err.value)
    assert "reward_weights: has 2 weights for 1 reward_funcs" in text
    assert "async_generate: needs train and rollout on separate devices" in text


def test_cuda_ipc_without_colocated_gpus_names_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, None, ["model=m", "weight_sync_backend=cuda_ipc", "train.gpus=1", "rollout.gpus=1"])
    assert "weight_sync_backend: cuda_ipc hands GPU memory between processes on one GPU" in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# cross-field rules: the config holds them all, so `config validate` and `run` agree
# ---------------------------------------------------------------------------------------------------------


def problems_of(*overrides):
    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, None, ["model=m", *overrides])
    return str(err.value)


def test_batch_rules_are_config_rules_reported_together():
    text = problems_of("steps_per_generation=3", "gradient_accumulation_steps=2", "per_device_train_batch_size=3",
                       "num_generations=4", "train.gpus=0", "train.cpus=2", "vllm_importance_sampling_clip_min=2",
                       "vllm_importance_sampling_clip_max=1")  # gpus: auto waits for its count (test_devices)
    assert "steps_per_generation: (3) must be a multiple of gradient_accumulation_steps (2)" in text
    assert ("num_generations: (4) must divide the generation batch: per_device_train_batch_size (3) x train workers (2) "
            "x steps_per_generation (3) = 18") in text
    assert "vllm_importance_sampling_clip_min: (2.0) must be less than vllm_importance_sampling_clip_max (1.0)" in text


def test_the_generation_batch_counts_the_declared_train_workers():
    assert "train workers (3)" in problems_of("per_device_train_batch_size=2", "num_generations=4", "train.gpus=3")
    assert GRPOConfig(model="m", per_device_train_batch_size=2, num_generations=4, train={"gpus": 2}).train_workers == 2
    assert GRPOConfig(model="m", per_device_train_batch_size=2, num_generations=4, train={"cpus": 4}).train_workers == 4


@pytest.mark.parametrize(
    ("ranks", "workers"),
    [(3, 3), ([0, 2, 5], 3), ("range(1, 4)", 3), ("list(range(0, 2))", 2)],
    ids=["count", "list", "range", "list-range"],
)
def test_train_workers_in_the_device_groups_form(ranks, workers):
    groups = {"nproc_per_node": 8, "a": {"device": "GPU", "ranks": [6, 7], "workers": ["rollout"]},
              "b": {"device": "GPU", "ranks": ranks, "workers": ["train"]}}
    config = GRPOConfig(model="m", device_groups=groups, per_device_train_batch_size=4, num_generations=4)
    assert config.train_workers == workers
    text = problems_of("per_device_train_batch_size=1", "num_generations=4", f"device_groups={groups}")
    assert f"train workers ({workers})" in text


def test_bad_train_ranks_are_left_to_the_resource_plan():
    groups = {"g": {"device": "GPU", "ranks": "range(0, ", "workers": ["train", "rollout"]}}
    config = GRPOConfig(model="m", device_groups=groups, per_device_train_batch_size=3, num_generations=4)
    assert config.train_workers == 1  # no batch-size error guessed from it; plan_from_config names the ranks
    with pytest.raises(ConfigError, match="device_groups.g.ranks"):
        plan_from_config(config, roles=["train", "rollout"])


def test_config_validate_and_run_reject_the_same_batch(tmp_path, capsys):
    from rlcore.cli import main

    path = tmp_path / "grpo.yaml"
    path.write_text("model: m\nper_device_train_batch_size: 3\nnum_generations: 4\n")
    assert main(["config", "validate", "--plugin", "grpo", "--config", str(path)]) == 2
    assert "num_generations: (4) must divide the generation batch" in capsys.readouterr().err
    assert main(["run", "--plugin", "grpo", "--config", str(path)]) == 2  # before any model is loaded
    assert "num_generations: (4) must divide the generation batch" in capsys.readouterr().err


def test_sampler_correction_keys_have_trls_names_and_defaults():
    import dataclasses

    from trl import GRPOConfig as TRLConfig

    trl_defaults = {f.name: f.default for f in dataclasses.fields(TRLConfig)}
    ours = GRPOConfig(model="m")
    for key in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "use_bias_correction_kl"):
        assert getattr(ours, key) == trl_defaults[key], key
    assert GRPOConfig(model="m", vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0  # TRL's old name
    assert "vllm_importance_sampling_mode" in problems_of("vllm_importance_sampling_mode=tokens")


def test_colocation_is_read_from_either_form():
    shared = {"nproc_per_node": 2, "g": {"device": "GPU", "ranks": [0, 1], "workers": ["train", "rollout"]}}
    apart = {"nproc_per_node": 2, "t": {"device": "GPU", "ranks": [0], "workers": ["train"]},
             "r": {"device": "GPU", "ranks": [1], "workers": "rollout"}}
    assert GRPOConfig(device_groups=shared).colocated and not GRPOConfig(device_groups=apart).colocated
    assert GRPOConfig(device_groups=shared, weight_sync_backend="cuda_ipc").weight_sync_backend == "cuda_ipc"
    with pytest.raises(ValidationError, match="async_generate"):  # one step off-policy needs its own rollout GPUs
        GRPOConfig(device_groups=shared, async_generate=True)
    assert GRPOConfig(device_groups=apart, async_generate=True).async_generate


def test_config_validate_runs_every_check_run_makes_before_allocating(tmp_path, capsys):
    """The plan, reward names, dataset and model path: `config validate` refuses what `run` would, all at once."""
    from rlcore.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text(
        "model: /nowhere/model\ndataset: /nowhere/data.jsonl\nreward_funcs: [acuracy]\nbeta: 0.1\n"
        "device_groups:\n  nproc_per_node: 2\n  a: {device: GPU, ranks: [0, 1], workers: [train]}\n"
        "  b: {device: TPU, ranks: [2], workers: [rollout]}\n  c: {device: GPU, ranks: '[range(0, 200000000)]', workers: [reference]}\n"
    )
    assert main(["config", "validate", "--plugin", "grpo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    for expected in ("device_groups.b.device: must be GPU or CPU", "device_groups.c.ranks", "reward 'acuracy' is not registered",
                     "dataset: '/nowhere/data.jsonl' does not exist", "model: '/nowhere/model' has no loadable tokenizer"):
        assert expected in err, (expected, err)
    assert len(err) < 4000 and "Traceback" not in err


def test_a_missing_model_is_one_line_naming_the_key_before_anything_runs(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "model=/nowhere/model",
                           f"output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("rlcore: error: model '/nowhere/model' cannot be loaded"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_booleans_are_not_numbers_in_grpo_keys():
    with pytest.raises(ConfigError, match="beta: is a number, not a boolean"):
        load_config(GRPOConfig, None, ["beta=true"])


def test_old_logprobs_and_the_sampler_correction_are_decided_once():
    """One owner (experience.OldLogprobs): the driver's forward and the step's objective both read it."""
    from rlcore.plugins.grpo.experience import OldLogprobs

    model = {"model": "m", "dataset": "d"}
    assert OldLogprobs.of(GRPOConfig(**model)) == OldLogprobs("step", "step")
    assert OldLogprobs.of(GRPOConfig(**model, num_iterations=2)) == OldLogprobs("forward", "driver")
    assert OldLogprobs.of(GRPOConfig(**model, steps_per_generation=2)) == OldLogprobs("forward", "driver")
    assert OldLogprobs.of(GRPOConfig(**model, vllm_importance_sampling_correction=False)) == OldLogprobs("step", None)
    apart = {"train": {"gpus": 1}, "rollout": {"gpus": 1}}
    assert OldLogprobs.of(GRPOConfig(**model, **apart, async_generate=True)) == OldLogprobs("rollout", None)


def test_teacher_keys_are_checked_together_and_place_the_teacher():
    """A teacher (teacher.model, or ms-swift's teacher_model) sits in the train workers; with teacher.gpus it is a
    group of its own. One generation per prompt needs it; two different teachers, or an offloaded separate one, do not
    make sense."""
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, None, ["model=m", "dataset=d", "num_generations=1", "per_device_train_batch_size=4"])
    assert "num_generations: is 1, so every advantage is 0" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, None, ["model=m", "dataset=d", "teacher_model=a", "teacher.model=b", "teacher.gpus=1", "offload_teacher_model=true"])
    text = str(err.value)
    assert "teacher_model: ('a') and teacher.model ('b') differ" in text and "offload_teacher_model: applies to a teacher" in text
    with pytest.raises(ConfigError, match="teacher.model: is unset, but the teacher is a group of its own"):
        load_config(GRPOConfig, None, ["model=m", "dataset=d", "teacher.gpus=1"])
    inside = load_config(GRPOConfig, None, ["model=m", "dataset=d", "teacher_model=t", "num_generations=1", "per_device_train_batch_size=4"])
    assert inside.teacher_path == "t" and not inside.separate_teacher and "teacher" not in GRPOTrainer.roles(inside)
    own = load_config(GRPOConfig, None, ["model=m", "dataset=d", "teacher.model=t", "teacher.gpus=2", "train.gpus=2", "rollout.gpus=2"])
    assert own.separate_teacher and GRPOTrainer.roles(own)[-1] == "teacher"
    assert "teacher" not in GRPOTrainer.train_setup_options(own, "m")
