"""The GRPO policy loss: a pure function of per-token log-probs, as TRL 1.16's `GRPOTrainer._compute_loss`.

Shapes: `logprobs`, `old_logprobs`, `ref_logprobs` and `mask` are [B, T] (one column per token; `mask` is 1
on completion tokens), `advantages` is [B] (one per sequence) or [B, T] (one per token: GRPO with a teacher's
KL adds the teacher's term per token). No model, no engine: the trainer computes log-probs with its
engine and calls `policy_loss` on them.

Micro-batches and data-parallel workers. An engine sums the gradients of the losses of its micro-batches
(and DDP averages over its workers). Pass the same `batch_normalizers(mask_of_the_whole_step, world_size)`
to every micro-batch's `policy_loss` call and those losses add up (after DDP's average) to exactly the loss
of the whole step's batch, for every `loss_type`:

- grpo:    sum over sequences of per-sequence token means / num_sequences_in_batch
- bnpo:    sum over tokens / num_items_in_batch
- dr_grpo: sum over tokens / (num_sequences_in_batch * max_completion_length)
- dapo:    sum over tokens / num_items_in_batch

Left unset, each count is the call's own (rows or completion tokens), which is TRL's loss of one batch.
bnpo and dapo differ only in the count a trainer passes: bnpo the tokens of the optimizer step's batch, dapo
(as TRL does) the tokens of the whole generation batch divided by the optimizer steps it feeds. (TRL's bnpo
instead divides each micro-batch by its own tokens and averages over micro-batches and processes.)

Sampler/trainer mismatch: `sampler_importance_ratio` is TRL's `vllm_importance_sampling_correction`, the
ratio of the trainer's old log-probs to the rollout engine's, which `policy_loss` multiplies into the
per-token policy loss (before the KL term is added, as TRL does).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from rlcore import RlcoreError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]


def batch_normalizers(mask: torch.Tensor, world_size: int = 1) -> dict[str, float]:
    """The counts to pass to every micro-batch's `policy_loss` so that their losses sum to the batch loss.

    `mask` is the completion mask [B, T] of the whole batch one optimizer step covers, over all
    data-parallel workers; the counts are divided by `world_size` because DDP averages the workers' gradients.
    The token count is at least 1 (as TRL clamps it), so a step whose tokens are all masked has loss 0, not NaN.
    """
    if world_size < 1:
        raise RlcoreError(f"world_size must be >= 1, got {world_size}")
    return {
        "num_items_in_batch": max(float(mask.sum().item()), 1.0) / world_size,
        "num_sequences_in_batch": mask.shape[0] / world_size,
    }


def sampler_importance_ratio(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's importance-sampling correction of the rollout engine's sampling: (ratio, metrics).

    The ratio is exp(old - sampling) per completion token ([B, T]; 1 off the mask and where the sampler gave
    NaN), or per sequence ([B, 1], exp of the summed difference) for `sequence_*` modes. `*_truncate`
    clamps it to [clip_min, clip_max]; `*_mask` sets it to 0 outside. Metrics, named as TRL logs them:
    `sampling/sampling_logp_difference/mean|max` (|old - sampling| over completion tokens) and
    `sampling/importance_sampling_ratio/min|mean|max` (over completion tokens, or over sequences).
    """
    if mode not in SAMPLER_CORRECTION_MODES:
        raise RlcoreError(
            f"vllm_importance_sampling_mode '{mode}' is unknown; known: {', '.join(SAMPLER_CORRECTION_MODES)}"
        )
    for name, tensor in (("sampling_logprobs", sampling_logprobs), ("mask", mask)):
        if tensor.shape != old_logprobs.shape or old_logprobs.dim() != 2:
            raise RlcoreError(f"{name} has shape {tuple(tensor.shape)}; old_logprobs must be [B, T] and has "
                              f"{tuple(old_logprobs.shape)}")
    with torch.no_grad():
        mask = mask.to(old_logprobs.dtype)
        diff = torch.nan_to_num((old_logprobs - sampling_logprobs) * mask, nan=0.0)
        sequence = mode.startswith("sequence")
        ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence else diff)
        if mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
        else:
            low = -math.inf if clip_min is None else clip_min
            high = math.inf if clip_max is None else clip_max
            ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

        on = mask.bool()
        delta = (old_logprobs - sampling_logprobs).abs()
        given = on & ~torch.isnan(delta)
        over = torch.ones_like(ratio, dtype=torch.bool) if sequence else on

        def stat(x: torch.Tensor, where: torch.Tensor, how: str) -> torch.Tensor:
            """mean, max or min of x where `where` holds (0 where it holds nowhere), without a boolean index: 0-dim
            tensors, read once the step is done (an index or a float would wait for the GPU here)."""
            if how == "mean":
                value = torch.where(where, x, 0.0).sum() / where.sum().clamp(min=1)
            elif how == "max":
                value = torch.where(where, x, -math.inf).amax()
            else:
                value = torch.where(where, x, math.inf).amin()
            return torch.where(where.any(), value, 0.0)

        metrics = {
            "sampling/sampling_logp_difference/mean": stat(delta, given, "mean"),
            "sampling/sampling_logp_difference/max": stat(delta, given, "max"),
            "sampling/importance_sampling_ratio/min": stat(ratio, over, "min"),
            "sampling/importance_sampling_ratio/mean": stat(ratio, over, "mean"),
            "sampling/importance_sampling_ratio/max": stat(ratio, over, "max"),
        }
    return ratio, metrics


