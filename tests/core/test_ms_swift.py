"""ms-swift's YAMLs, shaped as its Ray examples are (`examples/ray/grpo`, `examples/ray/gkd`,
`examples/train/multi-node/ray/sft.yaml`, `examples/sampler/ray/sampling.yaml`), read as rlcore configs key by
key, refused keys with their reason, and each run from the CLI on the CPU (scaled: CPU workers, tiny models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore import config_model as composed  # the model a run validates with: the engines' keys too
from rlcore.errors import ConfigError
from rlcore.compat.ms_swift import load_translated, translate
from rlcore.plugins.gkd import GKDConfig
from rlcore.plugins.grpo import GRPOConfig
from rlcore.data import load_rows
from rlcore.plugins.sampling import DistillConfig, SampleConfig
from rlcore.plugins.sft import SFTConfig


def load_config(model, path=None, overrides=(), **options):
    """A file read as the CLI reads it: ms-swift's and TRL's keys translated, then validated."""
    return load_translated(composed(model), path, overrides, **options)[0]

GRPO = """\
rlhf_type: grpo
model: {model}
dataset: {prompts}#32
reward_funcs: [accuracy, format]
overlong_filter: false
dataset_num_proc: 4
split_dataset_ratio: 0
micro_batch_size: 2
global_batch_size: 16
num_generations: 8
steps_per_generation: 4
num_train_epochs: 1
logging_steps: 1
seed: 42
max_length: 256
max_completion_length: 512
padding_free: false
cross_entropy_loss_fusion: true
gradient_accumulation_fusion: false
lr: 5e-5
lr_warmup_fraction: 0.0
min_lr: 5e-5
attention_backend: flash
temperature: 1.0
beta: 0
epsilon: 0.2
epsilon_high: 0.28
loss_type: grpo
importance_sampling_level: token
log_rollout_offpolicy_metrics: true
system: {system}
use_vllm: true
{placement}
train:
  gpus: 4
  tuner_type: lora
  lora_rank: 8
  lora_alpha: 32
  tensor_model_parallel_size: 1
  output_dir: {out}
rollout:
  gpus: 4
  vllm_tensor_parallel_size: 1
  vllm_gpu_memory_utilization: 0.4
  vllm_max_model_len: 8192
"""
COLOCATE = "colocate_groups: [[train, rollout]]\noffload_model: true\noffload_optimizer: true\nsleep_level: 1"
SEPARATE = "train_iters: 100\nload_from_cache_file: false"

GKD = """\
rlhf_type: gkd
model: {student}
{teacher_model}
gkd_logits_topk: 64
dataset:
  - {chats}#32
dataset_num_proc: 4
split_dataset_ratio: 0
micro_batch_size: 1
global_batch_size: 16
num_train_epochs: 1
logging_steps: 1
max_length: 256
max_completion_length: 256
padding_free: true
sequence_parallel: true
attention_backend: flash
lr: 1e-6
min_lr: 1e-6
lr_warmup_fraction: 0.0
temperature: 1.0
lmbda: 1
beta: 0.5
sft_alpha: 0.0
finetune: true
no_save_optim: true
no_save_rng: true
recompute_granularity: selective
use_vllm: true
colocate_groups: [[train, rollout]]
offload_model: true
offload_optimizer: true
sleep_level: 1
train:
  gpus: 4
  tuner_type: lora
  lora_rank: 8
  lora_alpha: 32
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 1
  expert_model_parallel_size: 1
  context_parallel_size: 1
  output_dir: {out}
rollout:
  gpus: 4
  vllm_tensor_parallel_size: 1
  vllm_gpu_memory_utilization: 0.4
  vllm_max_model_len: 1024
{teacher_section}
"""
COLOCATED_TEACHER = ("teacher_model: {teacher_path}\noffload_teacher_model: true", "")
STANDALONE_TEACHER = ("", """teacher:
  gpus: 4
  model: {teacher_path}
  vllm_gpu_memory_utilization: 0.9
  vllm_engine_kwargs: {{"max_logprobs": 64}}""")

SFT = """\
model: {model}
split_dataset_ratio: 0.0
tuner_type: lora
target_modules: [q_proj, k_proj, v_proj, o_proj]
torch_dtype: bfloat16
attn_impl: flash_attn
num_train_epochs: 5
per_device_train_batch_size: 1
per_device_eval_batch_size: 1
learning_rate: 1e-4
dataset: {cognition}#16
gradient_accumulation_steps: 8
eval_steps: 1000
save_steps: 1000
save_total_limit: 5
logging_steps: 5
warmup_ratio: 0.05
dataloader_num_workers: 0
dataset_num_proc: 8
deepspeed: zero3
model_name: swift-bot
model_author: swift
output_dir: {out}
use_ray: true
device_groups:
  nproc_per_node: 4
  default:
    device: GPU
    ranks: list(range(0, 4))
    workers:
      - default
