"""SFT and pre-training on the `default` role: the CPU demo, one process against two Ray workers (gloo),
resume after an interrupt, pre-training, a worker that dies, and the mistakes caught before anything runs."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore import ConfigError, RlcoreError, RoleFailed, hookimpl, load_config, load_plugins
from rlcore.plugins.sft.config import PretrainConfig, SFTConfig
from rlcore.testing import arithmetic_rows as demo_rows
from rlcore.plugins.sft.trainer import PretrainTrainer, SFTTrainer
from rlcore.plugins.sft.worker import CHECKPOINT
from rlcore.runtime.resources import plan_from_config
from rlcore.testing import build_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray" / "sft"
STEPS = 4
# The same global batch of 4 rows: one process of 4, or two workers of 2 (the config of each run).
QUICK = {"max_steps": STEPS, "learning_rate": 3e-3, "max_length": 64, "lr_scheduler_type": "constant"}
ONE_PROCESS = {"per_device_train_batch_size": 4}
TWO_WORKERS = {"per_device_train_batch_size": 2}


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in demo_rows("sft", 64)))
    return str(path)


def make(plugins, out, tiny, data, use_ray=False, cls=SFTTrainer, **overrides):
    config_cls = SFTConfig if cls is SFTTrainer else PretrainConfig
    cache = str(Path(out).parent / "data-cache")  # each test's own, not the system's temporary directory
    config = config_cls(**{**QUICK, "model": str(tiny), "dataset": data, "output_dir": str(out),
                           "dataset_cache_dir": cache, **overrides})
    return cls(config, plugins, use_ray=use_ray)


def losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(plugins, tiny_model, chats, tmp_path_factory):
    """The loss curve of one uninterrupted run in this process, global batch 4."""
    out = tmp_path_factory.mktemp("straight") / "run"
    make(plugins, out, tiny_model, chats, **ONE_PROCESS).fit()
    return losses(out)


class Places:
    """Records each worker's place (its environment) and every socket the job listens on (the driver and
    the processes under it: the local Ray's and the workers') once the run has begun."""

    def __init__(self):
        self.seen = None
        self.listening = None

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        if step == 1:
            from tests.reliability.test_network import listeners

            self.seen = trainer.session["default"].where()
            self.listening = listeners()


@pytest.mark.ray
def test_two_ray_workers_give_the_loss_curve_of_one_process(ray_local, straight, tiny_model, chats, tmp_path):
    """Two CPU workers (gloo) placed by the device_groups form, each half the global batch: per step, the
    loss of one process with the whole batch, within 1e-4."""
    plugins = load_plugins()
    places = Places()
    plugins.register(places, "places")
    groups = {"cpu_group": {"device": "CPU", "ranks": 2, "workers": ["default"]}}
    trainer = make(plugins, tmp_path / "run", tiny_model, chats, use_ray=True, device_groups=groups, **TWO_WORKERS)
    last = trainer.fit()
    two = losses(tmp_path / "run")
    assert len(two) == STEPS and two == pytest.approx(straight, abs=1e-4), (two, straight)
    assert straight[-1] < straight[0] - 0.5  # it learns
    assert {"grad_norm", "learning_rate", "mean_token_accuracy", "time/train"} <= set(last)
    assert trainer.shape == {"max_steps": STEPS, "world_size": 2, "train_rows": 64, "global_batch": 4}
    seen = places.seen
    assert [p["rank"] for p in seen] == ["0", "1"] and {p["world_size"] for p in seen} == {"2"}
    assert [p["local_rank"] for p in seen] == ["0", "1"]  # one node
    assert len({(p["master_addr"], p["master_port"]) for p in seen}) == 1 and seen[0]["master_port"]
    assert len({p["pid"] for p in seen}) == 2 and os.getpid() not in {p["pid"] for p in seen}
    assert {p["backend"] for p in seen} == {"gloo"} and all(p["device"].startswith("cpu") for p in seen)
    # the node's first worker read and tokenised the rows; the other opened what it stored
    assert [p["rows_read_here"] for p in seen] == [True, False]
    assert seen[0]["token_cache"] == seen[1]["token_cache"] and seen[0]["token_cache"]
    assert all(f.startswith(str(tmp_path / "data-cache")) for f in seen[0]["token_cache"])
    assert (tmp_path / "run" / f"checkpoint-{STEPS}" / "model" / "model.safetensors").is_file()
    # every listener of the running job is on loopback: the workers' torch.distributed store and gloo too
    from tests.reliability.test_network import loopback

    assert places.listening and [a for a in places.listening if not loopback(a[1])] == [], places.listening
    assert {port for _, _, port in places.listening} >= {int(seen[0]["master_port"])}, (places.listening, seen)


class SignalAt:
    def __init__(self, step, sig):
        self.step, self.sig = step, sig

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("run_ahead", [True, False])
def test_resume_after_an_interrupt_continues_the_same_loss_curve(straight, tiny_model, chats, tmp_path, capfd,
                                                                  run_ahead):
    """SIGINT as step 2 is logged: the run saves and stops, and --resume gives the uninterrupted curve (which ran
    ahead: each step began while the driver logged the one before). Running ahead, step 3 had begun: the run
    counts it and saves checkpoint-3, which holds the trainer at step 3; waiting for the driver, checkpoint-2."""
    plugins = load_plugins()
    plugins.register(SignalAt(2, signal.SIGINT), "interrupt")
    at = 3 if run_ahead else 2
    with pytest.raises(KeyboardInterrupt):
        make(plugins, tmp_path / "run", tiny_model, chats, run_ahead=run_ahead, **ONE_PROCESS).fit()
    assert f"stopped by SIGINT after step {at}; saved {tmp_path / 'run' / f'checkpoint-{at}'}" in capfd.readouterr().err
    assert losses(tmp_path / "run") == pytest.approx(straight[:at], abs=1e-4)
    state = json.loads((tmp_path / "run" / f"checkpoint-{at}" / "model" / "trainer_state.json").read_text())
    assert state["global_step"] == at
    with pytest.raises(ConfigError, match=f"already holds checkpoint-{at}; resume it with --resume"):
        make(load_plugins(), tmp_path / "run", tiny_model, chats, **ONE_PROCESS)  # never overwritten
    resumed = make(load_plugins(), tmp_path / "run", tiny_model, chats, resume="auto", **ONE_PROCESS)
    resumed.fit()
    assert losses(tmp_path / "run") == pytest.approx(straight, abs=1e-4)
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "model" / "trainer_state.json").read_text())
    assert state["global_step"] == 4  # the trainer's own step, optimizer and data position went on


def test_a_damaged_optimizer_or_rng_state_is_passed_over_then_refused_in_one_line(plugins, tiny_model, chats, tmp_path,
                                                                                   caplog):
    """Two checkpoints; the newest's optimizer.pt torn: --resume passes over it (a warning naming the file) to the
    older one, before its trainer begins; that one's rng_state.pth torn too: one line naming it (a traceback of
    torch.load's before), and rlcore_run.json says the run failed."""
    out = tmp_path / "run"
    make(plugins, out, tiny_model, chats, save_steps=1, max_steps=2, **ONE_PROCESS).fit()
    for step, piece in ((2, "optimizer.pt"), (1, "rng_state.pth")):
        path = out / f"checkpoint-{step}" / CHECKPOINT / piece
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    trainer = make(load_plugins(), out, tiny_model, chats, resume="auto", **ONE_PROCESS)
    with pytest.raises(RlcoreError) as refused:
        trainer.fit()
    message = str(refused.value)
    assert message.startswith(f"cannot resume from {out / 'checkpoint-1'}: checkpoint piece ") and "\n" not in message
    assert f"{CHECKPOINT}/rng_state.pth is damaged: not a torch archive" in message, message
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("checkpoint-2 is damaged (checkpoint piece ") and \
        f"{CHECKPOINT}/optimizer.pt is damaged" in warned[0] and warned[0].endswith("resuming from checkpoint-1")
    assert json.loads((out / "rlcore_run.json").read_text())["state"] == "failed"


