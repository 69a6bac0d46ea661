"""GKD end to end on the Hugging Face engines: the embedded demo learns, and the example layouts (scaled to the
CPU: fake GPUs place the actors, the engines compute on the CPU) run on a real Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore import load_config, load_plugins
from rlcore.plugins.gkd.config import GKDConfig
from rlcore.plugins.gkd.trainer import GKDTrainer
from rlcore.testing import build_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray" / "gkd"
QUICK = ["max_steps=2", "max_completion_length=4", "per_device_train_batch_size=2", "learning_rate=1e-3",
         "train.dtype=float32", "rollout.dtype=float32", "rollout.engine=hf", "train.engine_kwargs={device: cpu}",
         "rollout.engine_kwargs={device: cpu}", "eval_size=4", "eval_steps=1"]


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gkd")
    teacher = build_tiny_model(root / "teacher", hidden_size=96, intermediate_size=192, seed=5)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}:", "completion": f"number {i}"}) + "\n" for i in range(24)))
    return {"student": str(tiny_model), "teacher": str(teacher), "dataset": str(data)}


def metrics_of(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_local_run_with_top_k_and_sft_logs_every_metric(setup, tmp_path):
    config = load_config(GKDConfig, None, [
        f"model={setup['student']}", f"teacher_model={setup['teacher']}", f"dataset={setup['dataset']}",
        f"output_dir={tmp_path / 'run'}", "gkd_logits_topk=8", "sft_alpha=0.5", "lmbda=0.5", "max_steps=4",
        "max_completion_length=6", "per_device_train_batch_size=4", "eval_size=4", "eval_steps=2",
    ])
    GKDTrainer(config, load_plugins()).fit()
    rows = metrics_of(tmp_path / "run")
    assert [r["on_policy"] for r in rows] == [0.0, 1.0, 0.0, 1.0]  # lmbda 0.5 with seed 42: both kinds ran
    for r in rows:
        assert r["loss"] > 0 and r["jsd"] > 0 and r["time/teacher"] > 0 and r["grad_norm"] > 0
        if r["on_policy"]:  # the student's own completions: generated, no cross-entropy
            assert r["sft_loss"] is None and r["time/generate"] > 0
            assert r["loss"] == pytest.approx(r["jsd"], rel=1e-4)
        else:  # the dataset's completions: JSD plus 0.5 x cross-entropy
            assert r["loss"] == pytest.approx(r["jsd"] + 0.5 * r["sft_loss"], rel=1e-4)
    assert [r.get("time/sync", 0) > 0 for r in rows] == [False, True, False, True]  # before on-policy steps only
    assert rows[0]["eval/jsd_start"] > 0 and "eval/jsd" in rows[1] and "eval/jsd" in rows[3]
    assert rows[-1]["on_policy_fraction"] == 0.5


def test_the_first_sync_after_a_step_is_checked_too(setup, tmp_path, stale_weight_export):
    """As GRPO's: a train engine that keeps sending its first weights passes the run's first check and is stopped at
    the sync before step 2 (on-policy steps only, lmbda 1)."""
    from rlcore import RlcoreError

    config = load_config(GKDConfig, None, [
        f"model={setup['student']}", f"teacher_model={setup['teacher']}", f"dataset={setup['dataset']}",
        f"output_dir={tmp_path / 'run'}", "lmbda=1.0", "max_steps=2", "max_completion_length=4",
        "per_device_train_batch_size=2", "learning_rate=0.5", "eval_size=4"])
    with pytest.raises(RlcoreError, match="weight sync check failed"):
        GKDTrainer(config, load_plugins()).fit()


def test_resume_continues_the_data_position_and_the_on_policy_count(setup, tmp_path):
    keys = [f"model={setup['student']}", f"teacher_model={setup['teacher']}", f"dataset={setup['dataset']}",
            f"output_dir={tmp_path / 'run'}", "gkd_logits_topk=4", "max_completion_length=4", "per_device_train_batch_size=2"]
    first = GKDTrainer(load_config(GKDConfig, None, keys + ["max_steps=2"]), load_plugins())
    first.fit()
    position = first.data.sampler.state_dict()
    resumed = GKDTrainer(load_config(GKDConfig, None, keys + ["max_steps=3", "resume=auto"]), load_plugins())
    with resumed.session.start():  # the model and optimizer load into running roles
        resumed.restore()
    assert resumed.step == 2 and resumed.data.sampler.state_dict() == position
    assert resumed.on_policy_steps == sum(r["on_policy"] for r in metrics_of(tmp_path / "run"))


def test_the_embedded_demo_halves_the_held_out_jsd(tmp_path, capsys):
    """`rlcore run --plugin gkd`, shortened: a tiny student learns a different tiny teacher on the CPU; the held-out
    rows' prompts and completions are ones training never sees (measured: 0.648 -> 0.248)."""
    from rlcore.cli import main

    out = tmp_path / "demo"
    assert main(["run", "--plugin", "gkd", f"output_dir={out}", "max_steps=24", "eval_steps=24",
                 "per_device_train_batch_size=8", "max_completion_length=8"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    rows = metrics_of(out)
    start, end = rows[0]["eval/jsd_start"], rows[-1]["eval/jsd"]
    assert summary["algorithm"] == "gkd" and summary["step"] == 24
    assert end <= 0.5 * start, (start, end)
    assert 0 < sum(r["on_policy"] for r in rows) < 24  # lmbda 0.5: on-policy and dataset steps both ran


@pytest.mark.ray
@pytest.mark.parametrize("layout", ["colocated-full", "colocated-topk", "standalone", "shared"])
def test_the_examples_run_on_ray(ray_local, setup, tmp_path, layout):
    example = f"teacher_{layout.split('-')[0]}"
    workers = 2 if layout == "colocated-full" else 1  # data parallelism once; fewer actors to start on 2 cores
    keys = [f"model={setup['student']}", f"dataset={setup['dataset']}", f"output_dir={tmp_path / 'run'}", *QUICK]
    if layout == "shared":  # train, rollout and an HF teacher taking turns on one (fake) GPU
        keys += ["device_groups.nproc_per_node=1", "device_groups.shared_group.ranks=[0]", "gkd_logits_topk=8",
                 f"teacher.model={setup['teacher']}", "teacher.engine=hf", "teacher.dtype=float32",
                 "teacher.engine_kwargs={device: cpu}"]
    else:
        keys += [f"train.gpus={workers}", f"rollout.gpus={workers}"]
    if layout == "standalone":  # two HF teacher replicas on CPU workers; the 64 of the example scaled to 8
        keys += [f"teacher.model={setup['teacher']}", "teacher.engine=hf", "teacher.dtype=float32", "teacher.gpus=0",
                 "teacher.cpus=2", "gkd_logits_topk=8"]
    elif layout.startswith("colocated"):
        keys += [f"teacher_model={setup['teacher']}"] + (["gkd_logits_topk=8"] if layout == "colocated-topk" else [])
    config = load_config(GKDConfig, EXAMPLES / f"{example}.yaml", keys)
    trainer = GKDTrainer(config, load_plugins(), use_ray=True)
    assert trainer.session.colocated("train", "rollout")
    assert trainer.session.workers("train") == workers and trainer.session.workers("rollout") == workers
    trainer.fit()
    rows = metrics_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(r["on_policy"] == 1.0 for r in rows)  # lmbda 1
    assert all(r["jsd"] > 0 and r["grad_norm"] > 0 and r["time/generate"] > 0 and r["time/teacher"] > 0 for r in rows)
    assert rows[1]["time/sync"] > 0 and rows[-1]["eval/jsd"] > 0
    if layout == "standalone":
        assert trainer.session.workers("teacher") == 2
    if layout == "shared":
        assert trainer.session.colocated("teacher", "train") and trainer.session.colocated("teacher", "rollout")


def test_torch_compile_reaches_the_colocated_teacher_and_keeps_the_losses(setup, tmp_path, monkeypatch):
    """`train.engine_kwargs: {torch_compile: true}` from the command line's keys compiles the student's decoder
    layers and the colocated teacher's (the teacher takes the student's compile settings), and the run's losses
    equal the eager run's. aot_eager traces through dynamo and AOTAutograd as inductor does, without code
    generation (inductor ran on the H200: benchmarks/gkd_gpu.py's full-compile side)."""
    import torch._dynamo

    from rlcore.plugins.hf import train as hf_train

    compiled: list[tuple[int, str]] = []

    def spy(model, backend="inductor", mode=None):
        compiled.append((model.config.hidden_size, backend))
        return compile_layers(model, backend, mode)

    compile_layers = hf_train.compile_layers
    monkeypatch.setattr(hf_train, "compile_layers", spy)
    torch._dynamo.reset()
    keys = [f"model={setup['student']}", f"teacher_model={setup['teacher']}", f"dataset={setup['dataset']}",
            "lmbda=0", "max_steps=2", "max_completion_length=4", "per_device_train_batch_size=2", "eval_size=0"]
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["train.engine_kwargs={torch_compile: true, torch_compile_backend: aot_eager}"])):
        config = load_config(GKDConfig, None, [*keys, f"output_dir={tmp_path / name}", *extra])
        GKDTrainer(config, load_plugins()).fit()
        runs[name] = metrics_of(tmp_path / name)
    assert sorted(compiled) == [(64, "aot_eager"), (96, "aot_eager")]  # the student (hidden 64), the teacher (96)
    for eager, fast in zip(runs["eager"], runs["compiled"], strict=True):
        assert fast["jsd"] == pytest.approx(eager["jsd"], rel=1e-4) and fast["jsd"] > 0


