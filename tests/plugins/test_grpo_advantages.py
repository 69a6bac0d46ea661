"""Advantages against per-group Python references, for every estimator and scaling; None rewards as TRL."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from rlcore import RlcoreError
from rlcore.plugins.grpo.advantages import (
    ESTIMATORS,
    SCALE_REWARDS,
    combine_rewards,
    compute_advantages,
    nanstd,
    zero_std_groups,
)

EPS = 1e-4


def reference(rewards: list[float], g: int, scale: str, estimator: str) -> list[float]:
    """Plain Python from the module's definitions; NaN rewards are left out and get advantage 0."""
    groups = [rewards[i : i + g] for i in range(0, len(rewards), g)]
    raw = []
    for group in groups:
        valid = [r for r in group if not math.isnan(r)]
        for r in group:
            if math.isnan(r):
                raw.append(math.nan)
            elif estimator == "rloo":
                others = list(valid)
                others.remove(r)
                raw.append(r - statistics.fmean(others) if others else 0.0)
            else:
                raw.append(r - statistics.fmean(valid))
    if scale == "none":
        return [0.0 if math.isnan(a) else a for a in raw]
    basis = raw if estimator == "reinforce_plus_plus" else rewards

    def std(values):
        values = [v for v in values if not math.isnan(v)]
        return statistics.stdev(values) if len(values) > 1 else math.nan

    out = []
    for i, a in enumerate(raw):
        s = std(basis[i // g * g : i // g * g + g]) if scale == "group" else std(basis)
        value = a / (s + EPS)
        out.append(0.0 if math.isnan(value) else value)
    return out


@pytest.mark.parametrize("scale,estimator", itertools.product(SCALE_REWARDS, ESTIMATORS))
def test_matches_reference(scale, estimator):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6 * 4, generator=g)
    rewards[[3, 9, 10]] = float("nan")  # unscorable completions
    rewards[16:20] = float("nan")  # a wholly unscorable group
    got = compute_advantages(rewards, 4, scale_rewards=scale, estimator=estimator)
    expected = reference(rewards.tolist(), 4, scale, estimator)
    assert got.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert not torch.isnan(got).any()
    assert got[[3, 9, 10]].tolist() == [0.0, 0.0, 0.0]
    assert got[16:20].tolist() == [0.0] * 4


def test_known_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    grpo = compute_advantages(rewards, 4)
    assert grpo[:4].tolist() == pytest.approx([0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS), -0.25 / (0.5 + EPS)])
    assert grpo[4:].tolist() == [0.0] * 4  # equal rewards: no signal
    rloo = compute_advantages(rewards, 4, scale_rewards="none", estimator="rloo")
    assert rloo[:4].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # leave-one-out is the group-mean baseline scaled by G / (G - 1)
    plain = compute_advantages(rewards, 4, scale_rewards="none")
    torch.testing.assert_close(rloo, plain * 4 / 3)


def test_reinforce_plus_plus_whitens_over_the_batch():
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.0, 5.0, 1.0])
    adv = compute_advantages(rewards, 2, scale_rewards="batch", estimator="reinforce_plus_plus")
    centred = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.0, -2.0])
    torch.testing.assert_close(adv, centred / (centred.std() + EPS))
    assert adv.std().item() == pytest.approx(1.0, abs=1e-3)


def test_combine_rewards_skips_none_as_trl_does():
    nan = float("nan")
    per_function = torch.tensor([[1.0, 0.5], [nan, 0.5], [nan, nan], [0.0, nan]])
    combined = combine_rewards(per_function, [2.0, 1.0])
    assert combined[[0, 1, 3]].tolist() == [2.5, 0.5, 0.0]
    assert math.isnan(combined[2])  # every function returned None: unscorable, not 0
    assert combine_rewards(per_function[:, :1])[[0, 3]].tolist() == [1.0, 0.0]


def test_unscorable_row_does_not_bias_the_baseline():
    """TRL 1.16: an all-None completion is excluded from the group mean rather than counted as 0."""
    nan = float("nan")
    combined = combine_rewards(torch.tensor([[1.0], [1.0], [0.0], [nan]]))
    adv = compute_advantages(combined, 4, scale_rewards="none")
    assert adv.tolist() == pytest.approx([1 / 3, 1 / 3, -2 / 3, 0.0])


def test_zero_std_groups_for_dynamic_sampling():
    nan = float("nan")
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, nan, nan, 2.0, 2.0, nan])
    assert zero_std_groups(rewards, 3).tolist() == [False, True, True, True]


def test_nanstd_is_bessel_corrected():
    x = torch.tensor([[1.0, 2.0, 4.0, float("nan")]])
    assert nanstd(x, dim=1).item() == pytest.approx(statistics.stdev([1.0, 2.0, 4.0]))


def test_bad_input_is_a_clear_error():
    with pytest.raises(RlcoreError, match="do not split into groups of num_generations=4"):
        compute_advantages(torch.zeros(6), 4)
    with pytest.raises(RlcoreError, match="scale_rewards 'grup' is unknown"):
        compute_advantages(torch.zeros(4), 4, scale_rewards="grup")
    with pytest.raises(RlcoreError, match="advantage_estimator 'ppo' is unknown"):
        compute_advantages(torch.zeros(4), 4, estimator="ppo")
    with pytest.raises(RlcoreError, match="reward_weights has 1 weights for 2 reward functions"):
        combine_rewards(torch.zeros(3, 2), [1.0])


def test_teacher_advantages_add_the_teachers_log_ratio_per_generated_token():
    """ms-swift's OPD-RL: advantage[i, t] = advantage[i] + coef * (teacher[i, t] - old[i, t]) where the mask is 1,
    advantage[i] elsewhere; a teacher equal to the old policy leaves the advantages as they are."""
    from rlcore.plugins.grpo.advantages import teacher_advantages, teacher_kl

    torch.manual_seed(0)
    base, old, teacher = torch.randn(3), -torch.rand(3, 5) * 3, -torch.rand(3, 5) * 3
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 1], [0, 1, 1, 1, 1]], dtype=torch.float)  # 0 at [1, 3]: a tool's
    out = teacher_advantages(base, teacher, old, mask, 0.5)
    for i, t in itertools.product(range(3), range(5)):
        want = base[i] + (0.5 * (teacher[i, t] - old[i, t]) if mask[i, t] else 0.0)
        assert out[i, t].item() == pytest.approx(float(want), abs=1e-6)
    assert torch.equal(teacher_advantages(base, old, old, mask, 0.5), base.unsqueeze(1).expand(3, 5))
    assert torch.equal(teacher_advantages(base, teacher, old, mask, 0.0), base.unsqueeze(1).expand(3, 5))
    d = [(teacher[i, t] - old[i, t]).item() for i, t in itertools.product(range(3), range(5)) if mask[i, t]]
    assert teacher_kl(teacher, old, mask).item() == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / len(d), rel=1e-5)
    assert teacher_kl(old, old, mask).item() == 0.0


def test_one_generation_per_prompt_has_zero_advantages():
    """ms-swift's OPD runs num_generations 1: the rewards then give no signal, only a teacher's term does."""
    assert compute_advantages(torch.tensor([0.3, 1.0, -2.0]), 1).tolist() == [0.0, 0.0, 0.0]
