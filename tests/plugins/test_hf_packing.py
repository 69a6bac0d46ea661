"""Padding-free packing and token-budget micro-batches in the hf train engine: packed rows give the padded rows'
log-probs, no token attends across sequences, and GRPO's and GKD's steps (loss, gradients) equal the padded ones."""

from __future__ import annotations

import functools

import pytest
import torch

from rlcore import Batch, ConfigError
from rlcore.plugins.hf.train import HFTrainEngine, split_to, token_micro_batches

LINEAR_ADAM = dict(learning_rate=1e3, adam_epsilon=1e3, max_grad_norm=0)  # parameter deltas compare gradients


def mixed_batch(lengths=(14, 3, 9, 14, 5, 11, 2, 7), width: int = 14, seed: int = 0) -> Batch:
    """Right-padded rows of long-tailed lengths; the completion starts at token 2."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(0, 256, (rows, width), generator=g).masked_fill(mask == 0, 265)
    completion = mask.clone()
    completion[:, :2] = 0
    return Batch(input_ids=ids, attention_mask=mask, completion_mask=completion,
                 advantages=torch.randn(rows, generator=g))


def decoder_inputs(engine: HFTrainEngine) -> list[tuple]:
    """(input_ids shape, position_ids, attention_mask) of each decoder call."""
    seen: list[tuple] = []
    engine.model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("position_ids"),
                                                  kwargs.get("attention_mask"))), with_kwargs=True)
    return seen


def params(engine: HFTrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("chunked, attention", [(True, None), (False, None), (True, "eager")])
def test_packed_rows_give_the_padded_log_probs_and_attend_within_their_own_sequence(tiny_model, chunked, attention):
    batch = mixed_batch()
    keys = dict(chunked_lm_head=chunked, attn_implementation=attention, forward_only=True)
    padded = HFTrainEngine(tiny_model, padding_free=False, **keys)
    packed = HFTrainEngine(tiny_model, **keys)
    assert packed.model.config._attn_implementation == (attention or "sdpa")
    seen = decoder_inputs(packed)
    want, got = padded.forward_logprobs(batch), packed.forward_logprobs(batch)
    real = int(batch["attention_mask"].sum())
    assert len(seen) == 1 and seen[0][0] == (1, real) and seen[0][2] is None  # one row of the real tokens only
    assert seen[0][1][0, :16].tolist() == list(range(14)) + [0, 1]  # each sequence's own positions
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    top_want, top_got = padded.forward_topk(batch, 3), packed.forward_topk(batch, 3)
    torch.testing.assert_close(top_got.logprobs, top_want.logprobs, atol=2e-6, rtol=1e-5)

    # another first sequence leaves every other sequence's log-probs as they were: no attention across them
    changed = Batch(dict(batch))
    changed["input_ids"] = batch["input_ids"].clone()
    changed["input_ids"][0, :14] = torch.arange(14) + 40
    again = packed.forward_logprobs(changed)
    assert not torch.allclose(again[0], got[0])
    assert torch.equal(again[1:], got[1:])


def test_token_budget_micro_batches_are_runs_of_rows_within_the_budget():
    assert token_micro_batches([14, 3, 9, 14, 5, 11, 2, 7], 28) == [3, 2, 3]  # 26, 19, 20 tokens
    assert token_micro_batches([30, 2, 2], 10) == [1, 2]  # a row over the budget is a micro-batch of its own
    assert token_micro_batches([], 10) == []
    assert split_to([3, 1], [14, 3, 9, 14], 4) == [1, 1, 1, 1]
    assert split_to([4], [5, 5, 5, 5], 3) == [1, 1, 2]


@pytest.mark.parametrize("budget", [None, 20])
def test_a_token_budget_step_equals_the_padded_fixed_count_step(tiny_model, budget):
    """The same optimizer step (weights after it) whatever the split: the loss's normalisers are the step's."""
    batch = mixed_batch()
    batch["weight"] = torch.full((len(batch),), 1.0 / len(batch))

    def loss_fn(outputs, micro, sizes):
        sizes.append((len(micro), int(micro["attention_mask"].sum())))
        per_row = -(outputs.logprobs() * micro["completion_mask"]).sum(dim=1)
        return (per_row * micro["weight"]).sum(), {}

    deltas, sizes = {}, {}
    for name, keys in {"padded": dict(padding_free=False), "tokens": dict(max_tokens_per_micro_batch=budget)}.items():
        engine = HFTrainEngine(tiny_model, **keys, **LINEAR_ADAM)
        before = params(engine)
        sizes[name] = []
        engine.train_step(batch, functools.partial(loss_fn, sizes=sizes[name]), micro_batch_size=2)
        deltas[name] = {n: p - before[n] for n, p in params(engine).items()}
    assert [rows for rows, _ in sizes["padded"]] == [2, 2, 2, 2]
    if budget is None:  # 2 rows x the longest (14): 28 tokens a micro-batch, not 2 rows
        assert sizes["tokens"] == [(3, 26), (2, 19), (3, 20)]
    else:
        assert all(tokens <= budget for _, tokens in sizes["tokens"]) and sum(r for r, _ in sizes["tokens"]) == 8
    for n, delta in deltas["padded"].items():
        torch.testing.assert_close(deltas["tokens"][n], delta, atol=1e-6, rtol=1e-4)


def test_the_packing_options_are_checked(tiny_model):
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=0 must be a positive int"):
        HFTrainEngine(tiny_model, max_tokens_per_micro_batch=0)
    with pytest.raises(ConfigError, match="set padding_free: true"):
        HFTrainEngine(tiny_model, padding_free=False, max_tokens_per_micro_batch=64)
    with pytest.raises(ConfigError, match="attn_implementation='flash' is not one of"):
        HFTrainEngine(tiny_model, attn_implementation="flash")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_grpo_step_packed_equals_the_padded_step(tiny_model, loss_type):
    from rlcore.plugins.grpo.objective import PolicyObjective

    batch = mixed_batch()
    reference = HFTrainEngine(tiny_model, padding_free=False, forward_only=True)
    old = reference.forward_logprobs(batch)
    batch["old_logprobs"] = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    objective = PolicyObjective(beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=None, loss_type=loss_type,
                                importance_sampling_level="token", max_completion_length=12,
                                num_items_in_batch=float(batch["completion_mask"].sum()), num_sequences_in_batch=8.0)
    steps, deltas = {}, {}
    for padding_free in (False, True):
        engine = HFTrainEngine(tiny_model, padding_free=padding_free, **LINEAR_ADAM)
        before = params(engine)
        steps[padding_free] = engine.train_step(batch, objective, micro_batch_size=2)
        deltas[padding_free] = {n: p - before[n] for n, p in params(engine).items()}
    assert steps[True]["loss"] == pytest.approx(steps[False]["loss"], rel=1e-5, abs=1e-7)
    assert steps[True]["grad_norm"] == pytest.approx(steps[False]["grad_norm"], rel=1e-5)
    assert steps[True]["grad_norm"] > 0
    for n, delta in deltas[False].items():
        torch.testing.assert_close(deltas[True][n], delta, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("topk", [None, 4])
def test_a_gkd_step_with_a_colocated_teacher_packed_equals_the_padded_step(tiny_model, tmp_path, topk):
    from rlcore.plugins.gkd.objective import DistillObjective
    from rlcore.plugins.gkd.workers import ROW, TeacherAnswers, teacher_answer
    from rlcore.testing import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", hidden_size=96, intermediate_size=192, seed=5)
    batch = mixed_batch()
    objective = DistillObjective(beta=0.5, temperature=0.9, topk=topk, sft_alpha=0.3,
                                 num_items_in_batch=float(batch["completion_mask"].sum()))
    steps, deltas = {}, {}
    for padding_free in (False, True):
        student = HFTrainEngine(tiny_model, padding_free=padding_free, **LINEAR_ADAM)
        forward = HFTrainEngine(str(teacher), padding_free=padding_free, forward_only=True)
        answers = TeacherAnswers(functools.partial(teacher_answer, forward), batch, rows=6, device="cpu")
        before = params(student)
        numbered = Batch({**batch, ROW: torch.arange(len(batch))})
        steps[padding_free] = student.train_step(numbered, functools.partial(objective, teacher=answers), 2, 0.9)
        deltas[padding_free] = {n: p - before[n] for n, p in params(student).items()}
    for key in ("loss", "grad_norm"):  # the metrics are means over micro-batches, which differ by design
        assert steps[True][key] == pytest.approx(steps[False][key], rel=1e-5)
    assert steps[True]["jsd"] > 0 and steps[True]["sft_loss"] > 0
    for n, delta in deltas[False].items():
        torch.testing.assert_close(deltas[True][n], delta, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("arch, packs", [("qwen3", True), ("gemma3", True), ("qwen3_5", False), ("qwen3_5_moe", False)])
def test_a_model_with_layers_that_carry_a_state_along_a_row_runs_padded(tmp_path, arch, packs):
    """Qwen3.5's gated delta-net carries its state through a packed row's sequence boundaries in transformers, so
    the engine turns packing off for it, and its log-probs are the padded ones; attention-only models pack."""
    from rlcore.testing import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch=arch)
    batch = mixed_batch()
    engine = HFTrainEngine(path, forward_only=True)
    assert engine.padding_free is packs
    want = HFTrainEngine(path, forward_only=True, padding_free=False).forward_logprobs(batch)
    torch.testing.assert_close(engine.forward_logprobs(batch), want, atol=2e-6, rtol=1e-5)
