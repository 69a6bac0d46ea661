"""The megatron engine's layer spec: megatron-core's local spec (no Transformer Engine, no Apex) with its core
attention replaced by `SdpaAttention`, which runs torch's `scaled_dot_product_attention`.

The local spec's `DotProductAttention` materialises [B, heads, T, T] scores (and a softmax in fp32 beside
them) and repeats the key/value heads for grouped-query attention. SDPA picks a flash or memory-efficient
kernel on CUDA (the math one on the CPU), takes grouped heads as they are (`enable_gqa`) and never holds the
scores. The engine's batches are right-padded (`rlcore.batch.trim_padding`): a real token only ever sees
real tokens before it, so `is_causal=True` is the whole mask and the [T, T] mask tensor is not built at all.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SdpaAttention(MegatronModule):
    """Causal core attention through `torch.nn.functional.scaled_dot_product_attention`; megatron's
    `DotProductAttention` interface ([T, B, heads, head_dim] in, [T, B, heads * head_dim] out)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **_: Any):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaAttention is causal only; the layer spec asked for {attn_mask_type}")
        if config.context_parallel_size != 1:
            raise ValueError("SdpaAttention does not split sequences (context_parallel_size must be 1)")
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.grouped = config.num_query_groups != config.num_attention_heads

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
                **_: Any) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaAttention takes neither packed sequences nor an attention bias")
        T, B = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, heads, T, head_dim]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.grouped,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return out.permute(2, 0, 1, 3).reshape(T, B, -1)


def layer_spec() -> Any:
    """megatron-core's local GPT layer spec (RMSNorm) with `SdpaAttention` as its core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec
