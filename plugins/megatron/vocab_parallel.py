"""Log-probs from vocabulary-parallel logits: each tensor rank holds [B, T, V/tp] columns of the output
layer, and per-token log-probs, log-probs at given ids, top-k and full-vocabulary KL are computed with
reductions of [B, T] or [B, T, k] tensors across the tensor group; [B, T, V] never exists on one rank
(except in `full_logprobs`, which the contract asks for and which therefore gathers).

The reductions are differentiable and pair as megatron's do: a sum of rank-local partials into a value every
rank holds passes its gradient through unchanged (`reduce_from_tensor_model_parallel_region`), and that value
(the normaliser) entering rank-local work again sums its gradient over the ranks (`copy_to_...`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlcore.engines import ModelOutputs, TopK, aligned_rows, check_ids


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllGatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rank = dist.get_rank(ctx.group)
        return grad[..., rank * ctx.width:(rank + 1) * ctx.width].contiguous(), None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over `group`, differentiable (identity backward); `group=None` or size 1: `x` itself."""
    return x if _group_size(group) == 1 else _AllReduceSum.apply(x, group)


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`x` (the same on every rank) where it enters rank-local work: identity forward, and backward sums the
    ranks' partial gradients (megatron's `copy_to_tensor_model_parallel_region`)."""
    return x if _group_size(group) == 1 else _CopyToGroup.apply(x, group)


def all_gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate the ranks' `x` along the last dim, differentiable (each rank keeps its slice's grad)."""
    return x if _group_size(group) == 1 else _AllGatherLast.apply(x, group)


class VocabParallelOutputs(ModelOutputs):
    """`ModelOutputs` of one micro-batch from this tensor rank's logits shard [B, T, V_shard].

    `vocab_size` is the tokenizer's (columns past it are megatron's padding and are excluded); `group` is the
    tensor-parallel group (None: one rank holds the whole vocabulary).
    """

    def __init__(self, logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 vocab_size: int, group: Any = None, temperature: float = 1.0):
        self.group = group
        self.tp = _group_size(group)
        rank = dist.get_rank(group) if self.tp > 1 else 0
        width = logits.shape[-1]
        self.start = rank * width
        self.vocab_size = vocab_size
        self.input_ids = input_ids
        self.valid = attention_mask.bool().clone()  # rows that hold a distribution: not row 0, not padding
        self.valid[:, 0] = False
        scaled = logits[:, :-1].float()
        if temperature != 1.0:
            scaled = scaled / temperature
        pad = max(0, self.start + width - vocab_size)
        if pad:  # megatron's padded vocabulary rows: never a token
            keep = torch.arange(width, device=logits.device) < width - pad
            scaled = scaled.masked_fill(~keep, float("-inf"))
        self.shard = scaled  # [B, T-1, V_shard]
        self._cache: dict[str, Any] = {}

    # -- reductions across the vocabulary -----------------------------------------------------------

    def _lse(self) -> torch.Tensor:
        """logsumexp over the whole vocabulary, [B, T-1]."""
        if "lse" not in self._cache:
            with torch.no_grad():
                top = self.shard.max(dim=-1).values
                if self.tp > 1:
                    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
                top = torch.nan_to_num(top, neginf=0.0)  # a shard of padding only
            total = all_reduce_sum((self.shard - top[..., None]).exp().sum(dim=-1), self.group)
            self._cache["lse"] = top + total.log()
        return self._cache["lse"]

    def _at(self, ids: torch.Tensor) -> torch.Tensor:
        """Scaled logits at global `ids` [B, T-1, k], summed over the ranks that hold them."""
        local = ids - self.start
        here = (local >= 0) & (local < self.shard.shape[-1])
        picked = self.shard.gather(-1, local.clamp(0, self.shard.shape[-1] - 1)).masked_fill(~here, 0.0)
        return all_reduce_sum(picked, self.group)

    def _local_lse(self) -> torch.Tensor:
        """The normaliser as rank-local per-column work uses it (its gradient summed over the ranks)."""
        return copy_to_group(self._lse(), self.group)[..., None]

    def _aligned(self, values: torch.Tensor) -> torch.Tensor:
        return aligned_rows(values, self.valid)

    # -- the contract -------------------------------------------------------------------------------

    def logprobs(self) -> torch.Tensor:
        if "logprobs" not in self._cache:
            picked = self._at(self.input_ids[:, 1:, None]).squeeze(-1)
            self._cache["logprobs"] = self._aligned(picked - self._lse())
        return self._cache["logprobs"]

    def logprobs_at(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.input_ids)
        ids = ids[:, 1:].to(self.shard.device, non_blocking=True).long()
        return self._aligned(self._at(ids) - self._lse()[..., None])

    def shard_logprobs(self) -> torch.Tensor:
        """This rank's columns of the full log-probs, [B, T, V_shard] aligned (padding columns -inf)."""
        return self._aligned(self.shard - self._local_lse())

    def full_logprobs(self) -> torch.Tensor:
        """[B, T, V]: the shards gathered (the one result that is vocabulary-sized on every rank)."""
        if "full" not in self._cache:
            gathered = all_gather_last(self.shard - self._local_lse(), self.group)[..., : self.vocab_size]
            self._cache["full"] = self._aligned(gathered)
        return self._cache["full"]

    def kl_to(self, target_logprobs: torch.Tensor) -> torch.Tensor:
        """Forward KL(target || model) per token, [B, T], over the full vocabulary, vocab-parallel:
        `target_logprobs` [B, T, V] (e.g. a colocated teacher's) is cut to this rank's columns and only the
        per-token sums are reduced across ranks."""
        width = self.shard.shape[-1]
        end = min(self.start + width, self.vocab_size)
        target = target_logprobs[:, 1:, self.start:end].to(self.shard.device).float()
        model = (self.shard - self._local_lse())[..., : end - self.start]
        terms = torch.where(target > float("-inf"), target.exp() * (target - model), torch.zeros_like(target))
        return self._aligned(all_reduce_sum(terms.sum(dim=-1), self.group)[..., None]).squeeze(-1)

    def topk(self, k: int) -> TopK:
        """The k most likely tokens of every row (a top-k per shard, then over the tp * k candidates)."""
        k = min(k, self.vocab_size)
        if ("topk", k) in self._cache:
            return self._cache[("topk", k)]
        local = self.shard - self._local_lse()
        values, index = local.topk(min(k, local.shape[-1]), dim=-1)
        ids = index + self.start
        if self.tp > 1:
            values = all_gather_last(values.detach(), self.group)
            ids = all_gather_last(ids, self.group)
            values, pick = values.topk(k, dim=-1)
            ids = ids.gather(-1, pick)
        values, ids = self._aligned(values), self._aligned(ids)
        self._cache[("topk", k)] = TopK(ids=ids.masked_fill(~self.valid[..., None], 0).long(), logprobs=values)
        return self._cache[("topk", k)]