def test_running_ahead_waits_at_each_checkpoint(straight, plugins, tiny_model, chats, tmp_path):
    """save_steps 2: the step after a checkpoint's begins only once it is written, so checkpoint-2 holds step 2."""
    make(plugins, tmp_path / "run", tiny_model, chats, save_steps=2, **ONE_PROCESS).fit()
    assert losses(tmp_path / "run") == pytest.approx(straight, abs=1e-4)
    for step in (2, 4):
        state = json.loads((tmp_path / "run" / f"checkpoint-{step}" / "model" / "trainer_state.json").read_text())
        assert state["global_step"] == step


def test_the_embedded_demo_loss_falls(tmp_path):
    """What a new user's `rlcore run --plugin sft` does, cut to 12 steps: the tiny random model learns the toy
    conversations (measured: loss 5.5 -> 2.9)."""
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "rlcore", "run", "--plugin", "sft", f"output_dir={out}", "max_steps=12",
                           f"dataset_cache_dir={tmp_path / 'data-cache'}"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])  # stdout holds the summary alone
    assert len(done.stdout.strip().splitlines()) == 1, done.stdout[-2000:]
    assert summary["algorithm"] == "sft" and summary["step"] == 12
    curve = losses(out)
    assert len(curve) == 12 and sum(curve[-3:]) / 3 < 0.75 * sum(curve[:3]) / 3, curve
    assert (out / "checkpoint-12" / "model" / "optimizer.pt").is_file()


