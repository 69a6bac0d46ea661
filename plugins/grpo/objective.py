"""`PolicyObjective`: the loss function a train engine calls per micro-batch (picklable, for Ray workers).

Where the old log-probs come from, and where TRL's sampler correction takes its ratio, is the experience
maker's decision (`experience.OldLogprobs`): an objective is told `sampler_correction_mode` when the ratio is
taken in the step, from the step's own detached log-probs (the same ratio a separate forward would give; its
metrics are each micro-batch's, averaged over the step); without `old_logprobs` in the batch, the old policy is
the one being trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .loss import batch_normalizers, policy_loss, sampler_importance_ratio


@dataclass(frozen=True)
class PolicyObjective:
    """GRPO's loss on one micro-batch, normalised so that micro-batches and workers sum to the step's loss."""

    beta: float
    epsilon: float
    epsilon_high: float | None
    delta: float | None
    loss_type: str
    importance_sampling_level: str
    max_completion_length: int
    num_items_in_batch: float
    num_sequences_in_batch: float
    use_bias_correction_kl: bool = True
    sampler_correction_mode: str | None = None  # the sampler correction, taken in the step (see the module docstring)
    sampler_clip_min: float | None = None
    sampler_clip_max: float | None = None

    @classmethod
    def for_step(cls, config: Any, step_batch: Any, dp_size: int, round_tokens: float | None = None,
                 steps_per_round: int = 1, correct_in_step: bool = False) -> PolicyObjective:
        """The objective of one optimizer step over `step_batch` (all workers' rows). For dapo, the token
        count is that of the whole generation round spread over the steps it feeds, as TRL does.
        `correct_in_step`: the sampler correction's ratio is taken here (the caller decides, see the module)."""
        norms = batch_normalizers(step_batch["completion_mask"], world_size=dp_size)
        if config.loss_type == "dapo" and round_tokens is not None:
            norms["num_items_in_batch"] = max(round_tokens, 1.0) / steps_per_round / dp_size
        if correct_in_step:
            norms.update(sampler_correction_mode=config.vllm_importance_sampling_mode,
                         sampler_clip_min=config.vllm_importance_sampling_clip_min,
                         sampler_clip_max=config.vllm_importance_sampling_clip_max)
        return cls(
            beta=config.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high, delta=config.delta,
            loss_type=config.loss_type, importance_sampling_level=config.importance_sampling_level,
            max_completion_length=config.max_completion_length, use_bias_correction_kl=config.use_bias_correction_kl,
            **norms,
        )

    def __call__(self, outputs: Any, batch: Any) -> tuple[Any, dict[str, float]]:
        logprobs = outputs.logprobs()
        old = batch["old_logprobs"] if "old_logprobs" in batch else logprobs.detach()
        ratio = batch["importance_sampling_ratio"] if "importance_sampling_ratio" in batch else None
        sampler_metrics: dict[str, float] = {}
        if ratio is None and self.sampler_correction_mode is not None:
            mask = batch["completion_mask"]
            ratio, sampler_metrics = sampler_importance_ratio(
                old, batch["rollout_logprobs"].to(old.device), mask.to(old.device), self.sampler_correction_mode,
                self.sampler_clip_min, self.sampler_clip_max,
            )
            ratio = ratio.expand(mask.shape)
        loss, metrics = policy_loss(
            logprobs, old, batch["advantages"], batch["completion_mask"],
            ref_logprobs=batch["ref_logprobs"] if "ref_logprobs" in batch else None,
            beta=self.beta, epsilon=self.epsilon, epsilon_high=self.epsilon_high, delta=self.delta,
            loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
            max_completion_length=self.max_completion_length, num_items_in_batch=self.num_items_in_batch,
            num_sequences_in_batch=self.num_sequences_in_batch, use_bias_correction_kl=self.use_bias_correction_kl,
            importance_sampling_ratio=ratio,
        )
        return loss, {**metrics, **sampler_metrics}
