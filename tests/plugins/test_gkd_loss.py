"""The GKD loss against TRL's installed `GKDTrainer.generalized_jsd_loss`, its top-k variant, and its memory shape."""

from __future__ import annotations

import pytest
import torch

from rlcore import RlcoreError
from rlcore.plugins.gkd.loss import jsd_loss, jsd_sum, topk_jsd_loss

B, T, V = 3, 7, 50


def inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=g, dtype=dtype) * 2
    teacher = torch.randn(B, T, V, generator=g, dtype=dtype) * 3
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # a row with no completion token
    return student, teacher, mask


def trl_loss():
    from trl.experimental.gkd import GKDTrainer  # where TRL 1.16 ships it

    return GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_full_vocabulary_equals_trl(beta, temperature):
    student, teacher, mask = inputs()
    labels = torch.where(mask, 1, -100)
    expected = trl_loss()(student, teacher, labels=labels, beta=beta, temperature=temperature)
    got = jsd_loss(student, teacher, mask, beta=beta, temperature=temperature)
    assert got.item() == pytest.approx(expected.item(), abs=1e-6)
    assert got.item() > 0.05  # the inputs differ: a loss of 0 would pass nothing


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gradients_equal_trl_through_the_chunks(beta):
    student, teacher, mask = inputs(1)
    mine, theirs = student.clone().requires_grad_(), student.clone().requires_grad_()
    total = jsd_sum(mine, teacher, mask, beta=beta, temperature=0.7, chunk_tokens=4)  # several chunks, recomputed
    (total / mask.sum()).backward()
    trl_loss()(theirs, teacher, labels=torch.where(mask, 1, -100), beta=beta, temperature=0.7).backward()
    torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_of_the_whole_vocabulary_is_the_full_loss(beta):
    student, teacher, mask = inputs(2)
    mask[:, 0] = False  # row 0 of a TopK holds no distribution
    logprobs = torch.log_softmax(teacher, dim=-1)
    top = logprobs.topk(V, dim=-1)
    full = jsd_loss(student, teacher, mask, beta=beta, temperature=0.7)
    k = topk_jsd_loss(student, top.indices, top.values, mask, beta=beta, temperature=0.7)
    assert k.item() == pytest.approx(full.item(), abs=1e-6)


def test_top_k_renormalises_over_k_and_leaves_out_rows_without_a_teacher():
    student, teacher, mask = inputs(3)
    top = torch.log_softmax(teacher, dim=-1).topk(5, dim=-1)
    ids, values = top.indices.clone(), top.values.clone()
    # by hand: both sides renormalised over the 5 ids, forward KL (beta 0)
    s = torch.log_softmax(student.gather(-1, ids), dim=-1)
    t = torch.log_softmax(values, dim=-1)
    per_token = (t.exp() * (t - s)).sum(-1)
    expected = (per_token * mask).sum() / mask.sum()
    assert topk_jsd_loss(student, ids, values, mask, beta=0.0).item() == pytest.approx(expected.item(), abs=1e-6)
    ids[1, 2], values[1, 2] = 0, 0.0  # the teacher gave nothing here: left out, even under the mask
    mask[1, 2] = True
    kept = mask.clone()
    kept[1, 2] = False
    expected = (per_token * kept).sum() / kept.sum()
    assert topk_jsd_loss(student, ids, values, mask, beta=0.0).item() == pytest.approx(expected.item(), abs=1e-6)


def test_bad_arguments_are_named():
    student, teacher, mask = inputs()
    with pytest.raises(RlcoreError, match="beta=1.5 must be in"):
        jsd_loss(student, teacher, mask, beta=1.5)
    with pytest.raises(RlcoreError, match="must be \\[B, T, V\\]"):
        jsd_loss(student, teacher[..., :10], mask)
