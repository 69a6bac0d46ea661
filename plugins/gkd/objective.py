"""`DistillObjective`: the loss a train engine calls per micro-batch (picklable, for Ray workers).

The teacher's side comes from the micro-batch (`teacher_ids` / `teacher_logprobs` columns: a served teacher's
raw top-k) or from a callable the train worker passes (a colocated teacher's forward on the same micro-batch:
its top-k or full log-probs at the loss's temperature, or its last hidden states and LM head, a `Projection`).
The student's side comes from the engine's `ModelOutputs`: `logits_at` the teacher's ids (top-k: the loss
renormalises over the k, so the engine may skip the normaliser over the vocabulary); for the
full vocabulary its `projection()` with a teacher's `Projection` (both heads applied in chunks: no [B, T, V]
tensor for either model), else `full_logprobs`, so a Megatron engine can compute it vocab-parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore import ModelOutputs, TopK
from rlcore.engines import Projection

if TYPE_CHECKING:
    import torch

TeacherFn = Callable[[Any, "int | None", float], "TopK | Projection | torch.Tensor"]


@dataclass(frozen=True)
class DistillObjective:
    """GKD's loss on one micro-batch: (JSD sum + sft_alpha x cross-entropy sum) / num_items_in_batch, so that
    micro-batches and data-parallel workers add up to the step's token mean."""

    beta: float
    temperature: float
    topk: int | None
    sft_alpha: float = 0.0  # > 0 only on steps whose completions are the dataset's
    num_items_in_batch: float = 1.0  # the step's completion tokens over all workers / data-parallel size

    def divergence(self, outputs: ModelOutputs, batch: Any, teacher: TeacherFn | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the per-token JSD over the completion tokens the teacher covers, their count)."""
        import torch

        from rlcore.batch import nonzero_positions

        from .loss import jsd_sum, projected_jsd_sum, teacher_given, topk_jsd_terms

        mask = batch["completion_mask"].to(torch.float32)
        T = self.temperature
        if teacher is None:  # a served teacher's raw top-k (temperature 1), aligned with input_ids
            ids, raw = batch["teacher_ids"].to(mask.device), batch["teacher_logprobs"].to(mask.device)
            weight = mask * teacher_given(ids, raw)
            terms = topk_jsd_terms(outputs.logits_at(ids), raw, self.beta, 1.0, T)
            return (terms * weight).sum(), weight.sum()
        given = teacher(batch, self.topk, T)  # at temperature T, like the student's outputs
        if isinstance(given, TopK):
            ids, logprobs = given.ids.to(mask.device), given.logprobs.to(mask.device)
            weight = mask * teacher_given(ids, logprobs)
            terms = topk_jsd_terms(outputs.logits_at(ids), logprobs, self.beta, 1.0, 1.0)
            return (terms * weight).sum(), weight.sum()
        if isinstance(given, Projection):
            student = outputs.projection()
            if student is not None:  # both heads in chunks over the completion tokens only
                rows = nonzero_positions(batch, "completion_mask").to(student.hidden.device)

                def at_rows(hidden: torch.Tensor) -> torch.Tensor:
                    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)

                total = projected_jsd_sum(at_rows(student.hidden), student.weight, student.bias,
                                          at_rows(given.hidden.to(student.hidden.device)), given.weight, given.bias,
                                          self.beta, T)
                return total, mask.sum()
            given = projected_logprobs(given, T)
        student = outputs.full_logprobs()
        return jsd_sum(student, given.to(student.device), mask, self.beta, T, normalised=True), mask.sum()

    def __call__(self, outputs: ModelOutputs, batch: Any, teacher: TeacherFn | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        total, tokens = self.divergence(outputs, batch, teacher)
        loss = total
        # tensors, which the engine reads once its step is done (a float here would wait for the GPU)
        metrics = {"jsd": total.detach() / tokens.clamp_min(1.0)}
        if self.sft_alpha > 0:
            from .loss import sft_sum

            mask = batch["completion_mask"]
            ce = sft_sum(outputs.logprobs(), mask)
            loss = loss + self.sft_alpha * ce
            metrics["sft_loss"] = ce.detach() / mask.sum().clamp_min(1)
        return loss / self.num_items_in_batch, metrics


def projected_logprobs(given: Projection, temperature: float) -> torch.Tensor:
    """A teacher's full log-probs [B, T, V] from its `Projection` (where the student's engine has no projection)."""
    import torch
    import torch.nn.functional as F

    hidden = given.hidden
    logits = F.linear(hidden, given.weight.to(hidden.dtype), None if given.bias is None else given.bias.to(hidden.dtype))
    return torch.log_softmax(logits.float() / temperature, dim=-1)


class GivenOutputs(ModelOutputs):
    """`ModelOutputs` over full-vocabulary log-probs already computed (a forward pass outside a train step)."""

    def __init__(self, full: torch.Tensor, input_ids: torch.Tensor):
        self.full, self.input_ids = full, input_ids

    def logprobs(self) -> torch.Tensor:
        return self.full.gather(-1, self.input_ids[..., None].long()).squeeze(-1)

    def logprobs_at(self, ids: torch.Tensor) -> torch.Tensor:
        return self.full.gather(-1, ids.long())

    def full_logprobs(self) -> torch.Tensor:
        return self.full
