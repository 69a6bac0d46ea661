"""A causal LM's output layer applied in chunks of positions, as pure functions of tensors: per-token log-probs,
log-probs at given ids, top-k and the full log-softmax of last hidden states [N, H] through the head
(`weight` [V, H], `bias` [V] or None), at a temperature, without [N, V] logits for all N rows at once.

Per-token log-probs (what GRPO, SFT and every forward-only pass need) go through TRL's `ChunkedLogProbFunction`
(`trl/kernels/chunked_logprob.py`: cuBLAS tiles folded by a Triton kernel) on a CUDA device with Triton where
TRL is installed (`use_trl` None; True forces it, also on the CPU, where TRL folds the tiles with torch ops and
is slower than the chunks here); otherwise, and for the rest, torch ops over chunks of `chunk` rows, each
recomputed in backward (`torch.utils.checkpoint`), so memory holds one [chunk, V] block at a time.
The logits of a chunk are computed in the hidden states' dtype, as the model's own `lm_head` computes them.
A LoRA adapter on the head (`HeadAdapter`) adds scale * (h @ A^T) @ B^T to each chunk's logits beside the base
weight's, so no merged [V, H] weight is formed; TRL's kernel, which reads one weight, is then not used.
`HeadModelOutputs` is the `ModelOutputs` of these functions, which the hf engine and the megatron engine (tensor
size 1) give a loss when `chunked_lm_head` is on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .batch import copy_to
from .engine_checks import check_ids
from .engines import ModelOutputs, Projection, TopK
from .memory_terms import CHUNK_ROWS

TRL_VOCAB_CHUNK = 32768  # the vocabulary width of TRL's tiles, as TRL's own trainers use it


def trl_logprob_function() -> type | None:
    """TRL's `ChunkedLogProbFunction`, or None where TRL (>= 1.16) is not installed."""
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction


def triton_device(device: torch.device) -> bool:
    """Where TRL's kernels run as Triton kernels: a CUDA or XPU device with Triton installed."""
    import importlib.util

    return device.type in ("cuda", "xpu") and importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class HeadAdapter:
    """A LoRA adapter on the LM head: the logits gain `scale` * (dropout(h) @ a^T) @ b^T, `a` [r, H] and `b` [V, r]
    (peft's lora_A and lora_B weights), applied per chunk so the merged weight never exists. `dropout` is the
    probability while training (0 in evaluation); a checkpointed chunk recomputes the same mask (torch restores
    the RNG state)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    dropout: float = 0.0

    def low_rank(self, hidden: torch.Tensor) -> torch.Tensor:
        """dropout(h) @ a^T, [N, r], in `hidden`'s dtype."""
        x = F.dropout(hidden, self.dropout) if self.dropout else hidden
        return F.linear(x, self.a.to(hidden.dtype))


def _head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          adapter: HeadAdapter | None = None) -> torch.Tensor:
    """The logits in the hidden states' dtype, as the model's own `lm_head` computes them (with its adapter's
    low-rank term, as peft's `lora.Linear` adds it)."""
    logits = F.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))
    if adapter is not None:
        logits = logits + F.linear(adapter.low_rank(hidden), adapter.b.to(hidden.dtype)) * adapter.scale
    return logits


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature if temperature != 1.0 else logits


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
            adapter: HeadAdapter | None = None) -> torch.Tensor:
    return _scaled(_head(hidden, weight, bias, adapter).float(), temperature)


def _by_chunks(fn: Callable[..., torch.Tensor], hidden: torch.Tensor, *row_args: torch.Tensor | None,
               head: tuple, chunk: int) -> torch.Tensor:
    """`fn(hidden_chunk, *row_arg_chunks, *head)` over chunks of rows, concatenated; checkpointed when a
    gradient is wanted (the chunk's [chunk, V] intermediates are recomputed in backward, not kept)."""
    chunk = chunk or CHUNK_ROWS
    tensors = [t for h in head for t in ((h.a, h.b) if isinstance(h, HeadAdapter) else (h,))]
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors))
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        args = (hidden[rows], *(a[rows] for a in row_args), *head)
        parts.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    if not parts:
        return hidden.new_zeros((0,), dtype=torch.float32)
    return torch.cat(parts)


