"""`PolicyObjective`: the loss function a train engine calls per micro-batch (picklable, for Ray workers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .loss import batch_normalizers, policy_loss


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

    @classmethod
    def for_step(cls, config: Any, step_batch: Any, dp_size: int, round_tokens: float | None = None,
                 steps_per_round: int = 1) -> PolicyObjective:
        """The objective of one optimizer step over `step_batch` (all workers' rows). For dapo, the token
        count is that of the whole generation round spread over the steps it feeds, as TRL does."""
        norms = batch_normalizers(step_batch["completion_mask"], world_size=dp_size)
        if config.loss_type == "dapo" and round_tokens is not None:
            norms["num_items_in_batch"] = max(round_tokens, 1.0) / steps_per_round / dp_size
        return cls(
            beta=config.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high, delta=config.delta,
            loss_type=config.loss_type, importance_sampling_level=config.importance_sampling_level,
            max_completion_length=config.max_completion_length, use_bias_correction_kl=config.use_bias_correction_kl,
            **norms,
        )

    def __call__(self, outputs: Any, batch: Any) -> tuple[Any, dict[str, float]]:
        logprobs = outputs.logprobs()
        old = batch["old_logprobs"] if "old_logprobs" in batch else logprobs.detach()
        return policy_loss(
            logprobs, old, batch["advantages"], batch["completion_mask"],
            ref_logprobs=batch["ref_logprobs"] if "ref_logprobs" in batch else None,
            beta=self.beta, epsilon=self.epsilon, epsilon_high=self.epsilon_high, delta=self.delta,
            loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
            max_completion_length=self.max_completion_length, num_items_in_batch=self.num_items_in_batch,
            num_sequences_in_batch=self.num_sequences_in_batch, use_bias_correction_kl=self.use_bias_correction_kl,
            importance_sampling_ratio=batch["importance_sampling_ratio"] if "importance_sampling_ratio" in batch else None,
        )
