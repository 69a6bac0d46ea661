"""Every field of TRL's GRPOConfig, GKDConfig, SFTConfig and transformers' TrainingArguments is answered by
`rlcore.compat.trl_table` (a new TRL key fails here), TRL's defaults load for each algorithm, a realistic TRL YAML's
keys are each answered in one line naming them as TRL's, and sft passes its trainer's keys to TRL."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from rlcore import ConfigError, config_model
from rlcore.compat.ms_swift import load_translated, translate
from rlcore.compat.trl_names import RENAMES
from rlcore.compat.trl_table import TABLES
from rlcore.config import _names_and_aliases

trl = pytest.importorskip("trl")
TRL_VERSION = "1.16"  # the table's TRL; another version still must answer every field it has


def trl_classes() -> dict[str, type]:
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # GKDConfig lives in trl.experimental in TRL 1.16
    from transformers import TrainingArguments
    from trl import GRPOConfig, SFTConfig
    from trl.experimental.gkd import GKDConfig

    return {"TrainingArguments": TrainingArguments, "GRPOConfig": GRPOConfig, "SFTConfig": SFTConfig,
            "GKDConfig": GKDConfig}


BASES = {"TrainingArguments": None, "GRPOConfig": "TrainingArguments", "SFTConfig": "TrainingArguments",
         "GKDConfig": "SFTConfig"}


def own_fields(name: str) -> set[str]:
    """The fields `name` adds to its base (TrainingArguments' all)."""
    classes = trl_classes()
    fields = {f.name for f in dataclasses.fields(classes[name])}
    base = BASES[name]
    return fields - ({f.name for f in dataclasses.fields(classes[base])} if base else set())


@pytest.mark.parametrize("name", list(BASES))
def test_every_field_of_trls_configs_is_answered(name):
    missing = own_fields(name) - set(TABLES[name])
    assert not missing, f"{name}'s fields without an answer in rlcore/compat/trl_table.py: {sorted(missing)}"
    if trl.__version__.startswith(TRL_VERSION) and name != "TrainingArguments":  # transformers' own vary by version
        assert not set(TABLES[name]) - own_fields(name), "answers for fields TRL does not have"


def rlcore_keys() -> set[str]:
    """Every key of every algorithm's config, its role sections' too."""
    keys = set(RENAMES)
    for algorithm in ("grpo", "gkd", "sft", "pt", "sample", "distill"):
        model = config_model(algorithm)
        keys |= _names_and_aliases(model)
        for field in model.model_fields.values():
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                keys |= set(field.annotation.model_fields)
    return keys


HANDLED = {"trust_remote_code", "use_vllm", "max_tool_calling_iterations", "vllm_max_model_length",
           "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "teacher_model_name_or_path"}


def test_what_the_table_calls_rlcores_is_a_key_of_an_algorithm_or_translated():
    said = {key for table in TABLES.values() for key, a in table.items() if a.what == "rlcore"}
    assert not said - rlcore_keys() - HANDLED


def defaults(name: str) -> dict:
    """`name`'s fields at their defaults, as a YAML of them reads."""
    out = {}
    for f in dataclasses.fields(trl_classes()[name]):
        value = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        out[f.name] = yaml.safe_load(yaml.safe_dump(value if not hasattr(value, "value") else value.value))
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("trl") / "tiny")


@pytest.fixture
def files(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}"}) + "\n" for i in range(16)))
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": str(i)}]}) + "\n" for i in range(16)))
    return tmp_path


@pytest.mark.parametrize("algorithm, name, data", [
    ("grpo", "GRPOConfig", "prompts.jsonl"), ("gkd", "GKDConfig", "chats.jsonl"), ("sft", "SFTConfig", "chats.jsonl"),
    ("pt", "TrainingArguments", "chats.jsonl"), ("sft", "TrainingArguments", "chats.jsonl"),
])
def test_a_yaml_of_every_trl_default_loads(files, tiny_model, algorithm, name, data):
    keys = {**defaults(name), "model": str(tiny_model), "dataset": str(files / data)}
    if algorithm == "gkd":
        keys["teacher_model"] = str(tiny_model)
    model = config_model(algorithm)
    translation = translate(keys, model)
    assert not translation.problems
    config = model.model_validate(translation.data)
    assert (config.output_dir, config.log_level) == ("output", "info")  # TRL's null and passive: rlcore's defaults
    if algorithm in ("grpo", "gkd"):  # max_steps -1: TRL's 3 epochs over the 16 rows
        per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
        assert config.max_steps == 3 * 16 * getattr(config, "num_generations", 1) // per_step
    else:
        assert (config.max_steps, config.num_train_epochs) == (None, 3.0)
    idle = [line for line in translation.noted if "ask for nothing here" in line]
    assert len(idle) == 1 and "push_to_hub" in idle[0]  # said once, in one line


def test_trls_defaults_validate_from_the_command_line(python_m_rlcore, files, tiny_model):
    keys = {**defaults("GRPOConfig"), "model_name_or_path": str(tiny_model), "dataset": "prompts.jsonl"}
    (files / "trl.yaml").write_text(yaml.safe_dump(keys))
    done = python_m_rlcore("config", "validate", "--plugin", "grpo", "--config", str(files / "trl.yaml"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("ask for nothing here") == 1


REALISTIC = {  # the keys of a TRL GRPO YAML people write, each refused by name before
    "save_strategy": ("steps", None), "push_to_hub": (True, "pushes nothing to the Hugging Face Hub"),
    "gradient_checkpointing_kwargs": ({"use_reentrant": False}, None), "optim": ("adamw_8bit", "torch's AdamW"),
    "eval_strategy": ("steps", "no evaluation loop"), "save_only_model": (True, None),
    "hub_model_id": ("me/model", "Hub"), "logging_first_step": (True, None), "remove_unused_columns": (False, None),
    "hub_token": ("hf_notarealtoken123", "Hub"),
}


def test_a_realistic_trl_yaml_is_answered_key_by_key(tiny_model):
    data = {"model": str(tiny_model), **{key: value for key, (value, _) in REALISTIC.items()}}
    translation = translate(data, config_model("grpo"))
    problems = dict(translation.problems)
    for key, (_, reason) in REALISTIC.items():
        if reason is None:  # harmless here: listed once
            assert key not in problems and key in " ".join(translation.noted)
        else:
            assert reason in problems[key] and "TRL's" in problems[key], problems
    assert "hf_notarealtoken123" not in repr(translation.problems) + repr(translation.noted)
    with pytest.raises(ConfigError) as raised:
        model = config_model("grpo")
        from rlcore.config import config_from_data
        config_from_data(model, translation.data, translation.problems)
    assert "unknown key" not in str(raised.value)


def test_sft_passes_its_trainers_keys_to_trl_and_keeps_rlcores(files, tiny_model):
    path = files / "sft.yaml"
    path.write_text(yaml.safe_dump({"model": str(tiny_model), "dataset": "chats.jsonl", "optim": "adafactor",
                                    "dataset_text_field": "body", "save_strategy": "steps", "neftune_noise_alpha": 5}))
    config, translation = load_translated(config_model("sft"), path)
    assert config.trainer_kwargs == {"optim": "adafactor", "dataset_text_field": "body", "neftune_noise_alpha": 5}
    assert "TRL's TrainingArguments optim -> trainer_kwargs.optim: 'adafactor'" in translation.mapped
    with pytest.raises(ConfigError, match="dataset_text_field: .* is TRL's SFTConfig key"):
        load_translated(config_model("pt"), path)  # transformers' Trainer has no such key; pt does not pass it


def test_a_trl_key_of_another_algorithm_says_whose_it_is(tiny_model):
    problems = dict(translate({"model": str(tiny_model), "num_generations": 4}, config_model("sft")).problems)
    assert "TRL's GRPOConfig key for num_generations" in problems["num_generations"]


def test_the_migration_page_lists_every_key():
    page = (Path(__file__).parents[2] / "docs" / "migrating" / "trl.md").read_text()
    missing = [key for table in TABLES.values() for key in table if f"`{key}`" not in page]
    assert not missing