"""

SAMPLING = """\
ray_exp_name: sampling
use_ray: true
model: {model}
dataset: {prompts}#4
num_return_sequences: 2
max_length: 2048
system: "You are a math model; give the final answer wrapped with \\\\boxed{{}}"
load_args: false
sampler_engine: vllm
max_new_tokens: 768
orm_model: math
override_exist_file: true
num_sampling_per_gpu_batch_size: 4
top_p: 1.0
temperature: 1.0
prm_threshold: 0.8
output_file: sampling.jsonl
output_dir: {out}
device_groups:
  nproc_per_node: 4
  sample_group:
    device: GPU
    ranks: list(range(0, 2))
    workers:
      - sampler
  rm_group:
    device: GPU
    ranks: list(range(2, 4))
    workers:
      - orm
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from rlcore.testing import build_tiny_model, tiny_model

    root = tmp_path_factory.mktemp("ms-swift")
    student, teacher = tiny_model("tiny", root / "student"), tiny_model("tiny:teacher", root)
    prompts, chats = root / "math.jsonl", root / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "solution": str(i + 1)}) + "\n" for i in range(40)))
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}"},
                                                      {"role": "assistant", "content": str(i)}]}) + "\n" for i in range(40)))
    cognition = root / "self_cognition.jsonl"  # ms-swift's self-cognition rows, as messages
    cognition.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "你是谁?" if i % 2 else "Who are you?"},
        {"role": "assistant", "content": "我是{{NAME}}, 由{{AUTHOR}}训练。" if i % 2 else "I am {{NAME}}, trained by {{AUTHOR}}."}],
        "tag": "zh" if i % 2 else "en"}) + "\n" for i in range(40)))
    system = root / "prompt.txt"
    system.write_text("Think step by step.")
    return {"model": str(build_tiny_model(root / "tiny")), "student": student, "teacher": teacher,
            "prompts": str(prompts), "chats": str(chats), "cognition": str(cognition), "system": str(system), "root": root}


def write(files, tmp_path, name, template, **fields) -> str:
    path = tmp_path / name
    path.write_text(template.format(out=tmp_path / "out", **{k: v for k, v in files.items() if k != "root"}, **fields))
    return str(path)


def grpo_file(files, tmp_path, placement):
    return write(files, tmp_path, "grpo.yaml", GRPO, placement=placement)


def gkd_file(files, tmp_path, layout):
    teacher_model, teacher = (part.format(teacher_path=files["teacher"]) for part in layout)
    return write(files, tmp_path, "gkd.yaml", GKD, teacher_model=teacher_model, teacher_section=teacher)


def expect(config, **keys):
    for key, value in keys.items():
        node = config
        for part in key.split("__"):
            node = getattr(node, part)
        assert node == value, (key, node, value)


# -------------------------------------------------------------------------
# the translation, key by key
# -------------------------------------------------------------------------


def test_grpo_colocate_key_by_key(files, tmp_path):
    config = load_config(GRPOConfig, grpo_file(files, tmp_path, COLOCATE))
    expect(config, per_device_train_batch_size=2, gradient_accumulation_steps=2,  # 16 = 2 x dp 4 x 2
           steps_per_generation=8,  # 4 optimizer steps of 2 micro-batches
           max_steps=16,  # one epoch: 32 prompts x 8 completions / 16 a step
           learning_rate=5e-5, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, seed=42,
           max_prompt_length=256, max_completion_length=512, mask_truncated_completions=False,
           system="Think step by step.", dataset=f"{files['prompts']}#32", reward_funcs=["accuracy", "format"],
           colocate_groups=[["train", "rollout"]], offload_model=True, sleep_level=1, output_dir=str(tmp_path / "out"),
           train__gpus=4, train__engine="megatron", train__lora_rank=8, train__lora_alpha=32,
           train__lora_dropout=0.05, min_lr=0.0, rollout__engine="vllm",  # min_lr = lr: constant
           rollout__vllm_gpu_memory_utilization=0.4, rollout__vllm_max_model_len=8192)


def test_grpo_separate_key_by_key(files, tmp_path):
    config = load_config(GRPOConfig, grpo_file(files, tmp_path, SEPARATE))
    expect(config, max_steps=100, colocate_groups=[], gradient_accumulation_steps=2, steps_per_generation=8)
    assert not config.colocated


def test_gkd_colocated_teacher_key_by_key(files, tmp_path):
    config = load_config(GKDConfig, gkd_file(files, tmp_path, COLOCATED_TEACHER))
    expect(config, per_device_train_batch_size=1,
           gradient_accumulation_steps=8,  # 16 = 1 x dp 2 (4 GPUs / tensor 2) x 8
           max_steps=2, learning_rate=1e-6, lr_scheduler_type="constant", dataset=f"{files['chats']}#32",
           teacher_model=files["teacher"], offload_teacher_model=True, gkd_logits_topk=64, lmbda=1.0, beta=0.5,
           max_prompt_length=256, train__gradient_checkpointing=True, train__tensor_model_parallel_size=2,
           train__engine="megatron", train__lora_rank=8, train__lora_dropout=0.05, train__engine_kwargs={},
           rollout__engine="vllm", output_dir=str(tmp_path / "out"))
    assert not config.served_teacher


def test_gkd_standalone_teacher_key_by_key(files, tmp_path):
    config = load_config(GKDConfig, gkd_file(files, tmp_path, STANDALONE_TEACHER))
    expect(config, teacher_model=None, teacher__model=files["teacher"], teacher__gpus=4, teacher__engine="vllm",
           teacher__vllm_engine_kwargs={"max_logprobs": 64}, gradient_accumulation_steps=8)
    assert config.served_teacher


