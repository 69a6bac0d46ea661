"""Rewards to advantages: combine reward functions, subtract a group baseline, scale.

Rewards arrive prompt-major: the `num_generations` completions of prompt i are rows i*G .. i*G+G-1.
A reward function's None is NaN here. As in TRL 1.16 (`GRPOTrainer._generate_and_score_completions`):
- `combine_rewards` weights each function's rewards and sums them ignoring NaN, so a function that could
  not judge a completion is left out of that completion's sum; a completion for which *every* function
  returned None is unscorable and its combined reward is NaN.
- `compute_advantages` leaves unscorable completions out of the group's mean and std (nan-aware statistics)
  and gives them advantage 0, so they do not move the policy.

Estimators (`advantage_estimator`, as ms-swift spells it and implements it in its GRPO trainer):
- grpo: A_i = r_i - mean(group); divided by the std of the rewards (group's, or the batch's) + 1e-4.
- rloo: A_i = r_i - mean of the *other* valid rewards of the group (leave-one-out, Ahmadian et al. 2024);
  divided by the std of the rewards as for grpo.
- reinforce_plus_plus: A_i = r_i - mean(group) (REINFORCE++ with baseline, Hu 2025; OpenRLHF's
  `reinforce_baseline`), then whitened by the std of the *advantages* over the batch ("batch", the
  REINFORCE++ definition) or the group ("group").
`scale_rewards="none"` skips the division for every estimator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from rlcore import RlcoreError

SCALE_REWARDS = ("group", "batch", "none")
ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
STD_EPSILON = 1e-4  # TRL's and ms-swift's


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample standard deviation (Bessel-corrected) ignoring NaN; NaN where fewer than two values remain."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    sq = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) if dim is not None else torch.nansum((x - mean) ** 2)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.full_like(sq, float("nan")))
    std = var.sqrt()
    return std if keepdim or dim is None else std.squeeze(dim)


def combine_rewards(per_function: torch.Tensor, weights: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """[N, F] rewards (NaN for None) -> [N]: the weighted sum over functions ignoring NaN; NaN if all are NaN."""
    if per_function.dim() != 2:
        raise RlcoreError(f"per-function rewards must be [N, F]; got shape {tuple(per_function.shape)}")
    n_funcs = per_function.shape[1]
    w = torch.ones(n_funcs) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    if w.shape != (n_funcs,):
        raise RlcoreError(f"reward_weights has {w.numel()} weights for {n_funcs} reward functions; give one per function")
    per_function = per_function.float()
    combined = (per_function * w.to(per_function.device).unsqueeze(0)).nansum(dim=1)
    combined[torch.isnan(per_function).all(dim=1)] = float("nan")
    return combined


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise RlcoreError(f"rewards must be [N * num_generations]; got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise RlcoreError(
            f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}; "
            "rewards must be prompt-major, num_generations per prompt"
        )
    return rewards.float().view(-1, num_generations)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: Literal["group", "batch", "none"] = "group",
    estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo",
) -> torch.Tensor:
    """[N*G] combined rewards (NaN: unscorable) -> [N*G] advantages, 0 for unscorable completions."""
    if scale_rewards not in SCALE_REWARDS:
        raise RlcoreError(f"scale_rewards '{scale_rewards}' is unknown; known: {', '.join(SCALE_REWARDS)}")
    if estimator not in ESTIMATORS:
        raise RlcoreError(f"advantage_estimator '{estimator}' is unknown; known: {', '.join(ESTIMATORS)}")
    grouped = _grouped(rewards, num_generations)
    valid = ~torch.isnan(grouped)
    count = valid.sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    if estimator == "rloo":
        others = (count - 1).clamp(min=1)
        baseline = torch.where(count > 1, (total - grouped) / others, grouped)  # alone in its group: advantage 0
    else:
        baseline = total / count.clamp(min=1)
    advantages = grouped - baseline

    if scale_rewards != "none":
        basis = advantages if estimator == "reinforce_plus_plus" else grouped
        if scale_rewards == "group":
            std = nanstd(basis, dim=1, keepdim=True)
        else:
            std = nanstd(basis.reshape(-1))
        advantages = advantages / (std + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0).reshape(-1)


def zero_std_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[N*G] rewards -> [N] bool: groups whose rewards are all equal (or with fewer than two scorable).

    Such a group has zero advantage everywhere and teaches nothing: DAPO's dynamic sampling drops or
    resamples it (`dynamic_sample`).
    """
    grouped = _grouped(rewards, num_generations)
    std = nanstd(grouped, dim=1)
    return torch.isnan(std) | torch.isclose(std, torch.zeros_like(std))


def teacher_advantages(advantages: torch.Tensor, teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       mask: torch.Tensor, coef: float) -> torch.Tensor:
    """ms-swift's OPD-RL advantage (its `expand_advantage_to_per_token`): [B] advantages -> [B, T], each token's
    plus `coef * (teacher log-prob - old policy log-prob)` of the sampled token, where `mask` is 1 (the tokens the
    policy generated); the k1 estimate of the reverse KL's gradient coefficient, added after normalisation."""
    per_token = advantages.float().unsqueeze(1).expand(mask.shape).clone()
    if coef != 0.0:
        ratio = (teacher_logprobs.float() - old_logprobs.float()).masked_fill(~mask.bool(), 0.0)
        per_token = per_token + coef * ratio
    return per_token


def moves_policy(advantages: torch.Tensor, mask: torch.Tensor) -> bool:
    """Some generated token has a nonzero advantage ([B], or [B, T] with a teacher's term): the policy term of the
    loss has a gradient. A run whose every step has none (and no KL term) trains nothing."""
    per_token = advantages.unsqueeze(1).expand(mask.shape) if advantages.dim() == 1 else advantages
    return bool((per_token != 0)[mask.bool()].any())


def teacher_kl(teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The logged `teacher_kl`: the k3 estimate exp(d) - d - 1, d = teacher - old log-prob, as a token mean
    (ms-swift's monitor of the distance to the teacher; it falls as the policy nears the teacher)."""
    d = (teacher_logprobs.float() - old_logprobs.float()).masked_fill(~mask.bool(), 0.0)
    return ((torch.exp(d) - d - 1) * mask).sum() / mask.sum().clamp(min=1.0)
