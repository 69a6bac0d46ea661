"""GKD on the GPU: vLLM rollout with a colocated, offloaded teacher (full vocabulary); a served vLLM teacher group
with top-k on Ray; and the alignment of vLLM's prompt log-probs with the student's logits (an echo teacher of
known logits). Each test starts vLLM engines of its own: run each in its own pytest process, e.g.
`python3 -m pytest -m gpu tests/gpu/test_gkd_gpu.py -k colocated` (the Ray test needs two GPUs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SEQUENCES = [[10, 200, 33, 4, 150, 77], [5, 6], [260, 1, 99, 42]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    root = tmp_path_factory.mktemp("gkd-gpu")
    shape = dict(num_heads=4, num_kv_heads=2, dtype="bfloat16")
    student = build_tiny_model(root / "student", hidden_size=256, intermediate_size=512, **shape)
    teacher = build_tiny_model(root / "teacher", hidden_size=384, intermediate_size=768, seed=3, **shape)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}:", "completion": f"number {i}"}) + "\n" for i in range(64)))
    return {"student": str(student), "teacher": str(teacher), "dataset": str(data)}


def run(models, tmp_path, use_ray=False, **overrides):
    from rlcore import config_model, load_plugins
    from rlcore.plugins.gkd.config import GKDConfig
    from rlcore.plugins.gkd.trainer import GKDTrainer

    GKDConfig = config_model(GKDConfig)  # with the engines' keys (vllm_*)

    vllm = {"gpus": 1, "engine": "vllm", "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.2,
            "vllm_enforce_eager": True, "vllm_max_model_len": 256}
    config = GKDConfig(
        model=models["student"], dataset=models["dataset"], output_dir=str(tmp_path / "run"), max_steps=3,
        lmbda=1.0, learning_rate=1e-3, per_device_train_batch_size=8, max_completion_length=32, eval_size=8,
        eval_steps=1, train={"gpus": 1, "dtype": "bfloat16"}, rollout=vllm, colocate_groups=[["train", "rollout"]],
        **{k: ({**vllm, **v} if k == "teacher" else v) for k, v in overrides.items()},
    )
    trainer = GKDTrainer(config, load_plugins(), use_ray=use_ray)
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return trainer, rows


def test_colocated_vllm_rollout_with_an_offloaded_teacher_full_vocabulary(models, tmp_path):
    trainer, rows = run(models, tmp_path, teacher_model=models["teacher"], offload_teacher_model=True,
                        offload_model=True, offload_optimizer=True, sleep_level=1)
    assert trainer.session.colocated("train", "rollout") and trainer.session.roles == ["train", "rollout"]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["on_policy"] == 1.0 for r in rows)
    assert all(r["jsd"] > 0 and r["grad_norm"] > 0 and r["time/generate"] > 0 and r["time/teacher"] > 0 for r in rows)
    assert all(r["time/sync"] > 0 for r in rows[1:]) and rows[-1]["completions/mean_length"] > 0
    assert rows[-1]["eval/jsd"] < rows[0]["eval/jsd_start"]


def test_a_separate_vllm_teacher_group_serves_top_k_on_ray(models, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (train and a teacher group); this machine has {torch.cuda.device_count()}")
    # k = 32 is above vLLM's default max_logprobs (20): the trainer must raise it for the teacher engine
    trainer, rows = run(models, tmp_path, use_ray=True, gkd_logits_topk=32,
                        teacher={"model": models["teacher"], "vllm_gpu_memory_utilization": 0.3})
    assert trainer.session.workers("teacher") == 1 and not trainer.session.colocated("train", "teacher")
    assert trainer.session.setups["teacher"].options["vllm_engine_kwargs"]["max_logprobs"] == 32
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["jsd"] > 0 and r["time/teacher"] > 0 and r["time/generate"] > 0 for r in rows)


def test_vllm_prompt_top_k_is_aligned_with_the_student(tmp_path):
    """The echo teacher (zeroed attention and MLP outputs, sharpened norm) puts its mass after token x on x, so row
    j of vLLM's prompt top-k must have token j - 1 first, and agree with the HF model's own log-probs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore import Batch
    from rlcore.batch import pad_tokens
    from rlcore.plugins.gkd.objective import DistillObjective
    from rlcore.plugins.hf.common import model_outputs
    from rlcore.testing import build_tiny_model
    from rlcore.plugins.vllm.engine import VLLMRolloutEngine

    # the GRPO GPU tests' shape: vLLM 0.26's warm-up hit an illegal memory access on the default tiny model
    # (hidden 64, head_dim 16)
    base = build_tiny_model(tmp_path / "base", hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, seed=11)
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.mul_(20.0)
    model.save_pretrained(tmp_path / "echo")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "echo")

    engine = VLLMRolloutEngine(str(tmp_path / "echo"), vllm_gpu_memory_utilization=0.2, vllm_enforce_eager=True,
                               vllm_max_model_len=64, dtype="float32", vllm_engine_kwargs={"max_logprobs": 4})
    top = engine.prompt_topk_logprobs(SEQUENCES, 4)
    for i, seq in enumerate(SEQUENCES):
        assert top.ids[i, 1 : len(seq), 0].tolist() == seq[:-1]
        assert not top.ids[i, 0].any() and not top.ids[i, len(seq) :].any()

    input_ids, attention = pad_tokens(SEQUENCES, 0)
    mask = attention.float()
    mask[:, 0] = 0
    batch = Batch(input_ids=input_ids, attention_mask=attention, completion_mask=mask,
                  teacher_ids=top.ids, teacher_logprobs=top.logprobs)
    with torch.no_grad():
        outputs = model_outputs(model, input_ids, attention)
        hf = outputs.logprobs_at(top.ids)
        total, tokens = DistillObjective(beta=0.5, temperature=1.0, topk=4).divergence(outputs, batch, None)
    valid = mask.bool()
    torch.testing.assert_close(top.logprobs[valid], hf[valid], atol=2e-3, rtol=0)  # raw log-probs, not processed
    assert float(total) / float(tokens) < 1e-3


