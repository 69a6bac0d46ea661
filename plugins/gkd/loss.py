"""The generalized Jensen-Shannon divergence of GKD (Agarwal et al., 2024; TRL's `GKDTrainer.generalized_jsd_loss`),
as pure functions of tensors.

Per token, with S = softmax(z_s / T) the student's and P = softmax(z_t / T) the teacher's distribution and
M = beta P + (1 - beta) S: `beta KL(P || M) + (1 - beta) KL(S || M)`. beta 0 is KL(P || S) (forward KL),
beta 1 is KL(S || P) (reverse KL). Summed over the vocabulary, averaged over the tokens of `mask`.

- `jsd_loss`: full vocabulary, from logits [B, T, V]; computed in chunks of tokens (recomputed in backward),
  so the intermediate tensors never grow with B x T x V beyond the inputs themselves.
- `topk_jsd_loss`: the teacher's k most likely tokens only: the student's logits are gathered at the
  teacher's ids, both sides are divided by T and renormalised over those k; positions where the teacher
  gave nothing (ids and log-probs all 0: row 0 and padding of a `TopK`) are left out.
- `projected_jsd_sum`: full vocabulary from both models' last hidden states and LM heads, the heads applied
  in chunks of positions, so neither model's [B, T, V] logits exist (TRL's `ChunkedDivergenceFunction` where
  TRL is installed, else checkpointed torch chunks); what a colocated teacher's train step uses.
- `generalized_jsd`: the per-token divergence of two distributions already normalised over the last dim,
  what both build on and what a train engine's loss calls with its own log-probs.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlcore import RlcoreError

CHUNK_TOKENS = 1024  # tokens per chunk of the full-vocabulary loss


def _check_beta(beta: float, temperature: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise RlcoreError(f"beta={beta!r} must be in [0, 1] (0: forward KL, 1: reverse KL)")
    if not temperature > 0:
        raise RlcoreError(f"temperature={temperature!r} must be > 0")


def generalized_jsd(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Per-position divergence (summed over the last dim) of two log-distributions normalised over that dim."""
    if beta == 0:
        return (teacher_logprobs.exp() * (teacher_logprobs - student_logprobs)).sum(-1)
    if beta == 1:
        return (student_logprobs.exp() * (student_logprobs - teacher_logprobs)).sum(-1)
    # Python floats, not a tensor made on the device (a copy from the host that waits for the GPU's queue)
    mixture = torch.logsumexp(torch.stack([student_logprobs + math.log1p(-beta), teacher_logprobs + math.log(beta)]), dim=0)
    kl_teacher = (teacher_logprobs.exp() * (teacher_logprobs - mixture)).sum(-1)
    kl_student = (student_logprobs.exp() * (student_logprobs - mixture)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def _chunk_jsd_sum(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, beta: float,
                   temperature: float, normalised: bool) -> torch.Tensor:
    """Sum over one chunk of tokens [n, V] of weight x divergence."""
    s, t = student.float(), teacher.float()
    if not normalised:
        s, t = F.log_softmax(s / temperature, dim=-1), F.log_softmax(t / temperature, dim=-1)
    return (generalized_jsd(s, t, beta) * weight).sum()


def jsd_sum(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, beta: float = 0.5,
            temperature: float = 1.0, normalised: bool = False, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The divergence summed over the tokens of `mask` ([B, T]), full vocabulary, in chunks of `chunk_tokens`.

    `student` and `teacher` are [B, T, V] logits, or log-probs at the loss's temperature with `normalised=True`
    (what a train engine's `full_logprobs()` and a forward engine give). With gradients on, each chunk is
    recomputed in backward, so memory holds no [B, T, V] intermediate.
    """
    _check_beta(beta, temperature)
    if student.shape != teacher.shape or student.shape[:2] != mask.shape:
        raise RlcoreError(
            f"jsd: student {list(student.shape)}, teacher {list(teacher.shape)} and mask {list(mask.shape)} "
            "must be [B, T, V], [B, T, V] and [B, T]"
        )
    V = student.shape[-1]
    s, t, w = student.reshape(-1, V), teacher.reshape(-1, V), mask.reshape(-1).to(torch.float32)
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, s.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        if not bool(w[rows].any()):
            continue
        args = (s[rows], t[rows], w[rows], beta, temperature, normalised)
        if torch.is_grad_enabled() and (student.requires_grad or teacher.requires_grad):
            total = total + checkpoint(_chunk_jsd_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_jsd_sum(*args)
    return total


def trl_divergence_function() -> type | None:
    """TRL's `ChunkedDivergenceFunction` (`trl/kernels/chunked_divergence.py`, TRL >= 1.16), or None."""
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    except ImportError:
        return None
    return ChunkedDivergenceFunction


def _projected_chunk_sum(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_weight: torch.Tensor,
                         student_bias: torch.Tensor | None, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
                         beta: float, temperature: float) -> torch.Tensor:
    def logits(hidden, weight, bias):
        return F.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))

    s, t = logits(student_hidden, student_weight, student_bias), logits(teacher_hidden, teacher_weight, teacher_bias)
    return _chunk_jsd_sum(s, t, s.new_ones(s.shape[0], dtype=torch.float32), beta, temperature, normalised=False)


def projected_jsd_sum(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: torch.Tensor | None,
                      teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
                      beta: float = 0.5, temperature: float = 1.0, chunk_tokens: int | None = None,
                      use_trl: bool | None = None) -> torch.Tensor:
    """The divergence summed over N positions, full vocabulary, from hidden states [N, H_s] / [N, H_t] (the
    rows to score, one per token) and each model's LM head ([V, H] weight, [V] bias or None): logits are
    `hidden @ weight.T + bias`, divided by `temperature`. Gradients reach the student's hidden states and head.

    Equals `jsd_sum` of the logits the heads give, without holding them: TRL's `ChunkedDivergenceFunction`
    (`use_trl` None: on a CUDA device with Triton where TRL is installed, True: anywhere; it projects in fp32 on
    [4096, 32768] tiles), else chunks of `chunk_tokens` rows recomputed in backward.
    """
    _check_beta(beta, temperature)
    if student_hidden.shape[0] != teacher_hidden.shape[0] or student_weight.shape[0] != teacher_weight.shape[0]:
        raise RlcoreError(
            f"projected jsd: student hidden {list(student_hidden.shape)} / head {list(student_weight.shape)} and teacher "
            f"hidden {list(teacher_hidden.shape)} / head {list(teacher_weight.shape)} need the same rows and vocabulary"
        )
    if student_hidden.shape[0] == 0:
        return student_hidden.new_zeros((), dtype=torch.float32) + 0 * student_weight.sum()
    on_triton = student_hidden.device.type in ("cuda", "xpu") and importlib.util.find_spec("triton") is not None
    function = trl_divergence_function() if use_trl or (use_trl is None and on_triton) else None
    if use_trl and function is None:
        raise ImportError("projected_jsd_sum(use_trl=True) needs trl >= 1.16 (trl.kernels.chunked_divergence)")
    teacher_hidden = teacher_hidden.detach()
    if function is not None:
        divergence, _ = function.apply(student_hidden.contiguous(), student_weight, student_bias, teacher_hidden.contiguous(),
                                       teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach(),
                                       float(beta), float(temperature), 1.0, None, 1.0, None)
        return divergence.sum()
    grad = torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad)
    chunk_tokens = chunk_tokens or CHUNK_TOKENS
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, student_hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        args = (student_hidden[rows], teacher_hidden[rows], student_weight, student_bias, teacher_weight.detach(),
                teacher_bias, beta, temperature)
        total = total + (checkpoint(_projected_chunk_sum, *args, use_reentrant=False) if grad else _projected_chunk_sum(*args))
    return total


def jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, beta: float = 0.5,
             temperature: float = 1.0) -> torch.Tensor:
    """The generalized JSD over the full vocabulary, averaged over the tokens of `mask` ([B, T]); logits [B, T, V].

    Equals TRL's `GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature)`
    where `labels` is -100 off the mask.
    """
    return jsd_sum(student_logits, teacher_logits, mask, beta, temperature) / mask.sum().clamp_min(1)


def teacher_given(teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, T] True where the teacher's top-k holds a distribution (a `TopK`'s row 0 and padding are all 0)."""
    return (teacher_logprobs != 0).any(-1) | (teacher_ids != 0).any(-1)


def topk_jsd_terms(student_at_ids: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float = 0.5,
                   student_temperature: float = 1.0, teacher_temperature: float = 1.0) -> torch.Tensor:
    """Per-position divergence [B, T] over the teacher's k ids: each side divided by its temperature and
    renormalised over the k entries. Log-probs or logits alike (a per-row constant drops out)."""
    s = F.log_softmax(student_at_ids.float() / student_temperature, dim=-1)
    t = F.log_softmax(teacher_logprobs.float() / teacher_temperature, dim=-1)
    return generalized_jsd(s, t, beta)


def topk_jsd_loss(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                  mask: torch.Tensor, beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """The generalized JSD over the teacher's top-k tokens, averaged over the tokens of `mask` where the
    teacher gave a distribution. `student_logits` [B, T, V]; `teacher_ids`/`teacher_logprobs` [B, T, k] in the
    `rlcore.TopK` layout (row t: the distribution of token t), `student_logits` aligned the same way.
    With k = V this is `jsd_loss`."""
    _check_beta(beta, temperature)
    if teacher_ids.shape != teacher_logprobs.shape or teacher_ids.shape[:2] != mask.shape:
        raise RlcoreError(
            f"topk jsd: teacher ids {list(teacher_ids.shape)} and log-probs {list(teacher_logprobs.shape)} must be "
            f"[B, T, k] with [B, T] = {list(mask.shape)} (the mask's)"
        )
    student_at_ids = student_logits.gather(-1, teacher_ids.long())
    weight = mask.to(torch.float32) * teacher_given(teacher_ids, teacher_logprobs)
    terms = topk_jsd_terms(student_at_ids, teacher_logprobs, beta, temperature, temperature)
    return (terms * weight).sum() / weight.sum().clamp_min(1)


def sft_sum(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the tokens of `mask`: minus the per-token log-probs [B, T] there."""
    return -(logprobs * mask.to(logprobs.dtype)).sum()