def _token_logprobs(hidden, targets, weight, bias, temperature, adapter):
    logits = _logits(hidden, weight, bias, temperature, adapter)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _logprobs_at(hidden, ids, weight, bias, temperature, adapter):
    logits = _logits(hidden, weight, bias, temperature, adapter)
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                   temperature: float = 1.0, chunk: int | None = None, use_trl: bool | None = None,
                   adapter: HeadAdapter | None = None) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[targets]: [N] float32, differentiable in `hidden` and the head.
    `use_trl` None: TRL's kernel on a Triton device where TRL is installed and the head has no adapter; False:
    the torch chunks."""
    targets = targets.long()
    function = trl_logprob_function() if use_trl or (use_trl is None and triton_device(hidden.device)) else None
    if use_trl and function is None:
        raise ImportError("token_logprobs(use_trl=True) needs trl >= 1.16 (trl.kernels.chunked_logprob)")
    if use_trl and adapter is not None:
        raise ValueError("token_logprobs(use_trl=True): TRL's kernel reads one head weight; a head with a LoRA "
                         "adapter runs the torch chunks (use_trl None or False)")
    if function is not None and adapter is None and hidden.shape[0] > 0:
        return function.apply(hidden.contiguous(), weight, bias, targets.contiguous(), float(temperature),
                              min(TRL_VOCAB_CHUNK, weight.shape[0]), None, 1.0, ())[0]
    return _by_chunks(_token_logprobs, hidden, targets, head=(weight, bias, temperature, adapter), chunk=chunk)


def logprobs_at(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                temperature: float = 1.0, chunk: int | None = None, adapter: HeadAdapter | None = None) -> torch.Tensor:
    """Log-probs [N, k] at `ids` [N, k], normalised over the whole vocabulary; differentiable."""
    return _by_chunks(_logprobs_at, hidden, ids.long(), head=(weight, bias, temperature, adapter),
                      chunk=chunk).view(ids.shape)


def _logits_at(hidden, ids, weight, bias, temperature, adapter):
    # float32: the head's gradient sums each id's rows (a common token is in many rows' top-k) in float32
    picked = torch.einsum("nh,nkh->nk", hidden.float(), weight[ids].float())
    if bias is not None:
        picked = picked + bias[ids].float()
    if adapter is not None:
        low_rank = torch.einsum("nr,nkr->nk", adapter.low_rank(hidden).float(), adapter.b[ids].float())
        picked = picked + low_rank * adapter.scale
    return picked / temperature if temperature != 1.0 else picked


def logits_at(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
              temperature: float = 1.0, chunk: int | None = None, adapter: HeadAdapter | None = None) -> torch.Tensor:
    """The logits [N, k] at `ids` [N, k], divided by `temperature`: `logprobs_at` without the normaliser over the
    vocabulary (each row off by its logsumexp), from the k rows of the head alone; differentiable."""
    return _by_chunks(_logits_at, hidden, ids.long(), head=(weight, bias, temperature, adapter),
                      chunk=chunk).view(ids.shape)


def topk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                  temperature: float = 1.0, chunk: int | None = None,
                  adapter: HeadAdapter | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probs [N, k] (float32, best first) and their ids [N, k]; no gradient."""
    values, ids, chunk = [], [], chunk or CHUNK_ROWS
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk):
            # the k largest of the logits in the model's dtype (a log-softmax keeps their order), less the
            # normaliser: no [chunk, V] log-softmax is written, and topk reads half the bytes
            logits = _head(hidden[start : start + chunk], weight, bias, adapter)
            top = logits.topk(k, -1)
            values.append(_scaled(top.values.float(), temperature)
                          - torch.logsumexp(_scaled(logits.float(), temperature), -1, keepdim=True))
            ids.append(top.indices)
    if not values:
        return hidden.new_zeros((0, k), dtype=torch.float32), torch.zeros((0, k), dtype=torch.long, device=hidden.device)
    return torch.cat(values), torch.cat(ids)


def full_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float = 1.0, adapter: HeadAdapter | None = None) -> torch.Tensor:
    """The whole log-softmax [N, V] (float32): what a loss that reads every probability needs."""
    return torch.log_softmax(_logits(hidden, weight, bias, temperature, adapter), dim=-1)