def test_pretraining_packs_text_into_blocks_and_learns(plugins, tiny_model, tmp_path):
    corpus = tmp_path / "corpus.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(demo_rows("pt", 128)), corpus)
    trainer = make(plugins, tmp_path / "run", tiny_model, str(corpus), cls=PretrainTrainer, max_steps=6,
                   per_device_train_batch_size=4, max_length=32)
    trainer.fit()
    curve = losses(tmp_path / "run")
    assert len(curve) == 6 and curve[-1] < curve[0] - 0.5, curve
    # every row (about 28 tokens with its EOS) is in a block of exactly 32 tokens: 128 rows make ~110 blocks
    assert 90 < trainer.shape["train_rows"] < 128 and trainer.shape["global_batch"] == 4


def test_without_max_steps_the_epochs_over_the_data_set_the_steps(plugins, tiny_model, tmp_path):
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(demo_rows("sft", 20)))  # a JSON list: 20 rows, batches of 4 -> 5 steps an epoch
    trainer = make(plugins, tmp_path / "run", tiny_model, str(data), max_steps=None, num_train_epochs=2, **ONE_PROCESS)
    last = trainer.fit()
    assert trainer.max_steps == 10 and last["step"] == 10 and last["epoch"] == 2.0
    assert len(losses(tmp_path / "run")) == 10


def test_min_lr_is_the_floor_the_cosine_schedule_decays_to(plugins, tiny_model, chats, tmp_path):
    """Megatron's and ms-swift's `min_lr`, an optimizer key of every algorithm, reaches transformers' trainer too."""
    make(plugins, tmp_path / "run", tiny_model, chats, lr_scheduler_type="cosine", min_lr=1e-3, **ONE_PROCESS).fit()
    rates = [json.loads(line)["learning_rate"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    floor = [1e-3 + 2e-3 * 0.5 * (1 + math.cos(math.pi * step / STEPS)) for step in range(STEPS)]  # the step's rate
    assert rates == pytest.approx(floor, abs=1e-12)  # from learning_rate 3e-3 towards 1e-3, not towards 0


class KillRank:
    """Kills one worker of the default role with SIGKILL at a step, as a crashed node or the OOM killer would."""

    def __init__(self, step, rank):
        self.step, self.rank, self.killed_at = step, rank, None

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        if step == self.step:
            pid = trainer.session["default"].where()[self.rank]["pid"]
            os.kill(pid, signal.SIGKILL)
            self.killed_at = time.monotonic()


@pytest.mark.ray
def test_a_worker_that_dies_fails_the_run_naming_it_and_the_last_checkpoint_resumes(
    ray_local, straight, tiny_model, chats, tmp_path
):
    plugins = load_plugins()
    kill = KillRank(2, rank=1)
    plugins.register(kill, "kill")
    role = {"cpus": 2}
    with pytest.raises(RoleFailed) as failed:
        make(plugins, tmp_path / "run", tiny_model, chats, use_ray=True, default=role, save_steps=1, **TWO_WORKERS).fit()
    seconds = time.monotonic() - kill.killed_at
    assert failed.value.role == "default" and failed.value.rank == 1 and failed.value.node, str(failed.value)
    assert "role 'default'" in str(failed.value) and "rank 1" in str(failed.value)
    assert seconds < 30, seconds
    resumed = make(load_plugins(), tmp_path / "run", tiny_model, chats, use_ray=True, default=role, save_steps=1,
                   resume="auto", **TWO_WORKERS)
    assert resumed.resume_from.name == "checkpoint-1"  # step 2's save met the dead worker: never published
    resumed.fit()
    assert losses(tmp_path / "run") == pytest.approx(straight, abs=1e-4)


# -- mistakes, caught before anything is allocated ----------------------------------------------------


def test_data_mistakes_name_the_file_row_and_column(plugins, tiny_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
        json.dumps({"text": "not a conversation"}),
    ]) + "\n")
    with pytest.raises(ConfigError) as caught:
        make(plugins, tmp_path / "run", tiny_model, str(bad))
    message = str(caught.value)
    assert f"{bad}: row 2, column 'messages': ends with a 'user' message" in message
    assert f"{bad}: row 3: has neither a 'messages' column nor 'prompt' and 'completion' columns" in message
    text = tmp_path / "text.json"
    text.write_text(json.dumps([{"text": "fine"}, {"text": ""}, {"body": "x"}]))
    with pytest.raises(ConfigError) as caught:
        make(plugins, tmp_path / "run", tiny_model, str(text), cls=PretrainTrainer)
    assert f"{text}: row 2, column 'text': is str ''" in str(caught.value)
    assert f"{text}: row 3, column 'text': is missing" in str(caught.value)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "1+1", "completion": "2"}) + "\n" + bad.read_text().splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match="rows 1 use prompt and completion; rows 2 use messages"):
        make(plugins, tmp_path / "run", tiny_model, str(mixed))
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with a real model's context (the examples' max_length is 2048-4096 tokens)."""
    return build_tiny_model(tmp_path_factory.mktemp("long") / "tiny-qwen2", max_position_embeddings=32768)


def test_trainer_kwargs_and_config_mistakes_are_reported_at_once(plugins, tiny_model, long_model, chats, tmp_path,
                                                                 monkeypatch):
    with pytest.raises(ConfigError) as caught:
        make(plugins, tmp_path / "run", tiny_model, chats, default={"gpus": 2}, device_groups={
            "g": {"device": "GPU", "ranks": 2, "workers": ["default"]}},
            trainer_kwargs={"neftune_noise_alpah": 5, "save_strategy": "steps", "packing": True})
    problems = dict(caught.value.problems)
    assert "Did you mean 'neftune_noise_alpha'" in problems["trainer_kwargs.neftune_noise_alpah"]
    assert "set by rlcore; use save_steps" in problems["trainer_kwargs.save_strategy"]
    assert "set packing at the top level" in problems["trainer_kwargs.packing"]
    assert "both resource forms are given" in problems["device_groups"]
    with pytest.raises(ConfigError, match="dataset: is unset; name one"):  # checked as a run checks it
        SFTTrainer.check(load_config(SFTConfig, overrides=[f"model={tiny_model}"]), plugins)
    with pytest.raises(ConfigError, match="fp16: and bf16 are both set"):
        load_config(SFTConfig, overrides=["bf16=true", "fp16=true"])
    on_gpus = load_config(SFTConfig, EXAMPLES / "multi_node.yaml", [f"model={long_model}", f"dataset={chats}",
                                                                     f"output_dir={tmp_path / 'gpu'}"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # the same config without --use-ray: this process
    with pytest.raises(ConfigError, match="device_groups.default: puts the default role on GPUs, and without --use-ray"):
        SFTTrainer(on_gpus, plugins)
    with pytest.raises(ConfigError, match="offload_model: has no effect here: every worker trains"):
        load_config(PretrainConfig, overrides=["offload_model=true"])


def test_lora_with_gradient_checkpointing_on_prompt_completion_rows(tiny_model, tmp_path):
    """TRL's prompt-completion form (completion-only loss), LoRA through peft, activation checkpointing."""
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i} plus one?"}],
                                        "completion": [{"role": "assistant", "content": f"{i + 1}."}]}) + "\n"
                            for i in range(16)))
    seen = {}

    class Peek:
        @hookimpl
        def rlcore_step_end(self, trainer, step, metrics):
            seen["hf"] = trainer.session["default"].runner.trainer  # in this process: the TRL trainer itself

    plugins = load_plugins()
    plugins.register(Peek(), "peek")
    make(plugins, tmp_path / "run", tiny_model, str(data), max_steps=2, lora_rank=4, gradient_checkpointing=True,
         completion_only_loss=True, **ONE_PROCESS).fit()
    hf = seen["hf"]
    assert hf.args.activation_checkpointing and hf.completion_only_loss
    assert type(hf.model).__name__.startswith("Peft")
    assert all(not p.requires_grad for n, p in hf.model.named_parameters() if "lora_" not in n)
    saved = tmp_path / "run" / "checkpoint-2" / "model"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
    assert len(losses(tmp_path / "run")) == 2


