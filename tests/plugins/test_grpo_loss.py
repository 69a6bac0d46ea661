"""policy_loss against a loop-by-loop reference, against TRL 1.16's own GRPOTrainer._compute_loss, and the
micro-batch rule: losses of micro-batches (and data-parallel workers) add up to the whole batch's loss.
sampler_importance_ratio (TRL's vllm_importance_sampling_correction) against a loop-by-loop reference."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlcore import RlcoreError
from rlcore.plugins.grpo.loss import (
    LOSS_TYPES,
    SAMPLER_CORRECTION_MODES,
    batch_normalizers,
    policy_loss,
    sampler_importance_ratio,
)

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
        "sampling_logprobs": old + 0.1 * torch.randn(rows, cols, generator=g),  # the rollout engine's
        "advantages": torch.randn(rows, generator=g),
        "mask": mask,
    }


def reference_loss(b, *, beta, epsilon, epsilon_high, delta, loss_type, level, num_items=None, bias_kl=True,
                   is_ratio=None) -> float:
    """Written from the definitions, one token at a time, with Python floats. `is_ratio` ([B, T] or [B, 1])
    weights the policy term; `bias_kl` multiplies the KL term by the (unclipped) policy ratio."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    rows, cols = b["mask"].shape
    per_seq_sum, per_seq_count = [], []
    for i in range(rows):
        tokens = [t for t in range(cols) if b["mask"][i, t] > 0]
        per_token = b["advantages"].dim() == 2  # GRPO with a teacher's KL: one advantage per token
        seq_log_ratio = sum(float(b["logprobs"][i, t] - b["old_logprobs"][i, t]) for t in tokens) / len(tokens)
        total = 0.0
        for t in tokens:
            lp, old, ref = float(b["logprobs"][i, t]), float(b["old_logprobs"][i, t]), float(b["ref_logprobs"][i, t])
            ratio = math.exp(seq_log_ratio if level == "sequence" else lp - old)
            clipped = min(max(ratio, 1 - epsilon), 1 + eps_high)
            kl_weight = ratio if bias_kl else 1.0
            if delta is not None:
                ratio = min(ratio, delta)
            adv = float(b["advantages"][i, t] if per_token else b["advantages"][i])
            term = -min(ratio * adv, clipped * adv)
            if is_ratio is not None:
                term *= float(is_ratio[i, t if is_ratio.shape[1] > 1 else 0])
            if beta:
                term += beta * kl_weight * (math.exp(ref - lp) - (ref - lp) - 1)
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


def ours_with(b, *, bias_kl=True, is_ratio=None, **opts):
    return ours(b, use_bias_correction_kl=bias_kl, importance_sampling_ratio=is_ratio, **opts)


def is_ratios(b):
    """No correction, a token-level and a sequence-level sampler ratio (as sampler_importance_ratio gives)."""
    return [None] + [
        sampler_importance_ratio(b["old_logprobs"], b["sampling_logprobs"], b["mask"], mode, 0.5, 1.5)[0]
        for mode in ("token_truncate", "sequence_mask")
    ]


@pytest.mark.parametrize("loss_type,level", itertools.product(LOSS_TYPES, LEVELS))
def test_matches_loop_reference(loss_type, level):
    for seed, (beta, epsilon, epsilon_high, delta) in itertools.product(range(3), OPTIONS):
        b = random_batch(seed)
        opts = dict(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, loss_type=loss_type, level=level)
        for bias_kl, is_ratio in itertools.product((True, False), is_ratios(b)):
            loss, metrics = ours_with(b, bias_kl=bias_kl, is_ratio=is_ratio, **opts)
            expected = reference_loss(b, bias_kl=bias_kl, is_ratio=is_ratio, **opts)
            assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert set(metrics) >= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
        assert ("kl" in metrics) == bool(beta)


