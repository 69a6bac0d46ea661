"""What a model's own files tell before any GPU is taken (`rlcore.model_checks`): contexts longer than the model's
(rope scaling counted), directories without weights or tokenizer, conversations for a tokenizer without a chat
template, a GKD teacher of another vocabulary, a vLLM tensor size that does not split the heads; each one line
naming the key, in `rlcore config validate` and before `rlcore run` allocates anything, all at once."""

from __future__ import annotations

import json
import shutil

import pytest

from rlcore import ConfigError, load_config, load_plugins
from rlcore.model_checks import ModelFiles, ModelUse, model_problems, read_model
from rlcore.plugins.gkd import GKDConfig
from rlcore.plugins.gkd.trainer import GKDTrainer
from rlcore.plugins.grpo import GRPOConfig
from rlcore.plugins.grpo.trainer import GRPOTrainer
from rlcore.plugins.sampling import SampleConfig
from rlcore.plugins.sampling.trainer import SampleTrainer
from rlcore.plugins.sft import SFTConfig
from rlcore.plugins.sft.trainer import SFTTrainer
from rlcore.testing import build_tiny_model

# ms-swift's Ray GKD example (rollout colocated, teacher colocated), its lengths as published, with tiny models
MS_SWIFT_GKD = """\
rlhf_type: gkd
model: {student}
teacher_model: {teacher}
gkd_logits_topk: 64
dataset:
  - {chats}
max_length: 512
max_completion_length: 256
use_vllm: true
colocate_groups: [[train, rollout]]
train:
  gpus: 4
  tuner_type: lora
  lora_rank: 8
rollout:
  gpus: 4
  vllm_tensor_parallel_size: 2
  vllm_gpu_memory_utilization: 0.4
  vllm_max_model_len: 16384
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"tiny": build_tiny_model(root / "tiny"), "teacher": build_tiny_model(root / "teacher", seed=1),
            "wide": build_tiny_model(root / "wide", vocab_size=300), "root": root}


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


@pytest.fixture
def data(tmp_path):
    chats, prompts = tmp_path / "chats.jsonl", tmp_path / "prompts.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}"},
                                                      {"role": "assistant", "content": str(i)}]}) + "\n" for i in range(8)))
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "solution": str(i + 1)}) + "\n" for i in range(8)))
    return {"chats": str(chats), "prompts": str(prompts)}


def copy_of(model, tmp_path, name="copy"):
    return shutil.copytree(model, tmp_path / name)


def problems_of(trainer, model_cls, overrides):
    """The (key, message) problems `rlcore config validate` reports for the config of `overrides`."""
    with pytest.raises(ConfigError) as excinfo:
        trainer.check(load_config(model_cls, None, overrides), load_plugins())
    return excinfo.value.problems


def test_ms_swift_gkd_yaml_with_a_longer_vllm_context_fails_validate_in_one_line(python_m_rlcore, tmp_path, models, data):
    (tmp_path / "gkd.yaml").write_text(MS_SWIFT_GKD.format(student=models["tiny"], teacher=models["teacher"], **data))
    done = python_m_rlcore("config", "validate", "--config", "gkd.yaml")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "rlcore: error: invalid configuration (1 problem):",
        f"  rollout.vllm_max_model_len: 16384 tokens is longer than the context of model '{models['tiny']}': 1024 "
        "positions (max_position_embeddings, config.json); set it to at most 1024, or use a model with a longer context",
    ]
    # `rlcore run` (on the CPU here, without vLLM) stops the same way before any worker starts or any file is written
    on_cpu = ["use_vllm=false", "train.gpus=0", "rollout.gpus=0", "colocate_groups=[]", "output_dir=out"]
    run = python_m_rlcore("run", "--config", "gkd.yaml", *on_cpu, "max_completion_length=1000")
    assert run.returncode == 2 and run.stderr.splitlines()[-2:] == [
        "rlcore: error: invalid configuration (1 problem):",
        "  max_prompt_length + max_completion_length: 512 + 1000 = 1512 tokens is longer than the context of model "
        f"'{models['tiny']}': 1024 positions (max_position_embeddings, config.json); lower them to 1024 in all, or use "
        "a model with a longer context"], run.stderr
    assert not (tmp_path / "out").exists()
    fits = python_m_rlcore("config", "validate", "--config", "gkd.yaml", "rollout.vllm_max_model_len=1024")
    assert fits.returncode == 0, fits.stderr


def test_prompt_and_completion_longer_than_the_model_stop_a_run_before_anything_is_built(models, data, plugins):
    keys = [f"model={models['tiny']}", f"dataset={data['prompts']}", "max_prompt_length=1000", "max_completion_length=100"]
    config = load_config(GRPOConfig, None, keys)
    with pytest.raises(ConfigError) as excinfo:
        GRPOTrainer(config, plugins)  # a run: GRPO's own checks wait for its objects, the model's files do not
    assert excinfo.value.problems == [(
        "max_prompt_length + max_completion_length",
        f"1000 + 100 = 1100 tokens is longer than the context of model '{models['tiny']}': 1024 positions "
        "(max_position_embeddings, config.json); lower them to 1024 in all, or use a model with a longer context")]
    GRPOTrainer.check(load_config(GRPOConfig, None, [*keys[:2], "max_prompt_length=924", keys[3]]), plugins)  # 1024 fits


@pytest.mark.parametrize(("trainer", "model_cls", "keys", "key"), [
    (SFTTrainer, SFTConfig, ["max_length=2048"], "max_length"),
    (SampleTrainer, SampleConfig, ["max_prompt_length=1000", "max_new_tokens=25"], "max_prompt_length + max_new_tokens"),
    (GKDTrainer, GKDConfig, ["max_prompt_length=1000", "max_completion_length=25"],
     "max_prompt_length + max_completion_length"),
], ids=["sft", "sample", "gkd"])
def test_each_algorithm_names_its_own_length_keys(models, data, trainer, model_cls, keys, key):
    dataset = data["chats"] if model_cls in (SFTConfig, GKDConfig) else data["prompts"]
    teacher = [f"teacher_model={models['teacher']}"] if model_cls is GKDConfig else []
    problems = problems_of(trainer, model_cls, [f"model={models['tiny']}", f"dataset={dataset}", *teacher, *keys])
    assert [k for k, _ in problems] == [key]  # student and teacher hold the same 1024: said once
    assert "1024 positions (max_position_embeddings, config.json)" in problems[0][1]


@pytest.mark.parametrize(("rope", "limit", "how"), [
    ({"rope_type": "linear", "factor": 4.0}, 4096, "max_position_embeddings 1024, rope scaling 'linear' x4"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048,
     "max_position_embeddings 1024, rope scaling 'yarn' x4"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128}, 1024, "max_position_embeddings"),
    ({"rope_type": "default", "rope_theta": 10000.0}, 1024, "max_position_embeddings"),
], ids=["linear", "yarn", "llama3-counted-already", "none"])
def test_rope_scaling_with_a_factor_lengthens_the_context(tmp_path, models, rope, limit, how):
    model = copy_of(models["tiny"], tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling" if "type" in rope else "rope_parameters"] = rope
    (model / "config.json").write_text(json.dumps(config))
    assert read_model(str(model)).context() == (limit, how)
    use = ModelUse("model", str(model), ((("max_length",), (limit,)), (("vllm_max_model_len",), (limit + 1,))))
    assert [key for key, _ in model_problems([use])] == ["vllm_max_model_len"]


def test_a_multimodal_config_is_read_from_its_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 32768}}))
    assert ModelFiles("m", tmp_path, config=json.loads((tmp_path / "config.json").read_text())).context() == (
        32768, "max_position_embeddings")


def test_a_directory_without_weights_or_tokenizer_is_one_line(tmp_path, models, data):
    model = copy_of(models["tiny"], tmp_path)
    (model / "model.safetensors").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    problems = problems_of(SFTTrainer, SFTConfig, [f"model={model}", f"dataset={data['chats']}"])
    assert (("model", f"'{model}' is a directory without weights (*.safetensors, *.bin or their index) and without "
             "tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model); give the directory of a saved model "
             "(save_pretrained writes the model, its tokenizer too)") in problems)


@pytest.mark.parametrize("prompts", ["chats", "prompts"])
def test_conversations_need_a_chat_template(tmp_path, models, data, prompts):
    model = copy_of(models["tiny"], tmp_path)
    (model / "chat_template.jinja").unlink()
    keys = [f"model={model}", f"dataset={data[prompts]}", "sampler.engine=hf"]
    if prompts == "prompts":  # text prompts go in as text where there is no template: nothing to say
        SampleTrainer.check(load_config(SampleConfig, None, keys + ["max_prompt_length=512"]), load_plugins())
        return
    problems = problems_of(SampleTrainer, SampleConfig, keys + ["max_prompt_length=512"])
    assert problems == [("dataset", f"holds conversation prompts (messages), but the tokenizer of model '{model}' has "
                         "no chat template (none in tokenizer_config.json, no chat_template.jinja) to turn them into "
                         "tokens; give text prompts, or a model whose tokenizer has a chat template")]


def test_a_teacher_of_another_vocabulary_is_refused_for_gkd(models, data):
    keys = [f"model={models['tiny']}", f"teacher_model={models['wide']}", f"dataset={data['chats']}", "lmbda=0"]
    full = problems_of(GKDTrainer, GKDConfig, keys)
    assert [k for k, _ in full] == ["teacher_model", "teacher_model"]
    assert full[0][1] == (f"'{models['wide']}' has a vocabulary of 300 ids (vocab_size), model '{models['tiny']}' 267; "
                          "full-vocabulary distillation compares their logits id by id: use a model of the same "
                          "vocabulary, or set gkd_logits_topk")
    assert full[1][1].startswith(f"'{models['wide']}' has another tokenizer than model '{models['tiny']}' "
                                 "(tokenizer.json: ")
    topk = problems_of(GKDTrainer, GKDConfig, keys + ["gkd_logits_topk=8"])  # ids still mean other tokens
    assert [k for k, _ in topk] == ["teacher_model"] and "another tokenizer" in topk[0][1]
    GKDTrainer.check(load_config(GKDConfig, None, keys[:1] + [f"teacher_model={models['teacher']}"] + keys[2:]),
                     load_plugins())  # a teacher of the student's family


def test_a_vllm_tensor_size_that_does_not_split_the_heads(models, data):
    keys = [f"model={models['tiny']}", f"dataset={data['prompts']}", "rollout.engine=vllm", "rollout.gpus=3",
            "train.gpus=1"]
    problems = problems_of(GRPOTrainer, GRPOConfig, keys + ["rollout.vllm_tensor_parallel_size=3"])
    assert ("rollout.vllm_tensor_parallel_size", f"3 does not divide the 4 attention heads of '{models['tiny']}' "
            "(num_attention_heads, config.json); use a size that splits them evenly (1, 2, 4)") in problems
    four = keys + ["rollout.vllm_tensor_parallel_size=4", "rollout.gpus=4"]  # 4 heads; the 2 KV heads copied
    GRPOTrainer.check(load_config(GRPOConfig, None, four), load_plugins())


def test_a_hub_id_is_read_from_the_local_cache_without_the_network(python_m_rlcore, tmp_path, models, data):
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(models["tiny"] / "config.json", snapshot / "config.json")  # only config.json: never downloaded whole
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    (tmp_path / "sft.yaml").write_text(f"model: org/tiny\ndataset: {data['chats']}\nmax_length: 4096\n")
    done = python_m_rlcore("config", "validate", "--plugin", "sft", "--config", "sft.yaml",
                           env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert done.returncode == 2 and done.stderr.splitlines()[1:] == [
        "  max_length: 4096 tokens is longer than the context of model 'org/tiny': 1024 positions "
        "(max_position_embeddings, config.json); set it to at most 1024, or use a model with a longer context"], done.stderr


def test_every_problem_at_once(tmp_path, models, data):
    model = copy_of(models["tiny"], tmp_path)
    (model / "model.safetensors").unlink()
    problems = problems_of(GRPOTrainer, GRPOConfig, [
        f"model={model}", f"dataset={data['prompts']}", "max_completion_length=1024", "rollout.engine=vllm",
        "rollout.gpus=1", "train.gpus=1", "rollout.vllm_max_model_len=4096", "rollout.vllm_tensor_parallel_size=3"])
    assert [key for key, _ in problems if key != "(resource plan)"] == [
        "model", "max_prompt_length + max_completion_length", "rollout.vllm_max_model_len",
        "rollout.vllm_tensor_parallel_size"]


def test_sft_conversations_need_a_chat_template_too(tmp_path, models, data):
    model = copy_of(models["tiny"], tmp_path)
    (model / "chat_template.jinja").unlink()
    problems = problems_of(SFTTrainer, SFTConfig, [f"model={model}", f"dataset={data['chats']}"])
    assert [key for key, _ in problems] == ["dataset"] and "has no chat template" in problems[0][1]
    texts = tmp_path / "texts.jsonl"  # TRL's prompt-completion rows of text: no template needed
    texts.write_text("".join(json.dumps({"prompt": f"Say {i}", "completion": str(i)}) + "\n" for i in range(8)))
    SFTTrainer.check(load_config(SFTConfig, None, [f"model={model}", f"dataset={texts}"]), load_plugins())
