"""A served teacher's top-k lines up with the student's logits: proven with a teacher of known logits.

The teacher is a tiny model whose attention and MLP outputs are zeroed, so its residual stream is the input
token's embedding and, with tied embeddings and a sharpened final norm, the distribution it gives after
token x puts almost all mass on x itself. So row j of its top-k (the distribution of token j) must have
token j - 1 first; an off-by-one anywhere shows as a wrong id and a large JSD.
"""

from __future__ import annotations

import pytest
import torch

from rlcore import Batch, RoleSession, RoleSetup, TopK, load_plugins, plan_from_config
from rlcore.batch import pad_tokens
from rlcore.plugins.gkd.objective import DistillObjective
from rlcore.plugins.gkd.workers import TeacherWorker
from rlcore.plugins.hf.common import model_outputs
from rlcore.testing import build_tiny_model

SEQUENCES = [[10, 200, 33, 4, 150, 77], [5, 6], [260, 1, 99, 42]]


@pytest.fixture(scope="module")
def echo_model(tmp_path_factory):
    """A model whose next-token distribution after x is (nearly) a point mass on x."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(tmp_path_factory.mktemp("echo") / "base", seed=11)
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.mul_(20.0)
    path = base.parent / "echo"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return str(path)


def check_alignment(top: TopK) -> None:
    assert top.ids.shape == (len(SEQUENCES), max(map(len, SEQUENCES)), 4)
    for i, seq in enumerate(SEQUENCES):
        assert top.ids[i, 1 : len(seq), 0].tolist() == seq[:-1]  # row j: token j given :j, so after token j - 1
        assert torch.all(top.logprobs[i, 1 : len(seq), 0] > -0.05)  # a near point mass
        assert not top.ids[i, 0].any() and not top.logprobs[i, 0].any()  # row 0: no distribution
        assert not top.ids[i, len(seq) :].any() and not top.logprobs[i, len(seq) :].any()  # padding


def teacher_session(echo_model, use_ray, replicas=1):
    config = {"teacher": {"cpus": replicas}}
    plan = plan_from_config(config, roles=["teacher"], plugins=load_plugins())
    setup = RoleSetup(TeacherWorker, "hf", {"model": echo_model, "device": "cpu"}, kind="teacher")
    return RoleSession(plan, {"teacher": setup}, use_ray=use_ray, plugins=load_plugins())


def test_the_served_top_k_is_aligned_and_the_loss_sees_it_aligned(echo_model):
    session = teacher_session(echo_model, use_ray=False)
    with session.start():
        top = session["teacher"].topk(SEQUENCES, 4)
    check_alignment(top)

    # The student is the same model: aligned, its JSD to the teacher's top-k is ~0; shifted by one, it is large.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(echo_model)
    input_ids, attention = pad_tokens(SEQUENCES, 0)
    mask = attention.float()
    mask[:, 0] = 0
    batch = Batch(input_ids=input_ids, attention_mask=attention, completion_mask=mask,
                  teacher_ids=top.ids, teacher_logprobs=top.logprobs)
    objective = DistillObjective(beta=0.5, temperature=1.0, topk=4)
    with torch.no_grad():
        outputs = model_outputs(model, input_ids, attention)
        aligned, tokens = objective.divergence(outputs, batch, None)
        shifted = Batch({**batch, "teacher_ids": torch.roll(top.ids, 1, dims=1), "teacher_logprobs": torch.roll(top.logprobs, 1, dims=1)})
        off_by_one, _ = objective.divergence(outputs, shifted, None)
    assert tokens == sum(len(s) - 1 for s in SEQUENCES)
    assert float(aligned) / float(tokens) < 1e-4
    assert float(off_by_one) / float(tokens) > 0.1


@pytest.mark.ray
def test_requests_are_split_across_teacher_replicas_on_ray(ray_local, echo_model):
    session = teacher_session(echo_model, use_ray=True, replicas=2)
    with session.start():
        assert session.workers("teacher") == 2
        top = session["teacher"].topk(SEQUENCES, 4)  # rows 0-1 on one replica, row 2 on the other, re-padded
    check_alignment(top)