def test_sft_with_device_groups_key_by_key(files, tmp_path):
    config = load_config(SFTConfig, write(files, tmp_path, "sft.yaml", SFT))
    expect(config, lora_rank=8, lora_alpha=32, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
           dtype="bfloat16", warmup_steps=0.05, num_train_epochs=5.0, learning_rate=1e-4,
           per_device_train_batch_size=1, gradient_accumulation_steps=8, save_steps=1000, save_total_limit=5,
           logging_steps=5, dataset=f"{files['cognition']}#16", model_name=["swift-bot"], model_author=["swift"])
    assert config.device_groups["default"]["workers"] == ["default"]


def test_sampling_with_device_groups_key_by_key(files, tmp_path):
    config = load_config(SampleConfig, write(files, tmp_path, "sample.yaml", SAMPLING))
    expect(config, batch_size=8,  # 4 per GPU x 2 sampler GPUs
           orm_model="accuracy", sampler__engine="vllm", max_prompt_length=2048, num_return_sequences=2,
           output_file="sampling.jsonl", prm_threshold=0.8, max_new_tokens=768)
    assert config.system.startswith("You are a math model")


DISTILL = """\
use_ray: false
sampler_type: distill
sampler_engine: client
model: qwen-max
stream: true
dataset: {prompts}#16
num_return_sequences: 4
max_length: 2048
load_args: false
max_new_tokens: 768
orm_model: math
override_exist_file: true
num_sampling_batch_size: 4
output_file: sampling.jsonl
output_dir: {out}
engine_kwargs: '{{"base_url":"https://dashscope.aliyuncs.com/compatible-mode/v1"}}'
device_groups:
  nproc_per_node: 4
  sample_group:
    device: CPU
    ranks: 2
    workers:
      - sampler
  rm_group:
    device: GPU
    ranks: list(range(0, 4))
    workers:
      - orm
"""


def test_distill_with_the_client_engine_key_by_key(files, tmp_path):
    """ms-swift's examples/sampler/distill/distill.yaml: the client engine's base_url is the endpoint, and the
    group of its client sampler is left out (the endpoint samples)."""
    path = write(files, tmp_path, "distill.yaml", DISTILL)
    config = load_config(DistillConfig, path)
    expect(config, api_base="https://dashscope.aliyuncs.com/compatible-mode/v1", model="qwen-max", batch_size=4,
           orm_model="accuracy", num_return_sequences=4, max_new_tokens=768, output_file="sampling.jsonl")
    assert set(config.device_groups) == {"nproc_per_node", "rm_group"}
    notes = translate(__import__("yaml").safe_load(Path(path).read_text()), composed(DistillConfig))
    assert "sampler_engine: 'client' -> the teacher is the endpoint api_base names" in notes.mapped
    assert any(line.startswith("ms-swift's stream: True") for line in notes.noted)


def test_distill_refuses_client_options_it_does_not_have(files, tmp_path):
    path = write(files, tmp_path, "distill.yaml", DISTILL.replace('"base_url"', '"timeout": 5, "base_url"'))
    with pytest.raises(ConfigError, match="engine_kwargs.timeout: is not an option of rlcore's endpoint client"):
        load_config(DistillConfig, path)


def test_sampler_engine_client_for_sampling_says_to_use_distill(files, tmp_path):
    path = write(files, tmp_path, "sample.yaml", SAMPLING.replace("sampler_engine: vllm", "sampler_engine: client"))
    with pytest.raises(ConfigError, match=r"sampler_engine: 'client' is not built in rlcore.*--plugin distill"):
        load_config(SampleConfig, path)


def test_gkd_datasets_listed_are_read_one_after_another(files, tmp_path):
    """ms-swift's GKD examples list two datasets (`- zh#2000`, `- en#2000`): both, each cut to its rows."""
    path = write(files, tmp_path, "gkd.yaml", GKD.replace("  - {chats}#32", "  - {chats}#3\n  - {prompts}#2"),
                 teacher_model=f"teacher_model: {files['teacher']}", teacher_section="")
    config = load_config(GKDConfig, path)
    assert config.dataset == [f"{files['chats']}#3", f"{files['prompts']}#2"]
    rows = load_rows(config.dataset)
    assert len(rows) == 5 and "messages" in rows[0] and "prompt" in rows[3]


@pytest.mark.parametrize("key, value, reason", [
    ("gym_env", "frozen_lake", "ms-swift's gym environments (its GYMScheduler and Env registry) are not built"),
    ("truncation_strategy", "split", "'left', 'right' or 'delete'"),
])
def test_features_of_newer_ms_swift_examples_are_refused_with_the_reason(files, tmp_path, key, value, reason):
    """ms-swift's multi_turn/frozen_lake_colocate.yaml uses features rlcore lacks."""
    extra = f"{key}: {value}\n".format(model=files["model"])
    with pytest.raises(ConfigError) as error:
        load_config(GRPOConfig, write(files, tmp_path, "grpo.yaml", GRPO + extra, placement=COLOCATE))
    assert f"{key}: " in str(error.value) and reason in str(error.value)
    assert "unknown key" not in str(error.value)