@pytest.mark.parametrize("loss_type,level", itertools.product(LOSS_TYPES, LEVELS))
def test_per_token_advantages_match_loop_reference(loss_type, level):
    """[B, T] advantages (a teacher's KL term per token) in the same loss, against the loop written per token."""
    for seed, (beta, epsilon, epsilon_high, delta) in itertools.product(range(2), OPTIONS):
        b = random_batch(seed)
        b["advantages"] = b["advantages"][:, None] + torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(seed))
        opts = dict(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, delta=delta, loss_type=loss_type, level=level)
        loss, _ = ours(b, **opts)
        assert loss.item() == pytest.approx(reference_loss(b, **opts), rel=1e-5, abs=1e-6)


def test_dapo_uses_the_global_token_count():
    b = random_batch(7)
    opts = dict(beta=0.04, epsilon=0.2, epsilon_high=0.28, delta=None, loss_type="dapo", level="token")
    loss, _ = ours(b, num_items_in_batch=123.0, **opts)
    assert loss.item() == pytest.approx(reference_loss(b, num_items=123.0, **opts), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# TRL's own code path: the real unbound GRPOTrainer._compute_loss on a stand-in carrying what it reads
# ---------------------------------------------------------------------------------------------------------


class _Accelerator:
    sync_gradients = True

    def __init__(self, num_processes: int = 1):
        self.num_processes = num_processes

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def trl_loss(b, *, beta, epsilon, epsilon_high, delta, loss_type, level, num_items, bias_kl=True, is_ratio=None,
             accumulation=1, steps_per_generation=1, num_processes=1):
    """TRL's loss of one micro-batch; `num_items` is TRL's num_items_in_batch (the generation batch's tokens)."""
    from trl import GRPOTrainer

    logprobs = b["logprobs"].clone().requires_grad_(True)
    stand_in = SimpleNamespace(
        loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, max_completion_length=MAX_LEN,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=accumulation, model=SimpleNamespace(training=True),
        accelerator=_Accelerator(num_processes),
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=bias_kl, steps_per_generation=steps_per_generation),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
    )
    rows, cols = b["mask"].shape
    inputs = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.zeros(rows, cols, dtype=torch.long), "completion_mask": b["mask"],
        "advantages": b["advantages"], "old_per_token_logps": b["old_logprobs"],
        "ref_per_token_logps": b["ref_logprobs"], "num_items_in_batch": torch.tensor(num_items),
        **({"importance_sampling_ratio": is_ratio} if is_ratio is not None else {}),
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
        for bias_kl, is_ratio in itertools.product((True, False), is_ratios(b)):
            extra = dict(bias_kl=bias_kl, is_ratio=is_ratio)
            expected, expected_grad, trl_metrics = trl_loss(b, num_items=num_items, **opts, **extra)
            logprobs = b["logprobs"].clone().requires_grad_(True)
            loss, metrics = ours_with({**b, "logprobs": logprobs}, **opts, **extra)
            (grad,) = torch.autograd.grad(loss, logprobs)
            assert loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
            torch.testing.assert_close(grad, expected_grad)
            for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") + (("kl",) if beta else ()):
                assert metrics[name] == pytest.approx(trl_metrics[name], abs=1e-6), name


def test_dapo_normaliser_is_trls_across_accumulation_and_processes():
    """TRL divides a dapo micro-batch by num_items_in_batch / processes * accumulation / steps_per_generation;
    batch_normalizers-style counts give the same loss when a trainer passes that value."""
    b = random_batch(5)
    opts = dict(beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=None, loss_type="dapo", level="token")
    round_tokens = 5 * float(b["mask"].sum())
    expected, _, _ = trl_loss(b, num_items=round_tokens, accumulation=2, steps_per_generation=4, num_processes=3, **opts)
    loss, _ = ours(b, num_items_in_batch=round_tokens / (4 / 2) / 3, **opts)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


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
    with pytest.raises(RlcoreError, match=r"advantages must be \[B\] = \[6\] or \[B, T\] = \[6, 7\]"):
        policy_loss(b["logprobs"], b["old_logprobs"], b["advantages"][:3], b["mask"])
    with pytest.raises(RlcoreError, match="old_logprobs has shape"):
        policy_loss(b["logprobs"], b["old_logprobs"][:, :2], b["advantages"], b["mask"])


