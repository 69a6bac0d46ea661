"""GKD's configuration: the keys it refuses and why, and the example layouts validated as `rlcore config validate` does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlcore import ConfigError, load_config, load_plugins
from rlcore.plugins.gkd.config import GKDConfig
from rlcore.plugins.gkd.trainer import GKDTrainer
from rlcore.testing import build_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray" / "gkd"


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gkd-config")
    teacher = build_tiny_model(root / "teacher", hidden_size=96, intermediate_size=192, seed=5)
    other = build_tiny_model(root / "other-vocab", vocab_size=400, seed=6)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}:", "completion": f"number {i}"}) + "\n" for i in range(8)))
    return {"student": str(tiny_model), "teacher": str(teacher), "other": str(other), "dataset": str(data)}


def problems(overrides, path=None):
    with pytest.raises(ConfigError) as err:
        load_config(GKDConfig, path, overrides)
    return dict(err.value.problems)


def test_seq_kd_is_refused_with_the_reason():
    found = problems(["model=m", "teacher_model=t", "seq_kd=true"])
    assert "ms-swift deprecated" in found["seq_kd"] and "lmbda" in found["seq_kd"]


def test_a_served_teacher_with_full_vocabulary_names_both_ways_out():
    found = problems(["model=m", "teacher.gpus=2", "teacher.model=t"])
    message = found["gkd_logits_topk"]
    assert "set gkd_logits_topk" in message and "set teacher_model and drop" in message


def test_the_teacher_is_given_once_and_offload_is_for_a_colocated_one():
    found = problems(["model=m", "gkd_logits_topk=8", "teacher.gpus=1", "teacher_model=a", "teacher.model=b",
                      "offload_teacher_model=true"])
    assert "differ" in found["teacher_model"] and "separate group" in found["offload_teacher_model"]
    assert "teacher_model" in problems(["model=m"])  # a student without any teacher
    assert "beta" in problems(["model=m", "teacher_model=t", "beta=1.5"])


def test_a_bad_plan_fails_before_any_model_is_built(tmp_path):
    config = GKDConfig(model="tiny", teacher_model="tiny:teacher", dataset="tiny:chat", output_dir=str(tmp_path / "run"),
                       colocate_groups=[["train", "rollout"]], train={"gpus": 2}, rollout={"gpus": 1})
    with pytest.raises(ConfigError, match="colocated roles must ask the same number of GPUs"):
        GKDTrainer(config, load_plugins())
    assert not (tmp_path / "run").exists()  # the demo's models were never written


def test_different_vocabularies_need_top_k_and_one_tokenizer(models, tmp_path):
    config = GKDConfig(model=models["student"], teacher_model=models["other"], dataset=models["dataset"])
    with pytest.raises(ConfigError, match="has a vocabulary of 400 ids"):
        GKDTrainer.check(config, load_plugins())
    with pytest.raises(ConfigError, match="has another tokenizer than model"):  # top-k reads the student's ids too
        GKDTrainer.check(config.model_copy(update={"gkd_logits_topk": 8}), load_plugins())
    padded = shutil.copytree(models["student"], tmp_path / "padded")  # one tokenizer, more embedding rows (Qwen2.5's)
    (padded / "config.json").write_text(json.dumps({**json.loads((padded / "config.json").read_text()), "vocab_size": 320}))
    config = config.model_copy(update={"teacher_model": str(padded)})
    with pytest.raises(ConfigError, match="has a vocabulary of 320 ids"):
        GKDTrainer.check(config, load_plugins())
    GKDTrainer.check(config.model_copy(update={"gkd_logits_topk": 8}), load_plugins())


@pytest.mark.parametrize("example", ["teacher_colocated", "teacher_standalone", "teacher_shared"])
def test_the_examples_validate_once_models_and_data_are_set(models, example):
    path = EXAMPLES / f"{example}.yaml"
    keys = [f"model={models['student']}", f"dataset={models['dataset']}"]
    keys.append(f"teacher.model={models['teacher']}" if example != "teacher_colocated" else f"teacher_model={models['teacher']}")
    config = load_config(GKDConfig, path, keys)
    GKDTrainer.check(config, load_plugins())
    assert config.served_teacher == (example != "teacher_colocated")
    assert GKDTrainer.roles(config) == ["train", "rollout"] + (["teacher"] if config.served_teacher else [])
