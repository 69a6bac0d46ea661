"""TRL's names and spelling from the command line: a TRL-style YAML validates for grpo and sft with each key in one
place, TRL's names at the top of every other algorithm and in a role section, unknown keys suggest only keys of the same meaning (also in role sections), `--flag` and `--key a b`, and
`run --help` listing the algorithm's keys."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from rlcore.config import closest_key
from rlcore.ms_swift import translate
from rlcore.plugins.grpo import GRPOConfig

TRL_GRPO = """\
model_name_or_path: {model}
dataset: prompts.jsonl
bf16: true
gradient_checkpointing: true
use_peft: true
lora_r: 8
lora_alpha: 16
lora_target_modules: [q_proj, v_proj]
lora_dropout: 0.05
use_vllm: false
num_train_epochs: 1
learning_rate: 1.0e-5
per_device_train_batch_size: 8
num_generations: 4
max_prompt_length: 64
max_completion_length: 16
attn_implementation: sdpa
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("trl") / "tiny"))


@pytest.fixture
def trl_files(tmp_path, tiny):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}"}) + "\n" for i in range(40)))
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": str(i)}]}) + "\n" for i in range(40)))
    (tmp_path / "grpo.yaml").write_text(TRL_GRPO.format(model=tiny))
    (tmp_path / "sft.yaml").write_text(TRL_GRPO.format(model=tiny).replace("prompts.jsonl", "chats.jsonl")
                                       .replace("num_generations: 4\n", "").replace("max_prompt_length: 64\n", "")
                                       .replace("max_completion_length: 16\n", "max_seq_length: 64\n"))
    return tmp_path


def shown(done) -> dict:
    """The config `config show` printed (exit 0, its first line the config model's name)."""
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split(":")[0] in ("# GRPOConfig", "# SFTConfig", "# GKDConfig", "# SampleConfig",
                                                          "# DistillConfig")
    return yaml.safe_load(done.stdout)


def test_a_trl_grpo_yaml_validates_with_each_key_where_it_belongs(python_m_rlcore, trl_files, tiny):
    done = python_m_rlcore("config", "validate", "--plugin", "grpo", "--config", "grpo.yaml")
    assert (done.returncode, done.stdout) == (0, "grpo.yaml: valid for algorithm 'grpo'\n"), done.stderr
    config = shown(python_m_rlcore("config", "show", "--plugin", "grpo", "--config", "grpo.yaml"))
    assert config["model"] == tiny and config["train"]["gradient_checkpointing"] is True
    assert (config["train"]["lora_rank"], config["train"]["lora_alpha"], config["train"]["lora_dropout"]) == (8, 16, 0.05)
    assert config["train"]["lora_target_modules"] == ["q_proj", "v_proj"]
    assert config["train"]["dtype"] == config["rollout"]["dtype"] == "bfloat16" and config["rollout"]["engine"] == "hf"
    assert config["max_steps"] == 40 * 4 // 8  # one epoch over the file's 40 prompts, 4 completions each, 8 a step


def test_the_same_trl_keys_at_the_top_of_an_sft_yaml(python_m_rlcore, trl_files, tiny):
    done = python_m_rlcore("config", "validate", "--plugin", "sft", "--config", "sft.yaml")
    assert (done.returncode, done.stdout) == (0, "sft.yaml: valid for algorithm 'sft'\n"), done.stderr
    config = shown(python_m_rlcore("config", "show", "--plugin", "sft", "--config", "sft.yaml"))
    assert (config["model"], config["gradient_checkpointing"], config["bf16"]) == (tiny, True, True)
    assert (config["lora_rank"], config["lora_dropout"]) == (8, 0.05)
    assert (config["num_train_epochs"], config["max_length"]) == (1.0, 64)


