"""policy_loss against a loop-by-loop reference, against TRL 1.16's own GRPOTrainer._compute_loss, and the
micro-batch rule: losses of micro-batches (and data-parallel workers) add up to the whole batch's loss."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlcore import RlcoreError
from rlcore.plugins.grpo.loss import LOSS_TYPES, batch_normalizers, policy_loss

LEVELS = ("token", "sequence")
MAX_LEN = 9
# (beta, epsilon, epsilon_high, delta): plain GRPO, DAPO clip-higher with KL, TRL's two-sided delta
OPTIONS = [(0.0, 0.2, None, None), (0.04, 0.2, 0.28, None), (0.1, 0.1, 0.3, 1.2)]


def random_batch(seed: int, rows: int = 6, cols: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    lengths[0] = cols  # one full row, so padding-free rows are covered too
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).float()
    old = -3 * torch.rand(rows, cols, generator=g)
    return {
        "logprobs": old + 0.4 * torch.randn(rows, cols, generator=g),  # ratios well outside [0.8, 1.28]
        "old_logprobs": old,
        "ref_logprobs": old + 0.3 * torch.randn(rows, cols, generator=g),
        "advantages": torch.randn(rows, generator=g),
        "mask": mask,
    }


def reference_loss(b, *, beta, epsilon, epsilon_high, delta, loss_type, level, num_items=None) -> float:
    """Written from the definitions, one token at a time, with Python floats."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    rows, cols = b["mask"].shape
    per_seq_sum, per_seq_count = [], []
    for i in range(rows):
        tokens = [t for t in range(cols) if b["mask"][i, t] > 0]
        adv = float(b["advantages"][i])
        seq_log_ratio = sum(float(b["logprobs"][i, t] - b["old_logprobs"][i, t]) for t in tokens) / len(tokens)
        total = 0.0
        for t in tokens:
            lp, old, ref = float(b["logprobs"][i, t]), float(b["old_logprobs"][i, t]), float(b["ref_logprobs"][i, t])
            ratio = math.exp(seq_log_ratio if level == "sequence" else lp - old)
            clipped = min(max(ratio, 1 - epsilon), 1 + eps_high)
            if delta is not None:
                ratio = min(ratio, delta)
            term = -min(ratio * adv, clipped * adv)
            if beta:
                term += beta * (math.exp(ref - lp) - (ref - lp) - 1)
            total += term
        per_seq_sum.append(total)
        per_seq_count.append(len(tokens))
    if loss_type == "grpo":
        return sum(s / n for s, n in zip(per_seq_sum, per_seq_count)) / rows
    if loss_type == "dr_grpo":
        return sum(per_seq_sum) / (rows * MAX_LEN)
    return sum(per_seq_sum) / (num_items if num_items is not None else sum(per_seq_count))


def ours(b, *, beta, epsilon, epsilon_high, delta, loss_type, level, **kwargs):
    return policy_loss(
        b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"],
        ref_logprobs=b["ref_logprobs"] if beta else None, beta=beta, epsilon=epsilon,
        epsilon_high=epsilon_high, delta=delta, loss_type=loss_type, importance_sampling_level=level,
        max_completion_length=MAX_LEN, **kwargs,
    )


@pytest.mark.parametrize("loss_type,level", itertools.product(LOSS_TYPES, LEVELS))
def test_matches_loop_reference(loss_type, level):
    for seed, (beta, epsilon, epsilon_high, delta) in itertools.product(range(3), OPTIONS):
        b = random_batch(seed)
        opts = dict(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, loss_type=loss_type, level=level)
        loss, metrics = ours(b, **opts)
        assert loss.item() == pytest.approx(reference_loss(b, **opts), rel=1e-5, abs=1e-6)
        assert set(metrics) >= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
        assert ("kl" in metrics) == bool(beta)


def test_dapo_uses_the_global_token_count():
    b = random_batch(7)
    opts = dict(beta=0.04, epsilon=0.2, epsilon_high=0.28, delta=None, loss_type="dapo", level="token")
    loss, _ = ours(b, num_items_in_batch=123.0, **opts)
    assert loss.item() == pytest.approx(reference_loss(b, num_items=123.0, **opts), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# TRL's own code path: the real unbound GRPOTrainer._compute_loss on a stand-in carrying what it reads
# ---------------------------------------------------------------------------------------------------------


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def trl_loss(b, *, beta, epsilon, epsilon_high, delta, loss_type, level, num_items):
    from trl import GRPOTrainer

    logprobs = b["logprobs"].clone().requires_grad_(True)
    stand_in = SimpleNamespace(
        loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, max_completion_length=MAX_LEN,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, model=SimpleNamespace(training=True), accelerator=_Accelerator(),
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
    )
    rows, cols = b["mask"].shape
    inputs = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(rows, cols, dtype=torch.long), "completion_mask": b["mask"],
        "advantages": b["advantages"], "old_per_token_logps": b["old_logprobs"],
        "ref_per_token_logps": b["ref_logprobs"], "num_items_in_batch": torch.tensor(num_items),
    }
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss, grad, {k: v[-1] for k, v in stand_in._metrics["train"].items()}


