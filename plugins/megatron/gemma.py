"""Gemma 3 (text) on megatron-core's local layer spec, each piece matching transformers' modeling_gemma3.py:

- sandwich norms: `SandwichSelfAttention` and `SandwichMLP` are megatron's `SelfAttention` and `MLP` with a norm on
  their output (`post_layernorm`: transformers' post_attention_layernorm and post_feedforward_layernorm), applied
  before the residual add; the input and pre-MLP norms are the layer's own (input_layernorm, pre_mlp_layernorm);
- every norm (those, q/k per head, the final one) x / rms(x) * (1 + w) in float32 (`ZeroCenteredRMSNorm`);
- sliding-window layers: their core attention sees the last `sliding_window` positions (`attention.sliding_windows`)
  and turns queries and keys with a rotary embedding of their own base (rope_parameters' sliding_attention theta);
  full layers keep the model's rotary embedding (the full_attention theta);
- the embedding output times sqrt(hidden_size) in the model's dtype (`scale_embeddings`), gelu_tanh in the gated
  MLP and the softmax scale query_pre_attn_scalar ** -0.5 come from the engine's TransformerConfig.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from .attention import set_mlp
from .linear_attention import ZeroCenteredRMSNorm


class SandwichSelfAttention(SelfAttention):
    """`SelfAttention` whose output passes through `post_layernorm`; a layer of `local_layers` (global 1-based
    numbers, a subclass's) turns queries and keys with its own rotary embedding of base `local_rope_theta`."""

    local_layers: frozenset[int] = frozenset()
    local_rope_theta: float = 10000.0

    def __init__(self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.post_layernorm = ZeroCenteredRMSNorm(config, config.hidden_size, config.layernorm_epsilon)
        self.local_rope = None
        if layer_number in self.local_layers:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            self.local_rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                              rotary_base=self.local_rope_theta, use_cpu_initialization=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        rotary = kwargs.get("rotary_pos_emb")
        if self.local_rope is not None and rotary is not None:
            kwargs["rotary_pos_emb"] = self.local_rope(rotary.shape[0])
        out, bias = super().forward(hidden_states, attention_mask, *args, **kwargs)
        return self.post_layernorm(out), bias


class SandwichMLP(MLP):
    """megatron's `MLP` whose output passes through `post_layernorm` (the engine builds it bias-free)."""

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_layernorm = ZeroCenteredRMSNorm(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(out), bias


def gemma_block_spec(layer_spec: Any, stage_layers: int, layer_types: Sequence[str], local_rope_theta: float) -> Any:
    """A megatron block spec (`TransformerBlockSubmodules`) of a pipeline stage's `stage_layers` layers from the
    engine's transformer-layer spec (its core attention already windowed, `attention.sliding_windows`); `layer_types`
    are every layer's ("attention" or "sliding_attention"), by global index."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = copy.deepcopy(layer_spec)
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = ZeroCenteredRMSNorm
    local = frozenset(i + 1 for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    layer.self_attention.module = type("GemmaSelfAttention", (SandwichSelfAttention,),
                                       {"local_layers": local, "local_rope_theta": local_rope_theta})
    attention = layer.self_attention.submodules
    attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
    set_mlp(layer, SandwichMLP)
    return TransformerBlockSubmodules(layer_specs=[spec] * stage_layers, layer_norm=ZeroCenteredRMSNorm)


def scale_embeddings(module: Any, hidden_size: int) -> None:
    """The first stage's embedding output times sqrt(hidden_size), rounded to the output's dtype first as
    transformers' `Gemma3TextScaledWordEmbedding` rounds it."""

    def scale(_: Any, __: Any, output: torch.Tensor) -> torch.Tensor:
        return output * torch.tensor(hidden_size ** 0.5).to(output.dtype)

    module.embedding.register_forward_hook(scale)