@pytest.mark.parametrize(("algorithm", "args", "expected"), [
    ("gkd", ["--model_name_or_path", "m", "--teacher_model_name_or_path", "t", "--max_new_tokens", "12",
             "--gradient_checkpointing", "--use_peft", "--lora_r", "4", "--bf16"],
     {"model": "m", "teacher_model": "t", "max_completion_length": 12, "train.gradient_checkpointing": True,
      "train.lora_rank": 4, "train.dtype": "bfloat16"}),
    ("sample", ["--model_name_or_path", "m", "--max_completion_length", "7"], {"model": "m", "max_new_tokens": 7}),
    ("distill", ["--model_name_or_path", "m", "--max_completion_length", "7"], {"model": "m", "max_new_tokens": 7}),
    ("grpo", ["--train.lora_r", "8", "--rollout.vllm_max_model_length", "512"],  # set in the role section
     {"train.lora_rank": 8, "rollout.vllm_max_model_len": 512}),
], ids=["gkd", "sample", "distill", "grpo-role-sections"])
def test_trl_names_at_the_top_of_every_algorithm_and_in_role_sections(python_m_rlcore, algorithm, args, expected):
    config = shown(python_m_rlcore("config", "show", "--plugin", algorithm, *args))
    got = {}
    for path in expected:
        value = config
        for part in path.split("."):
            value = value[part]
        got[path] = value
    assert got == expected


def test_bf16_where_there_is_no_mixed_precision_is_said():
    translation = translate({"bf16": True}, GRPOConfig)
    assert translation.data["train"]["dtype"] == "bfloat16"
    (line,) = translation.noted
    assert line.startswith("TRL's bf16: True (train.dtype, rollout.dtype, reference.dtype, orm.dtype: bfloat16;")


def test_unknown_keys_suggest_nested_keys_and_never_another_meaning(python_m_rlcore, tmp_path):
    (tmp_path / "typos.yaml").write_text(textwrap.dedent("""\
        gradient_checkpoint: true
        num_generation: 4
        train:
          engnie: hf
          learning_rate: 1.0e-5
        """))
    done = python_m_rlcore("config", "validate", "--plugin", "grpo", "--config", "typos.yaml", "num_train_epochs=2")
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[0] == "rlcore: error: invalid configuration in typos.yaml (5 problems):"
    assert "  gradient_checkpoint: unknown key 'gradient_checkpoint'. Did you mean 'train.gradient_checkpointing'?" in lines
    assert "  num_generation: unknown key 'num_generation'. Did you mean 'num_generations'?" in lines
    assert "  train.engnie: unknown key 'engnie'. Did you mean 'engine'?" in lines
    assert any("Did you mean 'learning_rate' at the top level, not under 'train'?" in line for line in lines)
    assert any(line.startswith("  num_train_epochs: cannot become max_steps") for line in lines)
    assert "num_iterations" not in done.stderr


@pytest.mark.parametrize(("name", "known", "expected"), [
    ("num_train_epochs", ["num_iterations", "max_steps"], None),
    ("save_strategy", ["save_steps"], None),
    ("max_prompt_length", ["max_length"], None),
    ("epsilon_hi", ["epsilon", "epsilon_high"], "epsilon_high"),
    ("learningrate", ["learning_rate"], "learning_rate"),
])
def test_closest_key_is_a_misspelling_not_a_neighbour(name, known, expected):
    assert closest_key(name, known) == expected


def test_a_bare_flag_is_true_and_several_values_are_a_list(python_m_rlcore):
    config = shown(python_m_rlcore("config", "show", "--plugin", "grpo", "--mask_truncated_completions",
                                   "--reward_funcs", "accuracy", "format", "--reward_weights", "1", "0.5",
                                   "max_steps=3", "--dynamic_sample"))
    assert config["mask_truncated_completions"] is True and config["dynamic_sample"] is True
    assert (config["reward_funcs"], config["reward_weights"], config["max_steps"]) == (["accuracy", "format"], [1.0, 0.5], 3)
    one = shown(python_m_rlcore("config", "show", "--plugin", "grpo", "--reward_funcs", "accuracy"))
    assert one["reward_funcs"] == ["accuracy"]  # a list key given one value


def test_run_help_lists_the_algorithms_keys(python_m_rlcore):
    done = python_m_rlcore("run", "--plugin", "grpo", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: rlcore run ")
    assert "Keys of algorithm 'grpo'" in done.stdout and "`rlcore config show --plugin grpo`" in done.stdout
    assert "\n  num_generations = 8  completions per prompt (the group size)\n" in done.stdout
    assert "\n  train.gradient_checkpointing = false  " in done.stdout
    general = python_m_rlcore("run", "--help")
    assert general.returncode == 0 and "`rlcore config show --plugin NAME`" in general.stdout