@pytest.mark.parametrize("example", ["multi_node.yaml", "multi_node_gpus.yaml"])
def test_the_two_node_examples_place_sixteen_ranks_on_two_nodes(plugins, example):
    config = load_config(SFTConfig, EXAMPLES / example)
    plan = plan_from_config(config, roles=["default"], plugins=plugins)
    assert plan.num_workers("default") == 16 and plan.nodes == (0, 1) and plan.nproc_per_node == 8
    assert plan.ranks_of("default") == tuple(range(16)) and plan.group_of("default").device == "GPU"


def test_every_example_validates_from_the_cli(chats, long_model, tmp_path, capsys):
    from rlcore.cli import main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "hello"}) + "\n")
    examples = sorted(EXAMPLES.glob("*.yaml"))
    assert [e.name for e in examples] == ["lora.yaml", "multi_node.yaml", "multi_node_gpus.yaml", "pretrain.yaml"]
    for example in examples:
        algorithm, data = ("pt", corpus) if example.name == "pretrain.yaml" else ("sft", chats)
        code = main(["config", "validate", "--plugin", algorithm, "--config", str(example), f"dataset={data}",
                     f"model={long_model}"])  # its hub id is checked too, and this machine may have no network
        out = capsys.readouterr()
        assert code == 0 and f"valid for algorithm '{algorithm}'" in out.out, (example, out.err)
    assert main(["config", "validate", "--plugin", "sft", "--config", str(EXAMPLES / "lora.yaml"), f"model={long_model}"]) == 2
    assert "dataset: 'data/prompt_completion.jsonl' does not exist" in capsys.readouterr().err  # the data is checked


def test_self_cognition_names_fill_the_rows_by_their_tag(tmp_path):
    """model_name/model_author as ms-swift gives them, [zh, en]: a zh-tagged row gets the first, the others the second."""
    from rlcore.plugins.sft.data import sft_rows

    path = tmp_path / "cognition.jsonl"
    rows = [{"messages": [{"role": "user", "content": "你是谁"}, {"role": "assistant", "content": "我是{{NAME}}，{{AUTHOR}}"}],
             "tag": "zh"},
            {"messages": [{"role": "user", "content": "Who made you?"},
                          {"role": "assistant", "content": "{{AUTHOR}} made {{NAME}}."}], "tag": "en"}]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    names = {"NAME": ["小黄", "Xiao Huang"], "AUTHOR": ["魔搭", "ModelScope"]}
    filled = sft_rows(path, names)
    assert filled[0]["messages"][1]["content"] == "我是小黄，魔搭"
    assert filled[1]["messages"][1]["content"] == "ModelScope made Xiao Huang."
    assert sft_rows(path)[1]["messages"][1]["content"] == "{{AUTHOR}} made {{NAME}}."  # without names, rows as they are


def test_conversations_given_to_pt_are_one_problem_pointing_to_sft(chats):
    from rlcore.plugins.sft.data import check_files

    (problem,) = check_files([chats], "pt")
    assert problem == (f"{chats}: rows 1, 2, 3, 4, 5, ... (64 in all), column 'text'",
                       "is missing; a pre-training row needs non-empty text; conversations train with --plugin sft")


def test_padding_free_rows_give_the_padded_loss_curve(plugins, tiny_model, chats, tmp_path):
    """TRL's padding-free collator (one flattened row, each sequence's own position ids) on transformers' sdpa:
    the packed-sequence mask keeps each row to itself, so the loss curve is the padded one's."""
    curves = {}
    for padding_free in (False, True):
        out = tmp_path / f"free-{padding_free}"
        make(plugins, out, tiny_model, chats, **ONE_PROCESS, max_steps=2, max_length=None,
             padding_free=padding_free).fit()
        curves[padding_free] = losses(out)
    assert len(curves[True]) == 2
    assert curves[True] == pytest.approx(curves[False], rel=1e-5)
    with pytest.raises(ValueError, match="padding_free without packing"):  # TRL would refuse it in every worker
        SFTConfig(model=str(tiny_model), dataset=chats, padding_free=True, max_length=64)