def test_a_native_config_is_left_as_it_is():
    native = {"model": "m", "dataset": "d.jsonl", "learning_rate": 1e-6, "steps_per_generation": 4,
              "max_prompt_length": 64, "train": {"gpus": 2}, "rollout": {"gpus": 2, "engine": "vllm"}}
    translation = translate(native, composed(GRPOConfig))
    assert translation.data == native and not (translation.mapped or translation.noted or translation.problems)


# -------------------------------------------------------------------------
# `megatron rlhf` configs train on the megatron engine
# -------------------------------------------------------------------------


def test_megatron_keys_select_the_megatron_engine_with_lora_parallel_sizes_and_schedule(files, tmp_path):
    """rlhf_type with Megatron's keys is `megatron rlhf`'s config: the megatron engine with ms-swift's LoRA keys, its
    parallel sizes (expert through the engine's options), recomputation, and a warm-up then cosine down to min_lr."""
    from rlcore.config import read_config_data

    path = gkd_file(files, tmp_path, COLOCATED_TEACHER)
    overrides = ["min_lr=1e-7", "lr_warmup_fraction=0.5", "train.expert_model_parallel_size=2",
                 "train.target_modules=[q_proj, v_proj]", "train.lora_dropout=0.1"]
    config = load_config(GKDConfig, path, overrides)
    expect(config, train__engine="megatron", train__lora_rank=8, train__lora_alpha=32, train__lora_dropout=0.1,
           train__lora_target_modules=["q_proj", "v_proj"], train__tensor_model_parallel_size=2,
           train__pipeline_model_parallel_size=1, train__engine_kwargs={"expert_model_parallel_size": 2},
           train__gradient_checkpointing=True, max_steps=2, warmup_steps=1, lr_scheduler_type="cosine",
           learning_rate=1e-6, min_lr=1e-7)
    assert config.optimizer_options().min_lr == 1e-7  # what both train engines' schedules decay to
    notes = translate(read_config_data(path, overrides)[0], composed(GKDConfig))
    assert "lr_decay_style (Megatron's default, cosine) -> lr_scheduler_type: 'cosine'" in notes.mapped
    assert "train.expert_model_parallel_size -> train.engine_kwargs.expert_model_parallel_size: 2" in notes.mapped
    noted = "\n".join(notes.noted)
    for key in ("sequence_parallel: True", "padding_free: True", "recompute_granularity: 'selective'",
                "train.context_parallel_size: 1"):
        assert f"ms-swift's {key} (" in noted


def test_megatron_sizes_at_the_top_and_no_recompute_and_no_floor(files, tmp_path):
    """`megatron rlhf` without Ray takes the parallel sizes at the top; recompute_granularity none trains without
    recomputation; without min_lr Megatron's cosine decays to zero."""
    text = GKD.replace("  tensor_model_parallel_size: 2\n  pipeline_model_parallel_size: 1\n", "").replace(
        "min_lr: 1e-6\n", "tensor_model_parallel_size: 2\npipeline_model_parallel_size: 1\n")
    path = write(files, tmp_path, "gkd.yaml", text, teacher_model=f"teacher_model: {files['teacher']}",
                 teacher_section="")
    config = load_config(GKDConfig, path, ["recompute_granularity=none"])
    expect(config, train__engine="megatron", train__tensor_model_parallel_size=2, train__pipeline_model_parallel_size=1,
           train__gradient_checkpointing=False, gradient_accumulation_steps=8, lr_scheduler_type="cosine", min_lr=0.0)


def test_a_named_train_engine_wins_and_only_megatron_takes_expert_parallelism(files, tmp_path):
    path = gkd_file(files, tmp_path, COLOCATED_TEACHER)
    hf = ["train.engine=hf", "train.tensor_model_parallel_size=1"]
    assert load_config(GKDConfig, path, hf).train.engine == "hf"
    with pytest.raises(ConfigError) as excinfo:
        load_config(GKDConfig, path, [*hf, "train.expert_model_parallel_size=2"])
    assert excinfo.value.problems == [("train.expert_model_parallel_size", "is 2, but only the megatron train engine "
                                       "has expert parallelism (train.engine is 'hf'); use 1, or train.engine megatron")]


def test_swift_rlhf_configs_without_megatron_keys_keep_the_default_engine():
    """`swift rlhf --rlhf_type grpo` (transformers' trainer, TRL's names) is not `megatron rlhf`; one of Megatron's
    keys makes it so."""
    data = {"rlhf_type": "grpo", "model": "m", "dataset": "d.jsonl", "learning_rate": 1e-6,
            "per_device_train_batch_size": 2, "lora_rank": 8}
    assert "engine" not in (translate(data, composed(GRPOConfig)).data.get("train") or {})
    megatron = {"rlhf_type": "grpo", "model": "m", "dataset": "d.jsonl", "micro_batch_size": 2}
    assert translate(megatron, composed(GRPOConfig)).data["train"]["engine"] == "megatron"


# ms-swift's published Ray examples (tests/core/fixtures/ms_swift: its files as published), with only the model,
# teacher and dataset names replaced: the problems `rlcore config validate` reports, one line each (none: valid)
PUBLISHED = {
    "gkd/rollout_colocate_teacher_colocate.yaml": set(),
    "gkd/rollout_colocate_teacher_standalone.yaml": set(),
    "gkd/rollout_separate_teacher_colocate.yaml": set(),
    "gkd/multi_turn_colocate.yaml": set(),  # math_tip_trick is built in; truncation delete, enable_thinking false
    "grpo/ray_grpo_colocate.yaml": {"external_plugins"},  # its reward functions register with ms-swift
    "grpo/ray_grpo_separate.yaml": {"external_plugins"},
    "grpo/opd_rl_colocate.yaml": set(),  # GRPO with a teacher's KL (OPD-RL), its teacher inside the train workers
    "grpo/multi_turn/frozen_lake_colocate.yaml": {"external_plugins", "gym_env", "report_to.0"},
}
FIXTURES = Path(__file__).parent / "fixtures" / "ms_swift"


