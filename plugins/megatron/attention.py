"""The megatron engine's layer spec: megatron-core's local spec (no Transformer Engine, no Apex) with its core
attention replaced by `SdpaAttention`, which runs torch's `scaled_dot_product_attention`, and its MLP by
`SwiGLUMLP`, whose activation keeps only its input for backward.

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

from rlcore import RlcoreError


class SdpaAttention(MegatronModule):
    """Causal core attention through `torch.nn.functional.scaled_dot_product_attention`; megatron's
    `DotProductAttention` interface ([T, B, heads, head_dim] in, [T, B, heads * head_dim] out).

    `windows` (a subclass's, from `sliding_windows`) gives each layer (by megatron's global 1-based layer number) a
    sliding window or None: a query then sees the last `window` positions, itself included, as transformers' sliding
    attention does; that layer takes an explicit [T, T] mask."""

    windows: tuple[int | None, ...] = ()

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
        self.window = self.windows[layer_number - 1] if self.windows else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
                **_: Any) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaAttention takes neither packed sequences nor an attention bias")
        T, B = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [B, heads, T, head_dim]
        mask = None
        if self.window is not None and self.window < T:
            i = torch.arange(T, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=self.grouped,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return out.permute(2, 0, 1, 3).reshape(T, B, -1)


def sliding_windows(windows: tuple[int | None, ...]) -> type:
    """`SdpaAttention` with a sliding window (or None) per layer."""
    return type("SlidingSdpaAttention", (SdpaAttention,), {"windows": tuple(windows)})


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of the fc1 output [..., 2F] (gate first, as megatron stacks them), keeping only that input:
    backward recomputes silu(gate). Megatron's unfused `glu` keeps the input, silu(gate) and a copy of `up`
    (`up + glu_linear_offset`), 2F more per token and layer. The same kernels as autograd runs for `glu`, so the
    values and gradients are the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(x, 2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, up = torch.chunk(x, 2, dim=-1)
        return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)


def _mlp_class() -> type:
    from megatron.core.transformer.mlp import MLP

    class SwiGLUMLP(MLP):
        """megatron's MLP with its SwiGLU activation through `_SwiGLU` (fc1 -> swiglu -> fc2, bias-free as the
        engine builds it); any other configuration takes megatron's own forward."""

        def forward(self, hidden_states: torch.Tensor, per_token_scale: Any = None, **kwargs: Any) -> Any:
            config = self.config
            plain = (config.gated_linear_unit and config.activation_func is F.silu and per_token_scale is None
                     and not config.bias_activation_fusion and not getattr(config, "use_te_activation_func", False)
                     and getattr(config, "glu_linear_offset", 0.0) == 0.0
                     and getattr(config, "activation_func_clamp_value", None) is None)
            if not plain:
                return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
            intermediate, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                intermediate = intermediate + bias
            return self.linear_fc2(_SwiGLU.apply(intermediate))

    return SwiGLUMLP


def moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router gate (`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not
    None`, a name its module only binds when Transformer Engine imports: without it the router raises NameError.
    Bind it to None, which selects the torch matmul path that is already there."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def layer_spec(swiglu: bool = True, qk_norm: bool = False, num_experts: int = 0) -> Any:
    """megatron-core's local GPT layer spec (RMSNorm) with `SdpaAttention` as its core attention and, with
    `swiglu`, `SwiGLUMLP` as its dense MLP. `qk_norm`: RMSNorm over each query and key head (`q_layernorm`,
    `k_layernorm`); `num_experts`: megatron's MoE layer (`TopKRouter`, `SequentialMLP` experts: no grouped GEMM,
    which needs Transformer Engine or the grouped_gemm package) in place of the dense MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts or None, moe_grouped_gemm=False, qk_layernorm=qk_norm,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    if num_experts:
        moe_without_transformer_engine()
    if swiglu and not num_experts:
        set_mlp(spec.submodules, _mlp_class())
    return spec


def set_mlp(layer: Any, cls: type) -> None:
    """Make the transformer-layer submodules `layer` build `cls` (a subclass of megatron's `MLP`) as their dense MLP.

    megatron-core 0.16's local spec holds a `ModuleSpec(module=MLP, submodules=...)` there; 0.19's holds a builder,
    `functools.partial(MLP.as_mlp_submodule, submodules=...)`, on which setting `.module` is silently ignored (Gemma 3's
    `post_layernorm` then went missing). Either form gets `cls` with the same submodules; any other is an error."""
    import functools

    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    mlp = layer.mlp
    if isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type) and issubclass(mlp.module, MLP):
        mlp.module = cls
        return
    owner = getattr(getattr(mlp, "func", None), "__self__", None)
    if isinstance(mlp, functools.partial) and isinstance(owner, type) and issubclass(owner, MLP):
        layer.mlp = functools.partial(getattr(cls, mlp.func.__name__), *mlp.args, **mlp.keywords)
        return
    from importlib.metadata import version

    raise RlcoreError(f"megatron-core {version('megatron-core')}'s layer spec holds {mlp!r} as its dense MLP, neither "
                       "a ModuleSpec of megatron's MLP (0.16) nor MLP.as_mlp_submodule (0.19); rlcore cannot place "
                       f"{cls.__name__} there")
