"""GRPO with a teacher's KL (ms-swift's OPD-RL): the per-token advantage the experience maker builds, and a run
through the CLI whose student moves toward its teacher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore import load_plugins
from rlcore.config import gpu_count
from rlcore.plugins.grpo.config import GRPOConfig
from rlcore.plugins.grpo.experience import ExperienceMaker
from rlcore.plugins.grpo.trainer import GRPOTrainer
from rlcore.testing import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
QUICK = {"learning_rate": 1e-3, "max_completion_length": 8, "per_device_train_batch_size": 8, "num_generations": 2,
         "max_steps": 1}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny model of the student's shape and tokenizer, other weights."""
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "teacher", seed=7))


def first_round(tmp_path, student, **overrides):
    """One step's run; the round's sequence advantages and the batch the loss got."""
    seen = {}
    original = ExperienceMaker.logprobs

    def logprobs(self, scored, *args):
        seen["sequence"] = scored.advantages.clone()
        seen["batch"] = original(self, scored, *args)
        return seen["batch"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ExperienceMaker, "logprobs", logprobs)
        run(tmp_path, student, **overrides)
    return seen["sequence"], seen["batch"]


def run(tmp_path, student, **overrides):
    config = GRPOConfig(**{**QUICK, "model": student, "output_dir": str(tmp_path / "run"), **overrides})
    trainer = GRPOTrainer(config, load_plugins())
    # the teacher is inside the train workers, unless it has devices of its own
    apart = gpu_count(trainer.config.teacher.gpus)  # an unresolved `auto` (no GPU here) asks none
    assert trainer.session.roles == ["train", "rollout"] + (["teacher"] if apart else [])
    trainer.fit()


def logprobs_of(model_path, input_ids, attention_mask):
    """Column t = log p(input_ids[t] | input_ids[:t]), written from transformers directly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(len(input_ids), 1), picked], dim=1)


def test_a_teacher_equal_to_the_policy_leaves_the_advantages_as_they_are(tmp_path, tiny_model):
    """At the first step the old policy is the policy: a teacher with its weights adds 0 to every token."""
    sequence, batch = first_round(tmp_path, str(tiny_model), teacher_model=str(tiny_model))
    assert batch["advantages"].shape == batch["completion_mask"].shape
    assert sequence.abs().sum() > 0  # the toy reward's group advantages: something to keep
    torch.testing.assert_close(batch["advantages"], sequence[:, None].expand_as(batch["advantages"]), atol=1e-5, rtol=0)


CPU = {"gpus": 1, "engine_kwargs": {"device": "cpu"}}  # a role with a device of its own, the CPU here


@pytest.fixture(scope="module")
def hf_round(tmp_path_factory, tiny_model, teacher):
    """The first round with a different teacher inside the hf train workers, teacher_kl_coef 0.7."""
    return first_round(tmp_path_factory.mktemp("hf"), str(tiny_model), teacher_model=teacher, teacher_kl_coef=0.7,
                       train=CPU, rollout=CPU)


def test_a_different_teacher_adds_its_log_ratio_on_the_generated_tokens(hf_round, tiny_model, teacher):
    """advantage[i, t] = advantage[i] + teacher_kl_coef * (teacher - old policy log-prob of the sampled token), on the
    completion's tokens; the log-probs computed here from transformers, the old policy the untrained student."""
    sequence, batch = hf_round
    ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    ratio = logprobs_of(teacher, ids, attention) - logprobs_of(str(tiny_model), ids, attention)
    want = sequence[:, None] + 0.7 * ratio * mask
    torch.testing.assert_close(batch["advantages"], want, atol=1e-4, rtol=0)
    assert (batch["advantages"] - sequence[:, None]).abs().max() > 1e-3  # the teacher's term is not 0 here
    assert torch.all(batch["advantages"][mask == 0] == sequence[:, None].expand_as(mask)[mask == 0])


def test_on_the_megatron_train_engine_the_teacher_inside_its_workers_gives_the_same_advantages(
        tmp_path, hf_round, tiny_model, teacher):
    """The teacher inside the megatron train workers is a megatron forward engine: the same rollouts (hf, same seed)
    get the per-token advantages the hf engines give, to float32 tolerance."""
    _, hf = hf_round
    _, megatron = first_round(tmp_path, str(tiny_model), teacher_model=teacher, teacher_kl_coef=0.7,
                              train={**CPU, "engine": "megatron"}, rollout=CPU)
    assert torch.equal(hf["input_ids"], megatron["input_ids"])
    torch.testing.assert_close(megatron["advantages"], hf["advantages"], atol=1e-4, rtol=0)


def test_a_teacher_group_of_its_own_gives_the_same_advantages(tmp_path, hf_round, tiny_model, teacher):
    """teacher.gpus makes the teacher a group of its own (a forward engine, as the reference); the same rollouts get
    the advantages the teacher inside the train workers gives. On the CPU here: each role's device is the CPU."""
    _, inside = hf_round
    _, own = first_round(tmp_path, str(tiny_model), teacher_kl_coef=0.7, train=CPU, rollout=CPU,
                         teacher={"model": teacher, **CPU})
    assert torch.equal(inside["input_ids"], own["input_ids"])
    torch.testing.assert_close(own["advantages"], inside["advantages"], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def peaky(tmp_path_factory, tiny_model):
    """The tiny model with its head (untied) three times as sharp: a student whose teacher, the tiny model, is flatter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone() * 3)
    path = tmp_path_factory.mktemp("models") / "peaky"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return str(path)


def on_policy_kl(student, teacher):
    """KL(student || teacher) over the whole vocabulary, a token mean over completions the student samples (seeded)
    for the toy prompts: the reverse KL that the teacher's term in the advantage lowers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.testing import PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(student)
    s, t = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in (student, teacher))
    torch.manual_seed(0)
    total, tokens = 0.0, 0
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            seqs = s.generate(ids, do_sample=True, max_new_tokens=12, num_return_sequences=8, pad_token_id=0)
            ls, lt = (torch.log_softmax(m(seqs).logits[:, ids.shape[1] - 1 : -1].float(), -1) for m in (s, t))
        total += float((ls.exp() * (ls - lt)).sum(-1).sum())
        tokens += ls.shape[0] * ls.shape[1]
    return total / tokens


def test_a_cli_run_moves_the_student_toward_its_teacher(tmp_path, tiny_model, peaky):
    """Two steps through `rlcore run` in ms-swift's OPD shape (one generation per prompt: the rewards' advantages are
    0 and the teacher's term is the only signal) halve the student's reverse KL to the teacher. With teacher_kl_coef 0
    the same run's advantages are all 0 (test_teacher_advantages_add_the_teachers_log_ratio_per_generated_token and
    test_one_generation_per_prompt_has_zero_advantages): the student stays where it started, the baseline here."""
    start, out = on_policy_kl(peaky, str(tiny_model)), tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", f"model={peaky}", f"teacher.model={tiny_model}",
         "teacher_kl_coef=2.0", "num_generations=1", "max_steps=2", "per_device_train_batch_size=16",
         "max_completion_length=12", "learning_rate=1e-3", f"output_dir={out}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained anything" not in done.stderr  # the teacher's term trained: no warning that nothing did
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["teacher_kl"] > 0.05
    assert rows[1]["teacher_kl"] < rows[0]["teacher_kl"]
    assert on_policy_kl(str(out / "final"), str(tiny_model)) < 0.7 * start