# ---------------------------------------------------------------------------------------------------------
# the sampler correction (TRL's vllm_importance_sampling_correction)
# ---------------------------------------------------------------------------------------------------------


def reference_sampler_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL's definition, one token at a time: exp(old - sampling) per token or exp(sum) per sequence, then
    clamped (truncate) or zeroed (mask) outside [clip_min, clip_max]; NaN differences count as 0."""
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    rows, cols = mask.shape
    diffs = [[0.0 if mask[i, t] == 0 or math.isnan(float(old[i, t] - sampling[i, t])) else float(old[i, t] - sampling[i, t])
              for t in range(cols)] for i in range(rows)]
    if mode.startswith("sequence"):
        diffs = [[sum(row)] for row in diffs]
    out = []
    for row in diffs:
        values = []
        for d in row:
            r = math.exp(d)
            values.append(min(max(r, low), high) if mode.endswith("truncate") else (0.0 if r < low or r > high else r))
        out.append(values)
    return torch.tensor(out)


@pytest.mark.parametrize("mode", SAMPLER_CORRECTION_MODES)
@pytest.mark.parametrize("clip", [(None, 3.0), (0.9, 1.1), (0.5, None)], ids=["cap", "both", "floor"])
def test_sampler_ratio_matches_loop_reference(mode, clip):
    b = random_batch(21, rows=8)
    sampling = b["old_logprobs"] + 0.4 * torch.randn(8, 7, generator=torch.Generator().manual_seed(1))
    sampling[2, 0] = float("nan")  # a token the sampler could not score
    ratio, metrics = sampler_importance_ratio(b["old_logprobs"], sampling, b["mask"], mode, *clip)
    expected = reference_sampler_ratio(b["old_logprobs"], sampling, b["mask"], mode, *clip)
    torch.testing.assert_close(ratio, expected)
    assert ratio.shape == ((8, 1) if mode.startswith("sequence") else (8, 7))

    on = b["mask"].bool()
    delta = (b["old_logprobs"] - sampling).abs()[on & ~torch.isnan(sampling)]
    flat = expected.flatten() if mode.startswith("sequence") else expected[on]
    assert metrics == pytest.approx({
        "sampling/sampling_logp_difference/mean": float(delta.mean()),
        "sampling/sampling_logp_difference/max": float(delta.max()),
        "sampling/importance_sampling_ratio/min": float(flat.min()),
        "sampling/importance_sampling_ratio/mean": float(flat.mean()),
        "sampling/importance_sampling_ratio/max": float(flat.max()),
    })


def test_sampler_ratio_is_one_when_sampler_and_trainer_agree():
    b = random_batch(3)
    for mode in SAMPLER_CORRECTION_MODES:
        ratio, metrics = sampler_importance_ratio(b["old_logprobs"], b["old_logprobs"], b["mask"], mode)
        assert torch.equal(ratio, torch.ones_like(ratio))
        assert metrics["sampling/sampling_logp_difference/max"] == 0.0


def test_sampler_ratio_bad_input_is_a_clear_error():
    b = random_batch(0)
    with pytest.raises(RlcoreError, match="vllm_importance_sampling_mode 'token' is unknown; known: token_truncate"):
        sampler_importance_ratio(b["old_logprobs"], b["sampling_logprobs"], b["mask"], "token")
    with pytest.raises(RlcoreError, match="sampling_logprobs has shape"):
        sampler_importance_ratio(b["old_logprobs"], b["sampling_logprobs"][:, :2], b["mask"])
    with pytest.raises(RlcoreError, match=r"importance_sampling_ratio must be \[B, T\] or \[B, 1\]"):
        policy_loss(b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"], importance_sampling_ratio=b["mask"][:2])