@pytest.mark.parametrize("loss_type,level", itertools.product(LOSS_TYPES, LEVELS))
def test_matches_trl(loss_type, level):
    for seed, (beta, epsilon, epsilon_high, delta) in itertools.product(range(2), OPTIONS):
        b = random_batch(100 + seed)
        opts = dict(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, loss_type=loss_type, level=level)
        num_items = float(b["mask"].sum())
        expected, expected_grad, trl_metrics = trl_loss(b, num_items=num_items, **opts)
        logprobs = b["logprobs"].clone().requires_grad_(True)
        loss, metrics = ours({**b, "logprobs": logprobs}, **opts)
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
        torch.testing.assert_close(grad, expected_grad)
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") + (("kl",) if beta else ()):
            assert metrics[name] == pytest.approx(trl_metrics[name], abs=1e-6), name


# ---------------------------------------------------------------------------------------------------------
# micro-batches and data-parallel workers
# ---------------------------------------------------------------------------------------------------------


def _rows(b, sl):
    return {k: v[sl] for k, v in b.items()}


@pytest.mark.parametrize("loss_type,level", itertools.product(LOSS_TYPES, LEVELS))
def test_micro_batches_sum_to_the_batch_loss(loss_type, level):
    b = random_batch(11, rows=8)
    opts = dict(beta=0.04, epsilon=0.2, epsilon_high=0.28, delta=None, loss_type=loss_type, level=level)
    full_lp = b["logprobs"].clone().requires_grad_(True)
    full, _ = ours({**b, "logprobs": full_lp}, **opts)
    (full_grad,) = torch.autograd.grad(full, full_lp)

    norms = batch_normalizers(b["mask"])
    lp = b["logprobs"].clone().requires_grad_(True)
    pieces = [slice(0, 3), slice(3, 4), slice(4, 8)]  # unequal micro-batches
    total = sum(ours({**_rows(b, s), "logprobs": lp[s]}, **opts, **norms)[0] for s in pieces)
    (grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(grad, full_grad)

    # two data-parallel workers, each with two micro-batches: DDP averages the workers' sums
    norms = batch_normalizers(b["mask"], world_size=2)
    workers = [[slice(0, 1), slice(1, 4)], [slice(4, 6), slice(6, 8)]]
    per_worker = [sum(ours(_rows(b, s), **opts, **norms)[0] for s in w) for w in workers]
    assert (sum(per_worker) / 2).item() == pytest.approx(full.item(), rel=1e-6)


def test_naive_micro_batch_means_do_not_sum_to_the_batch_loss():
    """The property above is not automatic: without the normalizers, bnpo's micro-batch means differ."""
    b = random_batch(12, rows=8)
    opts = dict(beta=0.0, epsilon=0.2, epsilon_high=None, delta=None, loss_type="bnpo", level="token")
    full, _ = ours(b, **opts)
    halves = [ours(_rows(b, s), **opts)[0] for s in (slice(0, 2), slice(2, 8))]
    assert (sum(halves) / 2).item() != pytest.approx(full.item(), rel=1e-4)


def test_bad_input_is_a_clear_error():
    b = random_batch(0)
    args = (b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"])
    with pytest.raises(RlcoreError, match="loss_type 'ppo' is unknown; known: grpo, bnpo, dr_grpo, dapo"):
        policy_loss(*args, loss_type="ppo")
    with pytest.raises(RlcoreError, match="importance_sampling_level 'seq'"):
        policy_loss(*args, importance_sampling_level="seq")
    with pytest.raises(RlcoreError, match="beta=0.1 needs ref_logprobs"):
        policy_loss(*args, beta=0.1)
    with pytest.raises(RlcoreError, match="dr_grpo' needs max_completion_length"):
        policy_loss(*args, loss_type="dr_grpo")
    with pytest.raises(RlcoreError, match=r"advantages must be \[B\] = \[6\]"):
        policy_loss(b["logprobs"], b["old_logprobs"], b["advantages"][:3], b["mask"])
    with pytest.raises(RlcoreError, match="old_logprobs has shape"):
        policy_loss(b["logprobs"], b["old_logprobs"][:, :2], b["advantages"], b["mask"])