def _check(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    importance_sampling_ratio: torch.Tensor | None,
    beta: float,
    loss_type: str,
    importance_sampling_level: str,
    max_completion_length: int | None,
) -> None:
    if loss_type not in LOSS_TYPES:
        raise RlcoreError(f"loss_type '{loss_type}' is unknown; known: {', '.join(LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise RlcoreError(
            f"importance_sampling_level '{importance_sampling_level}' is unknown; "
            f"known: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
        )
    if logprobs.dim() != 2:
        raise RlcoreError(f"logprobs must be [B, T]; got shape {tuple(logprobs.shape)}")
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs)):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise RlcoreError(f"{name} has shape {tuple(tensor.shape)}; logprobs has {tuple(logprobs.shape)}")
    if importance_sampling_ratio is not None and importance_sampling_ratio.shape not in (
        logprobs.shape, (logprobs.shape[0], 1)
    ):
        raise RlcoreError(
            f"importance_sampling_ratio must be [B, T] or [B, 1]; got shape {tuple(importance_sampling_ratio.shape)} "
            f"for logprobs {tuple(logprobs.shape)}"
        )
    if advantages.shape not in ((logprobs.shape[0],), logprobs.shape):
        raise RlcoreError(f"advantages must be [B] = [{logprobs.shape[0]}] or [B, T] = {list(logprobs.shape)}; got shape "
                          f"{tuple(advantages.shape)}")
    if beta != 0.0 and ref_logprobs is None:
        raise RlcoreError(f"beta={beta} needs ref_logprobs (the reference model's log-probs); pass them or set beta=0")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise RlcoreError("loss_type 'dr_grpo' needs max_completion_length (it divides by B * max_completion_length)")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: LossType = "grpo",
    importance_sampling_level: Literal["token", "sequence"] = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | None = None,
    num_sequences_in_batch: float | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss with an optional k3 KL penalty; returns (loss, metrics).

    `epsilon` / `epsilon_high` clip the ratio to [1 - epsilon, 1 + epsilon_high] (DAPO's clip-higher;
    `epsilon_high` defaults to `epsilon`); `delta` caps the unclipped ratio too (TRL's two-sided clipping).
    `importance_sampling_level="sequence"` uses one ratio per sequence, exp of the masked mean log-ratio
    (GSPO). `importance_sampling_ratio` (from `sampler_importance_ratio`) weights the per-token policy loss;
    `use_bias_correction_kl` multiplies the KL term by the policy ratio (TRL's default). Metrics, named as
    TRL logs them: `kl` (when `ref_logprobs` is given; with the bias correction, as TRL logs it),
    `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`; each a masked mean over this
    call's tokens.
    """
    _check(logprobs, old_logprobs, advantages, mask, ref_logprobs, importance_sampling_ratio, beta, loss_type,
           importance_sampling_level, max_completion_length)
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B, 1] per sequence, or [B, T] per token
    epsilon_low = epsilon
    epsilon_high = epsilon if epsilon_high is None else epsilon_high

    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    coef_1 = torch.exp(log_ratio)

    per_token_kl = None
    if ref_logprobs is not None:
        diff = ref_logprobs - logprobs
        per_token_kl = torch.exp(diff) - diff - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio.to(per_token_loss.dtype)
    if per_token_kl is not None and beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl

    rows = num_sequences_in_batch if num_sequences_in_batch is not None else logprobs.shape[0]
    tokens = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1.0)
    masked = per_token_loss * mask  # broadcasts a [B, 1] sequence-level loss over the tokens
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / rows
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (rows * max_completion_length)
    else:  # bnpo, dapo
        loss = masked.sum() / tokens

    return loss, _metrics(coef_1, adv, mask, per_token_kl, epsilon_low, epsilon_high)


def _metrics(
    coef_1: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    per_token_kl: torch.Tensor | None,
    epsilon_low: float,
    epsilon_high: float,
) -> dict[str, torch.Tensor | float]:
    """TRL's logged statistics, on this call's tokens (per sequence when the ratio is per sequence); 0-dim
    tensors, which an engine reads once its step is done (reading each here would wait for the GPU)."""
    with torch.no_grad():

        def masked_mean(x: torch.Tensor) -> torch.Tensor | float:
            if x.shape[1] == 1:  # one value per sequence
                return x.mean() if x.numel() else 0.0
            return (x * mask).sum() / mask.sum().clamp(min=1.0)

        low = ((coef_1 < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((coef_1 > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        metrics = {
            "clip_ratio/low_mean": masked_mean(low),
            "clip_ratio/high_mean": masked_mean(high),
            "clip_ratio/region_mean": masked_mean(torch.maximum(low, high)),
        }
        if per_token_kl is not None:
            metrics["kl"] = masked_mean(per_token_kl)
    return metrics