@pytest.fixture(scope="module")
def long_models(tmp_path_factory):
    """A student and a teacher with the context the examples ask (16384 tokens) and heads for tensor size 2."""
    from rlcore.testing import build_tiny_model

    root = tmp_path_factory.mktemp("long")
    return (str(build_tiny_model(root / "student", arch="qwen3", max_position_embeddings=32768)),
            str(build_tiny_model(root / "teacher", arch="qwen3", hidden_size=96, max_position_embeddings=32768, seed=1)))


def published(name, files, long_models, cwd):
    """ms-swift's example `name` in `cwd` laid out as ms-swift's checkout (the GRPO examples read
    examples/train/grpo/prompt.txt from there), its model, teacher and datasets local."""
    import shutil

    shutil.copytree(FIXTURES / "examples", cwd / "examples", dirs_exist_ok=True)
    student, teacher = long_models
    text = (FIXTURES / "examples" / "ray" / name).read_text()
    names = {"Qwen/Qwen3.5-0.8B": student, "Qwen/Qwen3.5-2B": student, "Qwen/Qwen2.5-VL-3B-Instruct": student,
             "Qwen/Qwen3.5-4B": teacher, "Qwen/Qwen3.5-9B": teacher, "AI-MO/NuminaMath-TIR": files["prompts"],
             "modelscope/gsm8k": files["prompts"], "AI-ModelScope/clevr_cogen_a_train": files["prompts"],
             "examples/megatron/grpo/multi_turn/frozen_lake.jsonl": files["prompts"],
             "AI-ModelScope/alpaca-gpt4-data-zh": files["chats"], "AI-ModelScope/alpaca-gpt4-data-en": files["chats"]}
    if name.startswith("gkd/"):  # rlcore's gkd reads completions too (its sft_alpha term): chats for the math prompts
        names.update({"AI-MO/NuminaMath-TIR": files["chats"], "modelscope/gsm8k": files["chats"]})
    for old, new in names.items():
        text = text.replace(old, new)
    assert "Qwen/" not in text and "AI-" not in text and "modelscope/" not in text
    path = cwd / "example.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_ms_swifts_published_examples_through_config_validate(rlcore_cli, files, long_models, tmp_path, name):
    """On this machine without GPUs: the plan is checked against the example's own GPU counts (train 4, rollout 4,
    teacher 4; tensor 2 splits the train workers into 2 data-parallel ranks), the megatron engine's check against
    the model; what rlcore does not run is refused, one line each, and nothing else is."""
    path = published(name, files, long_models, tmp_path)
    done = rlcore_cli("config", "validate", "--config", str(path),
                      env={"RLCORE_DISABLE_PLUGINS": "", "HF_HUB_OFFLINE": "1"}, timeout=300)
    expected = PUBLISHED[name]
    if not expected:
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"valid for algorithm '{name.split('/')[0]}'" in done.stdout
        if name.startswith("grpo/"):
            return
        for key in ("sequence_parallel: True", "padding_free: True", "recompute_granularity: 'selective'"):
            assert f"rlcore: ms-swift's {key} (" in done.stderr  # what changes nothing here, one line each
        return
    assert done.returncode == 2, done.stderr[-3000:]
    problems = {line.split(": ", 1)[0].strip() for line in done.stderr.splitlines() if line.startswith("  ")}
    assert problems == expected, done.stderr


@pytest.mark.parametrize("name", [n for n, refused in PUBLISHED.items()
                                  if not refused and n.startswith("gkd/") and "multi_turn" not in n])
