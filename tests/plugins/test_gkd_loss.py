"""The GKD loss against TRL's installed `GKDTrainer.generalized_jsd_loss`, its top-k variant, the projected
(hidden states + LM heads in chunks) form against both, and its memory shape."""

from __future__ import annotations

import pytest
import torch

from rlcore import RlcoreError
from rlcore.plugins.gkd.loss import jsd_loss, jsd_sum, projected_jsd_sum, topk_jsd_loss

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


def projected_inputs(seed=0, rows=29, vocab=V):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, 12, generator=g), torch.randn(vocab, 12, generator=g) * 0.6, torch.randn(vocab, generator=g)
    teacher = torch.randn(rows, 20, generator=g), torch.randn(vocab, 20, generator=g) * 0.6, None
    return student, teacher


@pytest.mark.parametrize("use_trl", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_projected_loss_equals_trl_on_the_logits_its_heads_give(beta, use_trl):
    (hs, ws, bs), (ht, wt, _) = projected_inputs()
    mine = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    theirs = [t.clone().requires_grad_() for t in (hs, ws, bs)]
    total = projected_jsd_sum(*mine, ht, wt, None, beta=beta, temperature=0.7, chunk_tokens=8, use_trl=use_trl)
    student_logits = (theirs[0] @ theirs[1].T + theirs[2])[None]  # one row of 29 tokens, every token scored
    teacher_logits = (ht @ wt.T)[None]
    labels = torch.ones(1, hs.shape[0], dtype=torch.long)
    expected = trl_loss()(student_logits, teacher_logits, labels=labels, beta=beta, temperature=0.7)
    assert (total / hs.shape[0]).item() == pytest.approx(expected.item(), rel=1e-5)
    assert expected.item() > 0.05
    (total / hs.shape[0]).backward()
    expected.backward()
    for a, b in zip(mine, theirs):  # hidden states, head weight and bias
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("use_trl", [False, True])
def test_the_projected_loss_holds_no_tensor_of_every_row_times_the_vocabulary(use_trl):
    from test_hf_head import LargestTensor

    vocab = 40_000 if use_trl else V  # TRL's tiles are [rows, 32768] at most
    (hs, ws, bs), (ht, wt, _) = projected_inputs(1, rows=64, vocab=vocab)
    hs, ws = hs.requires_grad_(), ws.requires_grad_()
    with LargestTensor() as seen:
        projected_jsd_sum(hs, ws, None, ht, wt, None, chunk_tokens=16, use_trl=use_trl).backward()
    assert seen.most < 64 * vocab * 4  # bytes of a float32 [rows, V]
    with LargestTensor() as plain:  # the check can fail: the logits path builds such tensors
        jsd_sum((hs @ ws.T)[None], (ht @ wt.T)[None], torch.ones(1, 64, dtype=torch.bool)).backward()
    assert plain.most >= 64 * vocab * 4


@pytest.mark.parametrize("topk", [None, 4])
def test_a_colocated_teachers_step_is_the_same_through_projections_as_through_log_probs(tiny_model, tmp_path, topk):
    import functools

    from rlcore import Batch
    from rlcore.plugins.gkd.objective import DistillObjective
    from rlcore.plugins.gkd.workers import teacher_answer
    from rlcore.plugins.hf.train import HFTrainEngine
    from rlcore.testing import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", hidden_size=96, intermediate_size=192, seed=5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (3, 12), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0
    completion = torch.zeros_like(ids)
    completion[:, 5:] = 1
    batch = Batch(input_ids=ids, attention_mask=attention, completion_mask=completion * attention)
    objective = DistillObjective(beta=0.5, temperature=0.9, topk=topk, num_items_in_batch=float(completion.sum()))
    steps, answers = {}, {}
    for chunked in (True, False):
        student = HFTrainEngine(str(tiny_model), chunked_lm_head=chunked, learning_rate=1e-3, max_grad_norm=0.0)
        forward = HFTrainEngine(str(teacher), chunked_lm_head=chunked, forward_only=True)

        def answer(micro, k, temperature, forward=forward):
            answers.setdefault(chunked, type(teacher_answer(forward, micro, k, temperature)).__name__)
            return teacher_answer(forward, micro, k, temperature)

        steps[chunked] = student.train_step(batch, functools.partial(objective, teacher=answer), 2, temperature=0.9)
    assert answers == ({True: "Projection", False: "Tensor"} if topk is None else {True: "TopK", False: "TopK"})
    for key in ("loss", "jsd", "grad_norm"):
        assert steps[True][key] == pytest.approx(steps[False][key], rel=1e-5)
    assert steps[True]["jsd"] > 0


@pytest.mark.parametrize("topk", [None, 4])
def test_a_teacher_answering_several_micro_batches_a_forward_gives_the_same_step(tiny_model, tmp_path, topk):
    """`TeacherAnswers`: groups of 3 micro-batches (2 forwards for 5 micro-batches of rows of different lengths)
    give the step that one forward per micro-batch gives."""
    import functools

    from rlcore import Batch
    from rlcore.plugins.gkd.objective import DistillObjective
    from rlcore.plugins.gkd.workers import ROW, TeacherAnswers, teacher_answer
    from rlcore.plugins.hf.train import HFTrainEngine
    from rlcore.testing import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", hidden_size=96, intermediate_size=192, seed=5)
    ids = torch.randint(0, 200, (10, 14), generator=torch.Generator().manual_seed(1))
    attention = (torch.arange(14) < torch.tensor([14, 9, 12, 7, 14, 10, 8, 13, 11, 6])[:, None]).long()
    completion = torch.zeros_like(ids)
    completion[:, 4:] = 1
    batch = Batch(input_ids=ids, attention_mask=attention, completion_mask=completion * attention)
    objective = DistillObjective(beta=0.5, temperature=0.9, topk=topk, num_items_in_batch=float((completion * attention).sum()))
    steps, forwards = {}, {}
    for group in (1, 3):
        student = HFTrainEngine(str(tiny_model), learning_rate=1e-3, max_grad_norm=0.0)
        engine = HFTrainEngine(str(teacher), forward_only=True)
        calls = []

        def forward(micro, k, temperature, engine=engine, calls=calls):
            calls.append(len(micro))
            return teacher_answer(engine, micro, k, temperature)

        answers = TeacherAnswers(forward, batch, rows=2 * group, device="cpu")
        numbered = Batch({**batch, ROW: torch.arange(len(batch))})
        steps[group] = student.train_step(numbered, functools.partial(objective, teacher=answers), 2, temperature=0.9)
        forwards[group] = calls
    assert forwards == {1: [2, 2, 2, 2, 2], 3: [6, 4]}
    for key in ("loss", "jsd", "grad_norm"):
        assert steps[3][key] == pytest.approx(steps[1][key], rel=1e-5)
    assert steps[3]["jsd"] > 0


def test_a_full_vocabulary_step_with_a_colocated_teacher_holds_no_tensor_of_b_t_v(tiny_model, tmp_path, monkeypatch):
    """On the CPU: the torch chunks (TRL's kernels, the default on CUDA, allocate [rows, 32768] tiles whatever the
    vocabulary, more than B x T x V of this tiny model's; their own tests above use a wider vocabulary)."""
    import functools

    from rlcore.plugins.gkd import loss

    from test_hf_head import LargestTensor

    from rlcore import Batch
    from rlcore.plugins.gkd.objective import DistillObjective
    from rlcore.plugins.gkd.workers import teacher_answer
    from rlcore.plugins.hf.train import HFTrainEngine
    from rlcore.testing import build_tiny_model

    monkeypatch.setattr(loss, "CHUNK_TOKENS", 32)  # chunks of 32 of the 128 completion tokens (default: 1024)
    teacher = build_tiny_model(tmp_path / "teacher", hidden_size=96, intermediate_size=192, seed=5)
    rows, width = 4, 64
    ids = torch.randint(0, 200, (rows, width), generator=torch.Generator().manual_seed(0))
    completion = torch.zeros_like(ids)
    completion[:, width // 2:] = 1
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=completion)
    objective = DistillObjective(beta=0.5, temperature=1.0, topk=None, num_items_in_batch=float(completion.sum()))
    most = {}
    for chunked in (True, False):
        student = HFTrainEngine(str(tiny_model), chunked_lm_head=chunked, learning_rate=1e-3)
        forward = HFTrainEngine(str(teacher), chunked_lm_head=chunked, forward_only=True)
        vocab = student.model.get_output_embeddings().weight.shape[0]
        loss_fn = functools.partial(objective, teacher=lambda m, k, t, f=forward: teacher_answer(f, m, k, t))
        with LargestTensor() as seen:
            student.train_step(batch, loss_fn, micro_batch_size=rows)
        most[chunked] = seen.most
    assert most[True] < rows * width * vocab * 4 <= most[False]  # float32 [B, T, V]: the logits path has one
