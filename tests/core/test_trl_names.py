"""TRL's names and spelling from the command line: a TRL-style YAML validates for grpo and sft with each key in one
place, TRL's names at the top of every other algorithm and in a role section, unknown keys suggest only keys of the same meaning (also in role sections), `--flag` and `--key a b`, and
`run --help` listing the algorithm's keys."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from rlcore.config import closest_key
from rlcore.compat.ms_swift import translate
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
    assert line.startswith("TRL's bf16: True (train.dtype, rollout.dtype, reference.dtype, orm.dtype, teacher.dtype: bfloat16;")


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
    assert "\n  num_generations = 8  completions per prompt (the group size)" in done.stdout
    assert "\n  train.gradient_checkpointing = false  " in done.stdout
    general = python_m_rlcore("run", "--help")
    assert general.returncode == 0 and "`rlcore config show --plugin NAME`" in general.stdout


# TRL's CLI example config (trl/examples/cli_configs/example_config.yaml), its dataset a local file
TRL_EXAMPLE = """\
model_name_or_path: {model}
dataset_name: {dataset}
report_to: none
learning_rate: 0.0001
lr_scheduler_type: cosine
"""


def test_trls_example_config_with_a_local_dataset_validates(python_m_rlcore, trl_files, tiny):
    (trl_files / "example.yaml").write_text(TRL_EXAMPLE.format(model=tiny, dataset="prompts.jsonl"))
    done = python_m_rlcore("config", "validate", "--plugin", "grpo", "--config", "example.yaml")
    assert (done.returncode, done.stdout) == (0, "example.yaml: valid for algorithm 'grpo'\n"), done.stderr
    config = shown(python_m_rlcore("config", "show", "--plugin", "grpo", "--config", "example.yaml"))
    assert (config["model"], config["dataset"], config["lr_scheduler_type"]) == (tiny, "prompts.jsonl", "cosine")


def trl_defaults() -> dict:
    """Every key of TRL's ScriptArguments and ModelConfig at TRL's default."""
    import dataclasses

    from trl import ModelConfig, ScriptArguments

    return {f.name: f.default for cls in (ScriptArguments, ModelConfig) for f in dataclasses.fields(cls)}


@pytest.mark.parametrize(("algorithm", "data"), [
    ("grpo", "prompts.jsonl"), ("gkd", "chats.jsonl"), ("sft", "chats.jsonl"), ("pt", "texts.jsonl"),
    ("sample", "prompts.jsonl"),
])
def test_every_key_of_trls_script_arguments_and_model_config_loads(trl_files, tiny, algorithm, data):
    from rlcore.compat.ms_swift import load_translated
    from rlcore.plugins.gkd import GKDConfig
    from rlcore.plugins.grpo import GRPOConfig
    from rlcore.plugins.sampling import SampleConfig
    from rlcore.plugins.sft import PretrainConfig, SFTConfig

    (trl_files / "texts.jsonl").write_text("".join(json.dumps({"text": f"word {i}"}) + "\n" for i in range(8)))
    model = {"grpo": GRPOConfig, "gkd": GKDConfig, "sft": SFTConfig, "pt": PretrainConfig, "sample": SampleConfig}[algorithm]
    keys = {**trl_defaults(), "model_name_or_path": tiny, "dataset_name": str(trl_files / data)}
    if algorithm == "gkd":
        keys["teacher_model_name_or_path"] = tiny
    (trl_files / "all.yaml").write_text(yaml.safe_dump(keys))
    config, _ = load_translated(model, trl_files / "all.yaml")  # what the CLI reads a file with
    assert (config.model, config.dataset) == (tiny, str(trl_files / data))
    assert (config.train.lora_rank if hasattr(config, "train") else getattr(config, "lora_rank", 0)) == 0  # use_peft false
    translation = translate(keys, model)
    consumed = set(keys) - set(model.model_fields) - {"model_name_or_path", "dataset_name", "teacher_model_name_or_path"}
    said = " ".join(translation.noted + translation.mapped)
    quiet = {"dtype", "lora_r", "use_peft", "dataset_config"}  # as dtype, lora_rank; dataset_config null: nothing
    assert all(key in said for key in consumed - quiet), said  # each said, none dropped


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("model_revision", "v1.0", "rlcore loads a model's main revision; download that revision (`hf download MODEL "
                               "--revision v1.0 --local-dir DIR`) and give model: DIR"),
    ("trust_remote_code", True, "never a model repository's own code"),
    ("load_in_4bit", True, "a 4-bit (bitsandbytes) base model is not built in rlcore"),
    ("load_in_8bit", True, "an 8-bit (bitsandbytes) base model is not built in rlcore"),
    ("use_dora", True, "DoRA is not built in rlcore"),
    ("use_rslora", True, "rank-stabilised LoRA is not built"),
    ("lora_modules_to_save", ["lm_head"], "training whole modules beside LoRA is not built"),
    ("lora_target_parameters", ["experts.down_proj"], "LoRA on parameters (MoE experts) is not built"),
    ("lora_task_type", "SEQ_CLS", "causal language models only"),
    ("dataset_streaming", True, "not as a stream"),
    ("ignore_bias_buffers", True, "which rlcore does not apply"),
])
def test_what_rlcore_does_not_build_is_refused_in_one_line(key, value, reason):
    from rlcore.plugins.grpo import GRPOConfig

    translation = translate({key: value}, GRPOConfig)
    (problem,) = translation.problems
    assert problem[0] == key and reason in problem[1] and "\n" not in problem[1]
    assert key not in translation.data


def test_lora_keys_for_an_algorithm_that_trains_nothing():
    from rlcore.plugins.sampling import SampleConfig

    translation = translate({"use_peft": True, "lora_alpha": 16}, SampleConfig)
    assert translation.problems == [("use_peft", "this algorithm trains no weights, so it has no LoRA; drop it")]
    assert translation.noted == ["TRL's lora_alpha: 16 (this algorithm trains no weights)"]


@pytest.fixture
def splits(tmp_path):
    """A folder laid out as a Hub dataset: train and test files, and a configuration of its own."""
    folder = tmp_path / "folder"
    for path in ("train.jsonl", "test.jsonl", "big/data/train-00000-of-00002.jsonl", "big/data/train-00001-of-00002.jsonl",
                 "big/data/test-00000-of-00001.jsonl"):
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(json.dumps({"prompt": path}) + "\n")
    return folder


@pytest.mark.parametrize(("keys", "files"), [
    ({}, ["train.jsonl"]),
    ({"dataset_train_split": "test"}, ["test.jsonl"]),
    ({"dataset_config": "big"}, ["big/data/train-00000-of-00002.jsonl", "big/data/train-00001-of-00002.jsonl"]),
    ({"dataset_config": "big", "dataset_train_split": "test"}, ["big/data/test-00000-of-00001.jsonl"]),
])
def test_dataset_name_of_a_folder_picks_the_configuration_and_split(splits, keys, files):
    from rlcore.plugins.grpo import GRPOConfig

    translation = translate({"dataset_name": str(splits), "dataset_test_split": "test", **keys}, GRPOConfig)
    expected = [str(splits / f) for f in files]
    assert translation.problems == [] and translation.data["dataset"] == (expected[0] if len(expected) == 1 else expected)
    assert any(line.startswith("TRL's dataset_test_split: 'test' (rlcore evaluates on no test split") for line in translation.noted)


@pytest.mark.parametrize(("keys", "problem"), [
    ({"dataset_train_split": "validation"}, ("dataset_train_split", "'validation': '{folder}' has no file of that split")),
    ({"dataset_config": "small"}, ("dataset_config", "'small': '{folder}' has no folder 'small' (configurations there: big)")),
])
def test_a_split_or_configuration_the_folder_lacks_is_one_line(splits, keys, problem):
    from rlcore.plugins.grpo import GRPOConfig

    (got,) = translate({"dataset_name": str(splits), **keys}, GRPOConfig).problems
    assert got[0] == problem[0] and got[1].startswith(problem[1].format(folder=splits))


def test_a_hub_dataset_without_the_hub_is_one_line(python_m_rlcore, tmp_path, tiny):
    (tmp_path / "hub.yaml").write_text(f"model_name_or_path: {tiny}\ndataset_name: trl-lib/tldr\n")
    done = python_m_rlcore("config", "validate", "--plugin", "grpo", "--config", "hub.yaml")  # HF_HUB_OFFLINE is set
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "rlcore: error: invalid configuration in hub.yaml (1 problem):",
        "  dataset_name: 'trl-lib/tldr' is neither a local file or folder nor in the local Hugging Face cache, and "
        "HF_HUB_OFFLINE is set: download it where there is a network (`hf download trl-lib/tldr --repo-type dataset`), "
        "or give a local file"]


def test_a_hub_dataset_in_the_local_cache_is_read_from_there(python_m_rlcore, tmp_path, tiny):
    repo = tmp_path / "hub" / "datasets--trl-lib--tldr"
    snapshot = repo / "snapshots" / ("1" * 40)
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "data" / "train-00000-of-00001.jsonl").write_text(json.dumps({"prompt": "Summarise: hi"}) + "\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    done = python_m_rlcore("config", "show", "--plugin", "grpo", "--model_name_or_path", tiny,
                           "--dataset_name", "trl-lib/tldr", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert shown(done)["dataset"] == str(snapshot / "data" / "train-00000-of-00001.jsonl")


def test_a_folder_of_several_configurations_needs_dataset_config(tmp_path):
    from rlcore.plugins.grpo import GRPOConfig

    for config in ("plain", "chat"):
        (tmp_path / config).mkdir()
        (tmp_path / config / "train-00000-of-00001.jsonl").write_text(json.dumps({"prompt": config}) + "\n")
    (got,) = translate({"dataset_name": str(tmp_path)}, GRPOConfig).problems
    assert got == ("dataset_config", f"is not given, but '{tmp_path}' has several configurations (chat, plain); set it "
                   "to one of them")
    picked = translate({"dataset_name": str(tmp_path), "dataset_config": "chat"}, GRPOConfig)
    assert picked.data["dataset"] == str(tmp_path / "chat" / "train-00000-of-00001.jsonl")


def test_trls_tool_calling_rounds_are_max_turns_minus_one():
    translation = translate({"max_tool_calling_iterations": 2, "tools": ["m:f"]}, GRPOConfig)
    assert translation.data == {"max_turns": 3, "tools": ["m:f"]}
    assert translate({"max_tool_calling_iterations": None}, GRPOConfig).data == {}