def test_ms_swifts_gkd_examples_are_megatron_lora_runs(files, long_models, tmp_path, name, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(GKDConfig, published(name, files, long_models, tmp_path))
    expect(config, train__engine="megatron", train__lora_rank=8, train__lora_alpha=32, train__lora_dropout=0.05,
           train__lora_target_modules="all-linear", train__tensor_model_parallel_size=2, train__gradient_checkpointing=True,
           train__dtype="auto", gradient_accumulation_steps=16 // (config.per_device_train_batch_size * 2),
           lr_scheduler_type="constant", learning_rate=1e-6, max_steps=4000 // 16 if "colocate_teacher_colocate" in name
           else 2000 // 16, gkd_logits_topk=64)


def test_ms_swifts_opd_rl_example_is_grpo_with_its_teacher_in_the_train_workers(files, long_models, tmp_path, monkeypatch):
    """grpo/opd_rl_colocate.yaml: GRPO on megatron with LoRA, one generation per prompt, the teacher's KL in the
    advantage at coefficient 1, the teacher offloaded beside the policy (no group of its own)."""
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    monkeypatch.chdir(tmp_path)
    config = load_config(GRPOConfig, published("grpo/opd_rl_colocate.yaml", files, long_models, tmp_path))
    expect(config, teacher_model=long_models[1], teacher_kl_coef=1.0, offload_teacher_model=True, num_generations=1,
           beta=0.0, train__engine="megatron", train__lora_rank=8, rollout__engine="vllm")
    assert not config.separate_teacher and "teacher" not in GRPOTrainer.roles(config)
    teacher = GRPOTrainer.train_setup_options(config, config.model)["teacher"]
    assert teacher["engine"] == "megatron" and teacher["offload"] and teacher["options"]["model"] == long_models[1]


def test_ms_swifts_multi_turn_gkd_example_runs_the_math_tip_scheduler(files, long_models, tmp_path, monkeypatch):
    """gkd/multi_turn_colocate.yaml: ms-swift's scheduler name and max_turns are rlcore's own keys, the built-in
    math_tip_trick, and nothing is reported about them; truncation_strategy and enable_thinking are honored."""
    from rlcore import load_plugins
    from rlcore.plugins.gkd.trainer import GKDTrainer

    monkeypatch.chdir(tmp_path)
    path = published("gkd/multi_turn_colocate.yaml", files, long_models, tmp_path)
    config = load_config(GKDConfig, path)
    assert (config.multi_turn_scheduler, config.max_turns, config.lmbda) == ("math_tip_trick", 2, 1.0)
    assert (config.truncation_strategy, config.chat_template_kwargs) == ("delete", {"enable_thinking": False})
    assert config.multi_turn_problems(load_plugins()) == []
    assert not [p for p in GKDTrainer.problems(config, load_plugins()) if p[0] in ("lmbda", "multi_turn_scheduler")]


@pytest.mark.parametrize("override, said", [
    ("rollout.gpus=2", "got train.gpus=4, rollout.gpus=2"),  # the plan: colocated roles share the same 4 GPUs
    ("train.tensor_model_parallel_size=4", "key/value heads"),  # the megatron engine's check: tensor size vs the model
])
def test_a_published_example_is_checked_against_its_gpus_and_model(rlcore_cli, files, long_models, tmp_path, override,
                                                                      said):
    path = published("gkd/rollout_colocate_teacher_colocate.yaml", files, long_models, tmp_path)
    done = rlcore_cli("config", "validate", "--config", str(path), override,
                      env={"RLCORE_DISABLE_PLUGINS": "", "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 2 and said in done.stderr, done.stderr[-3000:]


# -------------------------------------------------------------------------
# refused keys: one line each, with the reason
# -------------------------------------------------------------------------


@pytest.mark.parametrize("override, key, reason", [
    ("deepspeed=ds_zero3.json", "deepspeed", "may set the optimizer, schedule and precision"),
    ("split_dataset_ratio=0.1", "split_dataset_ratio", "holds none out"),
    ("eval_steps=10", "eval_steps", None),  # noted: nothing is held out
    ("deepspeed=zero2", "deepspeed", None),  # noted: DDP runs the same steps
], ids=["deepspeed-file", "split", "eval_steps", "deepspeed-zero2"])
def test_sft_keys_rlcore_cannot_honour_are_refused(files, tmp_path, override, key, reason):
    path = write(files, tmp_path, "sft.yaml", SFT)
    if reason is None:
        load_config(SFTConfig, path, [override])
        return
    with pytest.raises(ConfigError) as excinfo:
        load_config(SFTConfig, path, [override])
    problems = dict(excinfo.value.problems)
    assert list(problems) == [key] and reason in problems[key] and "\n" not in problems[key]


@pytest.mark.parametrize("override, key, reason", [
    ("train.context_parallel_size=2", "train.context_parallel_size", "context parallelism (a sequence split over GPUs) "
     "is not built"),
    ("global_batch_size=15", "global_batch_size", "multiple of micro_batch_size (1) x the data-parallel size (2"),
    ("finetune=false", "finetune", "--resume"),
    (["min_lr=0", "lr_decay_style=WSD"], "lr_decay_style", "'WSD' is not one of rlcore's schedules"),
    ("min_lr=1e-5", "min_lr", "(1e-05) is above learning_rate (1e-06)"),
    ("rlhf_type=dpo", "rlhf_type", "grpo, gkd"),
], ids=["context", "global-batch", "finetune", "decay-style", "min-lr", "rlhf-type"])
def test_gkd_keys_rlcore_cannot_honour_are_refused(files, tmp_path, override, key, reason):
    with pytest.raises(ConfigError) as excinfo:
        load_config(GKDConfig, gkd_file(files, tmp_path, COLOCATED_TEACHER), [override] if isinstance(override, str)
                    else override)
    problems = dict(excinfo.value.problems)
    assert list(problems) == [key] and reason in problems[key], problems


def test_epochs_without_a_known_row_count_ask_for_train_iters(files, tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        load_config(GRPOConfig, grpo_file(files, tmp_path, COLOCATE), [f"dataset={tmp_path / 'elsewhere.jsonl'}"])
    assert "set max_steps (ms-swift's train_iters)" in dict(excinfo.value.problems)["num_train_epochs"]


def test_epochs_over_a_local_file_count_its_rows(files, tmp_path):
    config = load_config(GRPOConfig, grpo_file(files, tmp_path, COLOCATE), [f"dataset={files['prompts']}"])
    rows = len(Path(files["prompts"]).read_text().splitlines())
    dp = config.train_workers
    steps = rows * config.num_generations // (config.per_device_train_batch_size * dp * config.gradient_accumulation_steps)
    assert config.max_steps == max(1, steps)


def test_an_unknown_key_suggests_or_points_to_config_show_once(rlcore_cli, files, tmp_path):
    path = grpo_file(files, tmp_path, COLOCATE)
    done = rlcore_cli("config", "validate", "--config", path, "num_generation=4", "zzz=1", "train.qqq=1",
                      env={"RLCORE_DISABLE_PLUGINS": "", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr
    assert "num_generation: unknown key 'num_generation'. Did you mean 'num_generations'?" in done.stderr
    assert "zzz: unknown key 'zzz'. `rlcore config show --plugin grpo` lists every key." in done.stderr
    assert "lists every key under train." in done.stderr
    assert len(done.stderr) < 1000 and "Known keys" not in done.stderr


def test_config_show_from_ms_swift_prints_the_mapping_and_a_config_that_loads_back(rlcore_cli, files, tmp_path):
    path = grpo_file(files, tmp_path, COLOCATE)
    done = rlcore_cli("config", "show", "--from-ms-swift", path, env={"RLCORE_DISABLE_PLUGINS": "loggers"})
    assert done.returncode == 0, done.stderr
    assert "#   micro_batch_size -> per_device_train_batch_size: 2" in done.stdout
    assert "#   ms-swift's attention_backend: 'flash' (the engine picks its attention kernel" in done.stdout
    (tmp_path / "rlcore.yaml").write_text(done.stdout)
    assert load_config(GRPOConfig, tmp_path / "rlcore.yaml") == load_config(GRPOConfig, path)


# -------------------------------------------------------------------------
# each family runs from the CLI on the CPU: CPU workers, tiny models, one step
# -------------------------------------------------------------------------

ON_CPU = ["use_vllm=false", "train.gpus=0", "rollout.gpus=0", "train_iters=1", "max_completion_length=4",
          "train.tensor_model_parallel_size=1", "global_batch_size=8"]


def run(rlcore_cli, *args):
    done = rlcore_cli("run", *args, env={"RLCORE_DISABLE_PLUGINS": "", "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.mark.parametrize("layout", ["colocate", "separate"])
def test_grpo_runs_on_the_cpu(rlcore_cli, files, tmp_path, layout):
    placement = COLOCATE if layout == "colocate" else SEPARATE
    ray = ["--use_ray", "true"] if layout == "separate" else []  # ms-swift's `megatron rlhf --use_ray true`
    scale = ["steps_per_generation=1"] + (["colocate_groups=[]"] if layout == "colocate" else [])  # no GPUs to share
    summary, err = run(rlcore_cli, *ray, "--config", grpo_file(files, tmp_path, placement), *ON_CPU, *scale)
    assert summary["algorithm"] == "grpo" and summary["step"] == 1
    assert ("CPU, engine megatron" if ray else "in this process, engine megatron") in err  # LoRA on megatron
    assert "ms-swift's attention_backend: 'flash'" in err


@pytest.mark.parametrize("layout", ["colocated", "standalone"])
def test_gkd_runs_on_the_cpu(rlcore_cli, files, tmp_path, layout):
    teacher = COLOCATED_TEACHER if layout == "colocated" else STANDALONE_TEACHER
    scale = ["colocate_groups=[]", "gkd_logits_topk=8", "global_batch_size=2",
             "recompute_granularity=none"] + (  # megatron recomputes on CUDA only
        ["teacher.gpus=0"] if layout == "standalone" else [])
    summary, err = run(rlcore_cli, "--config", gkd_file(files, tmp_path, teacher), *ON_CPU, *scale)
    assert summary["algorithm"] == "gkd" and summary["step"] == 1 and summary["jsd"] > 0
    assert "train: 1 worker, in this process, engine megatron" in err
    assert ("teacher: 1 worker" in err) == (layout == "standalone")


def test_model_name_is_refused_where_no_rows_are_filled(files, tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        load_config(GRPOConfig, grpo_file(files, tmp_path, COLOCATE), ["model_name=swift-bot"])
    assert "does for sft only" in dict(excinfo.value.problems)["model_name"]


def test_sft_runs_on_the_cpu(rlcore_cli, files, tmp_path):
    """ms-swift's published sft.yaml (deepspeed: zero3, model_name, model_author) scaled to one CPU worker: the
    deepspeed notice is one line, and the rows trained have the names filled in (zh rows the same one)."""
    from datasets import load_from_disk

    summary, err = run(rlcore_cli, "--plugin", "sft", "--config", write(files, tmp_path, "sft.yaml", SFT),
                       "device_groups.default.device=CPU", "device_groups.default.ranks=1", "max_steps=1",
                       "torch_dtype=float32", f"dataset_cache_dir={tmp_path / 'cache'}")
    assert summary["algorithm"] == "sft" and summary["step"] == 1 and "default: 1 worker, CPU" in err
    (notice,) = [line for line in err.splitlines() if "deepspeed" in line]
    assert notice.startswith("rlcore: ms-swift's deepspeed: 'zero3' (not used: rlcore trains every worker with DDP")
    (stored,) = [p.parent for p in (tmp_path / "cache").glob("*/dataset_info.json")]
    answers = [row["messages"][-1]["content"] for row in load_from_disk(str(stored))]
    assert answers[:2] == ["I am swift-bot, trained by swift.", "我是swift-bot, 由swift训练。"] and len(answers) == 16


def test_sampling_runs_on_the_cpu(rlcore_cli, files, tmp_path):
    summary, err = run(rlcore_cli, "--plugin", "sample", "--config", write(files, tmp_path, "sample.yaml", SAMPLING),
                       "sampler_engine=hf", "max_new_tokens=4", "max_length=512",  # the tiny model holds 1024
                       "device_groups.sample_group.device=CPU",
                       "device_groups.sample_group.ranks=1", "device_groups.rm_group.device=CPU",
                       "device_groups.rm_group.ranks=1")
    assert summary["algorithm"] == "sample" and "sampler: 1 worker, CPU" in err
    assert (tmp_path / "out" / "sampling.jsonl").is_file()  # output_file, in output_dir


# -------------------------------------------------------------------------
# vllm_enable_lora: the adapter alone to vLLM at each sync
# -------------------------------------------------------------------------


def test_vllm_enable_lora_and_its_rank_reach_the_rollout_section(files, tmp_path, rlcore_cli):
    """ms-swift's top-level vllm_enable_lora and vllm_max_lora_rank are the rollout section's keys of the same names
    (not vLLM engine arguments); `config validate` refuses them in one line where the rollout engine is not vLLM."""
    from rlcore.plugins.vllm.checks import config_problems

    path = grpo_file(files, tmp_path, COLOCATE)
    config = load_config(GRPOConfig, path, ["vllm_enable_lora=true", "vllm_max_lora_rank=32"])
    expect(config, rollout__vllm_enable_lora=True, rollout__vllm_max_lora_rank=32, rollout__vllm_engine_kwargs={},
           rollout__engine="vllm", train__lora_rank=8)
    assert config_problems(config, "rollout") == []
    done = rlcore_cli("config", "validate", "--config", path, "vllm_enable_lora=true", "use_vllm=false",
                      env={"RLCORE_DISABLE_PLUGINS": "", "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "vllm_enable_lora" in line]
    assert line.strip().startswith("rollout.vllm_enable_lora:") and "rollout.engine is 'hf'" in line


def _lora_config(model="", **keys):
    train = {"lora_rank": 8, **keys.pop("train", {})}
    rollout = {"engine": "vllm", "vllm_enable_lora": True, **keys.pop("rollout", {})}
    return composed(GRPOConfig)(model=model, train=train, rollout=rollout, **keys)


@pytest.mark.parametrize("keys, key, said", [
    ({"train": {"lora_rank": 0}}, "rollout.vllm_enable_lora", "train.lora_rank is 0"),
    ({"rollout": {"engine": "hf"}}, "rollout.vllm_enable_lora", "rollout.engine is 'hf'"),
    ({"train": {"lora_rank": 48}}, "rollout.vllm_max_lora_rank", "below train.lora_rank (48); vLLM refuses a larger "
                                                                  "adapter: raise it to a rank vLLM takes, at least 48"),
    ({"sleep_level": 2, "colocate_groups": [["train", "rollout"]]}, "sleep_level", "base weights are sent once"),
    ({"train": {"lora_target_modules": ["all-linear", "lm_head"]}}, "train.lora_target_modules",
     "vLLM applies LoRA to its linear layers only and its LM head is none"),
    ({"train": {"lora_target_modules": ["q_proj", "output_layer"]}}, "train.lora_target_modules", "drop lm_head from"),
], ids=["no-train-lora", "hf-rollout", "rank-above-max", "sleep-level-2", "lm-head", "megatron-output-layer"])
def test_an_adapter_only_sync_that_cannot_work_is_refused_in_one_line(keys, key, said):
    """The vllm engine's check of the whole config (`EngineSpec.config_check`); with another rollout engine, the
    key is one of another engine's (`other_engine_key_problems`)."""
    from rlcore.plugins.vllm.checks import config_problems
    from rlcore.sections import other_engine_key_problems

    config = _lora_config(**keys)
    ((got, message),) = other_engine_key_problems(config, ["train", "rollout"]) + config_problems(config, "rollout")
    assert got == key and said in message and "\n" not in message


def test_adapters_on_qwen35s_gated_delta_net_are_refused_with_the_targets_vllm_loads(tmp_path):
    """vLLM loads no LoRA on Qwen3.5's linear-attention projections: all-linear (which adapts them) or a delta-net name
    is refused, read from config.json; the attention and MLP projections pass, and so does all-linear on a model
    without linear attention."""
    from rlcore.plugins.vllm.checks import config_problems

    def adapter_sync_problems(config):
        return config_problems(config, "rollout")

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {"layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}}))
    ((key, message),) = adapter_sync_problems(_lora_config(str(tmp_path)))
    assert key == "train.lora_target_modules" and "gated delta-net" in message and "q_proj, k_proj" in message
    assert adapter_sync_problems(_lora_config(str(tmp_path), train={"lora_target_modules": ["in_proj_z", "q_proj"]}))
    attention = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert adapter_sync_problems(_lora_config(str(tmp_path), train={"lora_target_modules": attention})) == []
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert adapter_sync_problems(_lora_config(str(tmp_path))) == []
