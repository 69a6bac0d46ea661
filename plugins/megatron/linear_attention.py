"""Qwen3.5's blocks for megatron-core without Transformer Engine: gated delta-net linear attention and what its gated
full attention needs beyond the local spec. Each matches transformers' module (modeling_qwen3_5.py) on the same
weights.

megatron-core 0.16's own `GatedDeltaNet` (megatron/core/ssm/gated_delta_net.py) needs flash-linear-attention at
construction, places its parameters with `torch.cuda.current_device()` and fuses its input projection with Transformer
Engine's layer norm, so it builds neither on the CPU nor from the local spec. Here:

- `GatedDeltaNet`: transformers' `Qwen3_5GatedDeltaNet` as a megatron self-attention module ([T, B, H] in, (out, None)
  back), its parameters named as transformers names them (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
  `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`), so the mapping is one to one. The causal convolution is torch's;
  the chunked gated delta rule is transformers' `torch_chunk_gated_delta_rule`, which itself runs
  flash-linear-attention's Triton kernel where fla is installed and the inputs are on CUDA. Tensor-parallel size 1
  only (`GatedDeltaNet` refuses more).
- `ZeroCenteredRMSNorm`: Qwen3.5's RMSNorm, x / rms(x) * (1 + w) in float32, for every norm of the model (megatron's
  torch norm has no zero-centred gamma).
- `GatedSelfAttention`: megatron's `SelfAttention` with `attention_output_gate` (Qwen3.5's q_proj yields the query and
  a sigmoid gate on the attention output), its gate applied in eager torch: megatron wraps `_apply_output_gate` in
  `torch.compile`, which on the CPU means a C++ toolchain and a compile per shape. The mapping lays transformers'
  q_proj ([query; gate] per head), k_proj and v_proj out as its fused `linear_qkv` ([queries; gates; key; value]
  per query group).
- `hybrid_layer_specs`: each layer's spec (linear or full attention) and the final norm, as a megatron block spec.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule

from .mapping import LINEAR_ATTENTION_TP


class ZeroCenteredRMSNorm(torch.nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and cast back (transformers' `Qwen3_5RMSNorm`); the weight
    starts at zero. Built by megatron's `build_module(spec, config=..., hidden_size=..., eps=...)`."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-6, **_: Any):
        super().__init__()
        self.eps = eps
        dtype = getattr(config, "params_dtype", None)
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(torch.nn.Module):
    """weight * x / rms(x) * silu(gate), over the last dimension (transformers' `Qwen3_5RMSNormGated`)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        hidden = self.weight * hidden.to(dtype)
        return (hidden * F.silu(gate.float())).to(dtype)


def _delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """The chunked gated delta rule over whole sequences from a zero state ([B, T, heads, dim] in and out), q and k
    L2-normalised inside: transformers' function, which is fla's kernel where fla is installed and the inputs are on
    CUDA, and its torch reference otherwise.

    Each query/key head serves `value heads / key heads` consecutive value heads (Qwen3.5 has twice as many value
    heads). q and k are repeated to the value heads here, as transformers' `Qwen3_5GatedDeltaNet.forward` does in
    5.17 before it calls this function; only later releases repeat inside it (5.17's raises a size mismatch)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    groups = value.shape[2] // key.shape[2]
    if groups > 1:
        query, key = query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
    out, _ = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=None,
                                          output_final_state=False, use_qk_l2norm_in_kernel=True)
    return out


class GatedDeltaNet(MegatronModule):
    """Gated delta-net linear attention in megatron's self-attention slot: [T, B, hidden] in, ([T, B, hidden], None)
    out. A causal depthwise convolution (kernel `linear_conv_kernel_dim`, SiLU) over the q/k/v projection, the gated
    delta rule (per value head a decay exp(g) = exp(-exp(A_log) * softplus(a + dt_bias)) and a write strength
    beta = sigmoid(b)), a gated RMSNorm by z and the output projection. Batches are right-padded (the engine's
    layout), so a real token never reads padding and no mask is needed."""

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None, **_: Any):
        super().__init__(config=config)
        if config.tensor_model_parallel_size != 1:
            raise ValueError(LINEAR_ATTENTION_TP)
        if config.context_parallel_size != 1:
            raise ValueError("gated delta-net linear attention does not split sequences (context_parallel_size must be 1)")
        self.layer_number = layer_number
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        hidden, dtype = config.hidden_size, config.params_dtype

        def linear(fan_in: int, fan_out: int) -> torch.nn.Linear:
            return torch.nn.Linear(fan_in, fan_out, bias=False, dtype=dtype)

        # in transformers' order, so that named_parameters lists them as Qwen3_5GatedDeltaNet does
        self.conv1d = torch.nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                      bias=False, padding=self.conv_kernel_size - 1, dtype=dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.num_v_heads, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype).uniform_(1, 16).log())
        self.norm = GatedRMSNorm(self.head_v_dim, config.layernorm_epsilon, dtype)
        self.out_proj = linear(self.value_dim, hidden)
        self.in_proj_qkv = linear(hidden, self.conv_dim)
        self.in_proj_z = linear(hidden, self.value_dim)
        self.in_proj_b = linear(hidden, self.num_v_heads)
        self.in_proj_a = linear(hidden, self.num_v_heads)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, inference_context: Any = None,
                packed_seq_params: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        if packed_seq_params is not None or inference_context is not None:
            raise ValueError("GatedDeltaNet takes neither packed sequences nor an inference context")
        x = hidden_states.transpose(0, 1)  # [B, T, hidden]
        B, T, _ = x.shape
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # [B, conv_dim, T]
        mixed = F.silu(F.conv1d(mixed.to(self.conv1d.weight.dtype), self.conv1d.weight, None,
                                padding=self.conv_kernel_size - 1, groups=self.conv_dim)[..., :T].to(mixed.dtype))
        query, key, value = mixed.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(B, T, self.num_k_heads, self.head_k_dim)
        key = key.reshape(B, T, self.num_k_heads, self.head_k_dim)
        value = value.reshape(B, T, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        core = _delta_rule(query, key, value, g, beta)  # [B, T, v_heads, v_dim]
        z = self.in_proj_z(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)).reshape(B, T, -1)
        return self.out_proj(out).transpose(0, 1).contiguous(), None


class GatedSelfAttention(SelfAttention):
    """megatron's `SelfAttention` for a config with `attention_output_gate`: the attention output times
    sigmoid(gate), in eager torch (megatron's own `_apply_output_gate` is `torch.compile`d)."""

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)


def hybrid_layer_specs(layer_spec: Any, layer_types: Sequence[str]) -> Any:
    """A megatron block spec (`TransformerBlockSubmodules`) for layers of `layer_types` ("attention" or
    "linear_attention"), from the engine's transformer-layer spec: every norm a `ZeroCenteredRMSNorm`, full attention
    a `GatedSelfAttention`, linear attention a `GatedDeltaNet`."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def of(kind: str) -> Any:
        spec = copy.deepcopy(layer_spec)
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if kind == "linear_attention":
            layer.self_attention = ModuleSpec(module=GatedDeltaNet)
        elif kind == "attention":
            layer.self_attention.module = GatedSelfAttention
            attention = layer.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
        else:
            raise ValueError(f"layer kind {kind!r} is not one of attention, linear_attention")
        return spec

    specs = {kind: of(kind) for kind in set(layer_types)}
    return TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in layer_types], layer_norm=ZeroCenteredRMSNorm)
