"""Every argument of ms-swift 4.6.0's rlhf, sft and sample commands (the reference list of its dataclasses' fields,
tests/core/fixtures/ms_swift/arguments-4.6.0.txt) is answered: an rlcore key, one of TRL's or transformers' fields
(their table), or `rlcore.compat.ms_swift_table`'s answer (translated, asks for nothing, or refused with why); a config of every argument at
ms-swift's default loads for each algorithm."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from rlcore import config_model
from rlcore.compat.ms_swift import translate
from rlcore.compat.ms_swift_table import MS_SWIFT
from rlcore.compat.trl_table import TABLES
from rlcore.config import config_from_data

REFERENCE = Path(__file__).parent / "fixtures" / "ms_swift" / "arguments-4.6.0.txt"
COMMANDS = {"grpo": ("RLHFArguments", "RayArguments"), "gkd": ("RLHFArguments",), "sft": ("SftArguments",),
            "sample": ("SamplingArguments",)}


def arguments() -> dict[str, dict[str, object]]:
    """{dataclass: {field: default}} of the reference list."""
    out: dict[str, dict[str, object]] = {}
    section = None
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("## "):
            section = out.setdefault(line.split()[1], {})
        elif section is not None and (match := re.match(r"^(\w+) = (.*)$", line)):
            section[match[1]] = _default(match[2])
    return out


def _default(text: str) -> object:
    if text == "list()" or "default_factory=list" in text:
        return []
    lambda_ = re.match(r"lambda: (.*)\(\)$", text)
    return ast.literal_eval(lambda_[1] if lambda_ else text)


def rlcore_keys() -> set[str]:
    keys = set()
    for algorithm in ("grpo", "gkd", "sft", "pt", "sample", "distill"):
        model = config_model(algorithm)
        keys |= set(model.model_fields)
        for field in model.model_fields.values():
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                keys |= set(field.annotation.model_fields)
    return keys


@pytest.mark.parametrize("name", ["RLHFArguments", "SftArguments", "SamplingArguments", "RayArguments"])
def test_every_ms_swift_argument_is_answered(name):
    trl = {key for table in TABLES.values() for key in table}
    unanswered = [key for key in arguments()[name] if key not in rlcore_keys() and key not in trl and key not in MS_SWIFT]
    assert not unanswered, f"ms-swift's {name} without an answer (core/compat/ms_swift_table.py): {unanswered}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ms-swift-table") / "tiny")


@pytest.mark.parametrize("algorithm", list(COMMANDS))
def test_every_argument_at_ms_swifts_default_loads(tmp_path, tiny_model, algorithm):
    rows = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": str(i)}]}
            for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    keys = {key: value for section in COMMANDS[algorithm] for key, value in arguments()[section].items()}
    keys.update(model=str(tiny_model), dataset=str(tmp_path / "rows.jsonl"), rlhf_type=algorithm)
    if algorithm in ("sft", "sample"):
        del keys["rlhf_type"]
    if algorithm == "grpo":  # ms-swift's own defaults need a reward and a batch num_generations divides, too
        keys.update(reward_funcs=["format"], per_device_train_batch_size=8)
    if algorithm == "gkd":
        keys["teacher_model"] = str(tiny_model)
    model = config_model(algorithm)
    translation = translate(keys, model)
    config_from_data(model, translation.data, translation.problems, algorithm=algorithm)
    said = [line for line in translation.noted if "ask for nothing here" in line]
    assert len(said) == 1 and any(f" {key}," in said[0] for key in MS_SWIFT)  # said once, in one line


def test_the_migration_page_lists_every_answer():
    page = (Path(__file__).parents[2] / "docs" / "migrating" / "ms-swift.md").read_text()
    assert not [key for key in MS_SWIFT if f"`{key}`" not in page]


def test_a_modelscope_dataset_id_is_one_line_here(tiny_model):
    """This machine has no network: with the modelscope package the line says offline (one connection tried, none of
    the package's retries); without it, how to install it. Either way the `#N` stays on the file to give."""
    import importlib.util

    keys = {"rlhf_type": "grpo", "model": str(tiny_model), "dataset": "AI-ModelScope/alpaca-gpt4-data-zh#2000"}
    problems = translate(keys, config_model("grpo")).problems
    assert len(problems) == 1 and problems[0][0] == "dataset"
    assert "modelscope download --dataset AI-ModelScope/alpaca-gpt4-data-zh" in problems[0][1]
    assert "#2000)" in problems[0][1]
    if importlib.util.find_spec("modelscope") is None:
        assert "`pip install modelscope`" in problems[0][1]
    else:
        assert "this machine is offline" in problems[0][1]


@pytest.mark.parametrize("algorithm, keys, expected", [
    ("grpo", {"truncation_strategy": "delete", "enable_thinking": False},
     {"truncation_strategy": "delete", "chat_template_kwargs": {"enable_thinking": False}}),
    ("gkd", {"truncation_strategy": "right", "enable_thinking": True},
     {"truncation_strategy": "right", "chat_template_kwargs": {"enable_thinking": True}}),
    ("sft", {"truncation_strategy": "left"}, {"trainer_kwargs": {"truncation_mode": "keep_end"}}),
    ("sft", {"truncation_strategy": "delete"}, "TRL's SFTTrainer cuts a row longer than max_length"),
    ("sample", {"enable_thinking": False}, "renders the tokenizer's chat template with its defaults"),
])
def test_truncation_strategy_and_enable_thinking_where_each_algorithm_reads_them(tmp_path, tiny_model, algorithm,
                                                                                 keys, expected):
    model = config_model(algorithm)
    translation = translate({"model": str(tiny_model), **keys}, model)
    if isinstance(expected, str):
        assert len(translation.problems) == 1 and expected in translation.problems[0][1]
        return
    assert not translation.problems
    assert {key: translation.data[key] for key in expected} == expected