@pytest.mark.parametrize("topk", [None, 8])
def test_a_train_step_waits_for_the_gpu_only_where_transformers_does(models, topk):
    """A colocated teacher's GKD step over 4 micro-batches: the micro-batches' copies, the rows the loss reads and
    its metrics never drain the GPU's queue (each would leave the GPU idle while Python queues the next kernels).
    What still waits: the step's end (gradient norm, metrics), and transformers' check for an all-ones attention
    mask where the model is given one (the hf engine gives right-padded rows none since `aba38d8`). With $OUT set
    the counts go to $OUT/gkd_waits-topk-<k>.json."""
    import functools
    import warnings

    import torch

    from rlcore import Batch, OptimizerOptions
    from rlcore.batch import pad_tokens
    from rlcore.plugins.gkd.objective import DistillObjective
    from rlcore.plugins.gkd.workers import teacher_answer
    from rlcore.plugins.hf.train import HFTrainEngine

    student = HFTrainEngine(models["student"], dtype="bfloat16", device="cuda", optimizer=OptimizerOptions(learning_rate=1e-4))
    teacher = HFTrainEngine(models["teacher"], dtype="bfloat16", device="cuda", forward_only=True)
    rows = [list(range(5 + i % 3, 40 + 3 * i)) for i in range(16)]  # lengths differ: padding in every micro-batch
    ids, mask = pad_tokens(rows, pad_id=0)
    completion = mask.clone()
    completion[:, :5] = 0
    batch = Batch(input_ids=ids, attention_mask=mask, completion_mask=completion)
    objective = DistillObjective(beta=0.5, temperature=1.0, topk=topk, num_items_in_batch=float(completion.sum()))
    loss_fn = functools.partial(objective, teacher=lambda micro, k, t: teacher_answer(teacher, micro, k, t))
    student.train_step(batch, loss_fn, micro_batch_size=4)  # the first step allocates and warms up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = student.train_step(batch, loss_fn, micro_batch_size=4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    waits = [f"{w.filename}:{w.lineno}" for w in seen if "synchronizing" in str(w.message)]
    ours = [w for w in waits if "transformers" not in w]
    assert out["jsd"] > 0 and out["grad_norm"] > 0
    # the step's end only: the gradient norm, the loss and the metrics, each read once by the engine (4 micro-batches
    # each waiting at its copy, its rows, its teacher's rows and its metrics were some 30 waits)
    assert len(ours) <= 4, f"{len(ours)} waits outside transformers: {ours}"
    print(f"waits: {len(waits)} in all, {len(ours)} rlcore's: {sorted(set(waits))}")
    if os.environ.get("OUT"):  # the GPU machine's folder that comes back: the counts without `pytest -s`
        path = Path(os.environ["OUT"]) / f"gkd_waits-topk-{topk}.json"
        path.write_text(json.dumps({"topk": topk, "waits": len(waits), "rlcore": len(ours), "where": sorted(set(waits))}))