class HeadModelOutputs(ModelOutputs):
    """`ModelOutputs` from a causal LM's last hidden states [B, T, H] and its LM head: every result is computed
    through this module's functions in chunks of positions, on the rows that hold a distribution only (not row
    0, not padding), so no [B, T, V] tensor exists unless `full_logprobs` is asked for. Same values as
    `HFModelOutputs` of the logits the head would give. `lm_head` has `weight` and `bias`, and `adapter` (a
    `HeadAdapter`) where a LoRA adapter on the head adds its term.

    The rows are picked by position (`index_select` / `index_copy`), not by a boolean mask: with `host_mask`
    (the attention mask on the CPU, as `Batch.host` keeps it) the positions are found there and the GPU's
    queue never drains for them; without it they are found once on the device."""

    def __init__(self, hidden: torch.Tensor, lm_head: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 temperature: float = 1.0, use_trl: bool | None = None, host_mask: torch.Tensor | None = None):
        self.hidden = hidden[:, :-1]  # position t-1 predicts token t
        self.weight, self.bias = lm_head.weight, lm_head.bias
        self.adapter: HeadAdapter | None = getattr(lm_head, "adapter", None)
        self.input_ids = input_ids
        self.valid = attention_mask.bool().clone()
        self.valid[:, 0] = False
        self.temperature = temperature
        self.use_trl = use_trl
        self._host_mask = host_mask
        self._cache: dict[str, torch.Tensor] = {}

    def _positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions in [B, T] of the rows that hold a distribution, their predicting rows' flat positions
        in the [B, T-1] hidden states), in row-major order, on the device."""
        if "positions" not in self._cache:
            B, T = self.valid.shape
            valid = self.valid
            if self._host_mask is not None:
                valid = self._host_mask.bool().clone()
                valid[:, 0] = False
            positions = copy_to(valid.reshape(-1).nonzero().squeeze(1), self.valid.device)
            self._cache["positions"] = positions
            self._cache["rows"] = positions - positions // T - 1  # (b, t) -> b * (T - 1) + t - 1
        return self._cache["positions"], self._cache["rows"]

    def _rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The predicting rows [N, ...] of a [B, T-1, ...] tensor (the hidden states)."""
        return tensor.reshape(-1, *tensor.shape[2:]).index_select(0, self._positions()[1])

    def _at(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rows [N, ...] of a [B, T, ...] tensor aligned with input_ids (ids asked about)."""
        return tensor.reshape(-1, *tensor.shape[2:]).index_select(0, self._positions()[0])

    def _scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Values of the predicting rows ([N, ...]) as [B, T, ...] aligned with input_ids, 0 elsewhere."""
        B, T = self.valid.shape
        out = values.new_zeros(B * T, *values.shape[1:])
        return out.index_copy(0, self._positions()[0], values).view(B, T, *values.shape[1:])

    def logprobs(self) -> torch.Tensor:
        if "logprobs" not in self._cache:
            targets = self._at(self.input_ids)
            values = token_logprobs(self._rows(self.hidden), self.weight, self.bias, targets, self.temperature,
                                    use_trl=self.use_trl, adapter=self.adapter)
            self._cache["logprobs"] = self._scatter(values)
        return self._cache["logprobs"]

    def logprobs_at(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.input_ids)
        ids = self._at(ids.to(self.hidden.device, non_blocking=True))
        return self._scatter(logprobs_at(self._rows(self.hidden), self.weight, self.bias, ids, self.temperature,
                                         adapter=self.adapter))

    def logits_at(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.input_ids)
        ids = self._at(ids.to(self.hidden.device, non_blocking=True))
        return self._scatter(logits_at(self._rows(self.hidden), self.weight, self.bias, ids, self.temperature,
                                       adapter=self.adapter))

    def full_logprobs(self) -> torch.Tensor:
        if "full" not in self._cache:
            self._cache["full"] = self._scatter(full_logprobs(self._rows(self.hidden), self.weight, self.bias,
                                                              self.temperature, self.adapter))
        return self._cache["full"]

    def topk(self, k: int) -> TopK:
        """The k most likely tokens of every row, in `TopK`'s layout (ids 0 where a row holds no distribution)."""
        values, ids = topk_logprobs(self._rows(self.hidden), self.weight, self.bias,
                                    min(k, self.weight.shape[0]), self.temperature, adapter=self.adapter)
        return TopK(ids=self._scatter(ids), logprobs=self._scatter(values))

    def projection(self) -> Projection | None:
        """The hidden states aligned with input_ids (row t: the state that predicts token t; 0 where a row holds
        no distribution) and the head: a shift and a mask, no index to find. None where the head has an adapter
        (a `Projection` is one weight; the loss then reads `full_logprobs`)."""
        if self.adapter is not None:
            return None
        shifted = torch.cat([self.hidden.new_zeros(self.hidden.shape[0], 1, self.hidden.shape[2]), self.hidden], 1)
        return Projection(hidden=shifted * self.valid[..., None].to(shifted.dtype), weight=self.weight, bias=self.bias)


__all__ = ["CHUNK_ROWS", "TRL_VOCAB_CHUNK", "HeadAdapter", "HeadModelOutputs", "triton_device", "trl_logprob_function"]
