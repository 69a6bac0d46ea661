"""Padding-free packing and token-budget micro-batches in the hf train engine: unset, the engine packs only with a
variable-length attention kernel (none on the CPU: it pads); forced packed rows give the padded rows' log-probs, no
token attends across sequences, and GRPO's and GKD's steps (loss, gradients) equal the padded ones.

Tolerances: float32 carries 24 bits (eps 1.2e-7); packed and padded runs add the same products in other orders
(attention over another key count, matmuls over other shapes), so a log-prob of magnitude ~log(V) = 5.6 may move by
a few eps per layer and operation. `FP32` allows 64 eps relative and absolute, about 8e-6. A gradient (read as the
parameter delta of one Adam step with lr = adam_epsilon, which equals the gradient) sums over every token of the step,
about 100x the terms of one log-prob, and its small entries cancel: `GRAD` allows 1e-4 relative and 1e-6 absolute."""

from __future__ import annotations

import functools

import pytest
import torch

from rlcore import Batch, ConfigError
from rlcore.plugins.hf.train import HFTrainEngine, split_to, token_micro_batches

LINEAR_ADAM = dict(learning_rate=1e3, adam_epsilon=1e3, max_grad_norm=0)  # parameter deltas compare gradients
EPS = torch.finfo(torch.float32).eps
FP32 = dict(atol=64 * EPS, rtol=64 * EPS)  # log-probs, packed against padded (see the module docstring)
GRAD = dict(atol=1e-6, rtol=1e-4)  # gradients (see the module docstring)


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
    packed = HFTrainEngine(tiny_model, padding_free=True, **keys)
    assert packed.padding_free and not packed.varlen  # forced: a dense block-causal mask, no kernel on the CPU
    assert packed.model.config._attn_implementation == (attention or "sdpa")
    seen = decoder_inputs(packed)
    want, got = padded.forward_logprobs(batch), packed.forward_logprobs(batch)
    real = int(batch["attention_mask"].sum())
    assert len(seen) == 1 and seen[0][0] == (1, real) and seen[0][2] is None  # one row of the real tokens only
    assert seen[0][1][0, :16].tolist() == list(range(14)) + [0, 1]  # each sequence's own positions
    torch.testing.assert_close(got, want, **FP32)
    top_want, top_got = padded.forward_topk(batch, 3), packed.forward_topk(batch, 3)
    torch.testing.assert_close(top_got.logprobs, top_want.logprobs, **FP32)

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
    for name, keys in {"padded": dict(padding_free=False),
                        "tokens": dict(padding_free=True, max_tokens_per_micro_batch=budget)}.items():
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
        torch.testing.assert_close(deltas["tokens"][n], delta, **GRAD)


def test_the_packing_options_are_checked(tiny_model):
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=0 must be a positive int"):
        HFTrainEngine(tiny_model, max_tokens_per_micro_batch=0)
    for padding_free in (False, None):  # a token budget forms packed micro-batches: packing must be asked for
        with pytest.raises(ConfigError, match="set padding_free: true"):
            HFTrainEngine(tiny_model, padding_free=padding_free, max_tokens_per_micro_batch=64)
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
    for padding_free in (None, True):  # unset pads on the CPU
        engine = HFTrainEngine(tiny_model, padding_free=padding_free, **LINEAR_ADAM)
        assert engine.padding_free is bool(padding_free)
        before = params(engine)
        steps[padding_free] = engine.train_step(batch, objective, micro_batch_size=2)
        deltas[padding_free] = {n: p - before[n] for n, p in params(engine).items()}
    assert steps[True]["loss"] == pytest.approx(steps[None]["loss"], rel=FP32["rtol"], abs=FP32["atol"])
    assert steps[True]["grad_norm"] == pytest.approx(steps[None]["grad_norm"], rel=FP32["rtol"])
    assert steps[True]["grad_norm"] > 0
    for n, delta in deltas[None].items():
        torch.testing.assert_close(deltas[True][n], delta, **GRAD)


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
        torch.testing.assert_close(deltas[True][n], delta, **GRAD)