def test_multi_turn_on_policy_steps_distil_only_the_students_own_turns(setup, tmp_path):
    """With an environment (a hint between turns), an on-policy step's episodes are distilled on the tokens the
    student generated: the hints are context, out of the JSD."""
    root = Path(__file__).resolve().parents[2]
    config = load_config(GKDConfig, None, [
        f"model={setup['student']}", f"teacher_model={setup['teacher']}", f"dataset={setup['dataset']}",
        f"output_dir={tmp_path / 'run'}", "lmbda=1", "max_steps=1", "per_device_train_batch_size=4", "max_turns=2",
        f"multi_turn_scheduler={root / 'examples/multi_turn/vowel_hint.py'}:VowelHint", "max_turn_length=4",
        "max_completion_length=60", "environment_kwargs={threshold: 2.0}",  # never met: every episode takes 2 turns
    ])
    trainer = GKDTrainer(config, load_plugins())
    batches = []
    make_batch = trainer.data.batch
    trainer.data.batch = lambda *args: batches.append(make_batch(*args)) or batches[-1]
    trainer.fit()
    row = metrics_of(tmp_path / "run")[0]
    assert row["episodes/turns"] == 2 and row["jsd"] > 0
    mask = batches[0]["completion_mask"]
    assert float(mask.sum()) == row["episodes/generated_tokens"] * 4 < row["completions/mean_length"] * 4