@pytest.mark.parametrize("arch, packs", [("qwen3", True), ("gemma3", True), ("qwen3_5", False), ("qwen3_5_moe", False)])
def test_a_model_with_layers_that_carry_a_state_along_a_row_runs_padded(tmp_path, arch, packs):
    """Qwen3.5's gated delta-net carries its state through a packed row's sequence boundaries in transformers, so
    the engine turns packing off for it, and its log-probs are the padded ones; attention-only models pack."""
    from rlcore.testing import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch=arch)
    batch = mixed_batch()
    engine = HFTrainEngine(path, forward_only=True, padding_free=True)
    assert engine.padding_free is packs
    want = HFTrainEngine(path, forward_only=True, padding_free=False).forward_logprobs(batch)
    torch.testing.assert_close(engine.forward_logprobs(batch), want, **FP32)


def test_unset_padding_free_pads_on_the_cpu_and_says_why(tiny_model, caplog):
    """No variable-length kernel on the CPU: the engine runs each micro-batch as padded rows, logs why once, and a
    forced pack (dense mask) is logged as slower."""
    from rlcore.plugins.hf import attention

    attention._LOGGED.clear()
    batch = mixed_batch()
    with caplog.at_level("INFO", logger="rlcore.plugins.hf.attention"):
        engine = HFTrainEngine(tiny_model, forward_only=True)
        HFTrainEngine(tiny_model, forward_only=True)  # the same choice again: not logged twice
        forced = HFTrainEngine(tiny_model, forward_only=True, padding_free=True)
    assert engine.padding_free is False and engine.varlen is False and forced.padding_free is True
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("hf engine: pads rows (padding_free unset): the CPU has no variable-length attention kernel") == 1
    slower = [r for r in caplog.records if "slower than padding" in r.getMessage()]
    assert len(slower) == 1 and slower[0].levelname == "WARNING"
    seen = decoder_inputs(engine)
    engine.forward_logprobs(batch)
    assert seen[0][0] == (8, 14) and seen[0][1] is None  # the rows as they are, cut to the longest


def test_the_packing_choice(tiny_model, monkeypatch):
    """`varlen_kernel` finds a variable-length kernel only on CUDA, in half precision, for a model it can run;
    `packing_choice` packs an unset `padding_free` only with one (and only while the GPU default says so), and never
    a model whose layers carry a state. Availability on CUDA is patched: this machine has no GPU."""
    from rlcore.plugins.hf import attention
    from rlcore.plugins.hf.attention import VARLEN, packing_choice, varlen_kernel

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    model = HFTrainEngine(tiny_model, forward_only=True).model
    assert varlen_kernel(model, cpu, None) == (None, "the CPU has no variable-length attention kernel")
    assert varlen_kernel(model, cuda, None)[0] is None  # float32
    half = model.to(torch.bfloat16)
    monkeypatch.setattr(attention, "torch_varlen_on", lambda device: True)
    assert varlen_kernel(half, cuda, None) == (VARLEN, "torch's varlen_attn")
    assert varlen_kernel(half, cuda, "sdpa")[0] is None  # the user's choice of kernel stands
    assert varlen_kernel(half, cuda, "flash_attention_2")[0] == "flash_attention_2"
    monkeypatch.setattr(half.config, "attention_dropout", 0.1)
    assert varlen_kernel(half, cuda, None) == (None, "the model's attention_dropout is not 0")
    monkeypatch.setattr(half.config, "attention_dropout", 0.0)
    monkeypatch.setattr(attention, "torch_varlen_on", lambda device: False)
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    assert varlen_kernel(half, cuda, None)[0] is None
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    assert varlen_kernel(half, cuda, None)[0] == "flash_attention_2"

    for default in (False, True):
        monkeypatch.setattr(attention, "PACK_WITH_VARLEN_BY_DEFAULT", default)
        unset = packing_choice(None, VARLEN, "torch's varlen_attn", carries_state=False)
        assert (unset.pack, unset.attn) == ((True, VARLEN) if default else (False, None))
        assert packing_choice(None, None, "no kernel", carries_state=False).pack is False
        assert packing_choice(False, VARLEN, "k", carries_state=False).pack is False
        assert packing_choice(True, VARLEN, "k", carries_state=False) == attention.Packing(
            True, VARLEN, "packs rows (padding_free: true) with k")
        dense = packing_choice(True, None, "no kernel", carries_state=False)
        assert (dense.pack, dense.attn) == (True, None) and "slower than padding: no kernel" in dense.reason
        assert packing_choice(True, VARLEN, "k", carries_state=True).pack is False
