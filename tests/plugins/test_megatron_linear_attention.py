"""Qwen3.5's blocks for megatron-core (plugins/megatron/linear_attention.py) against transformers' modules on the
same weights, float32 on the CPU: the gated delta-net alone, the gated q_proj layout, and whole decoder layers of
both kinds (zero-centred norms, gated full attention with partial rotary, linear attention, MLP)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from transformers import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # noqa: E402

from rlcore.plugins.megatron.attention import layer_spec  # noqa: E402
from rlcore.plugins.megatron.cpu_shim import cpu_current_device, use_cpu_rng_tracker  # noqa: E402
from rlcore.plugins.megatron.linear_attention import (  # noqa: E402
    TP_REFUSAL, GatedDeltaNet, gated_qkv, hybrid_layer_specs, split_gated_qkv,
)
from rlcore.rendezvous import join_torch_world  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16


def hf_config(**keys) -> Qwen3_5TextConfig:
    config = Qwen3_5TextConfig(
        vocab_size=300, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], **keys,
    )
    config._attn_implementation = "sdpa"  # causal without a mask, as the megatron side runs
    return config


def megatron_config(config: Qwen3_5TextConfig, tp: int = 1) -> TransformerConfig:
    return TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim, ffn_hidden_size=config.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,
        attention_output_gate=True, linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        linear_key_head_dim=config.linear_key_head_dim, linear_value_head_dim=config.linear_value_head_dim,
        linear_num_key_heads=config.linear_num_key_heads, linear_num_value_heads=config.linear_num_value_heads,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, tensor_model_parallel_size=tp,
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False,
    )


def randomise(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights, A_log and dt_bias too), so no default hides a mistake."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.5))


@pytest.fixture(scope="module")
def megatron_state():
    """megatron's parallel state at tensor and pipeline size 1 on a one-process gloo world (as the engine makes it)."""
    join_torch_world(torch.device("cpu"), 60, alone=True)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, order="tp-cp-ep-pp-dp")
    use_cpu_rng_tracker()


@pytest.mark.parametrize("length", [5, 70])  # one chunk of the delta rule's 64, and two
def test_gated_delta_net_equals_transformers(length):
    config = hf_config()
    reference = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    randomise(reference, seed=length)
    module = GatedDeltaNet(megatron_config(config), layer_number=1).eval()
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in reference.named_parameters()]
    module.load_state_dict(reference.state_dict())
    x = torch.randn(3, length, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = reference(x)
        got, bias = module(x.transpose(0, 1).contiguous(), attention_mask=None)  # megatron's [T, B, H]
    assert bias is None and got.shape == (length, 3, HIDDEN)
    torch.testing.assert_close(got.transpose(0, 1), want, atol=1e-5, rtol=1e-5)
    assert want.abs().max() > 1e-2  # a real signal, not two zeros


def test_gated_delta_net_gradients_equal_transformers():
    config = hf_config()
    reference = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    randomise(reference, seed=3)
    module = GatedDeltaNet(megatron_config(config), layer_number=1)
    module.load_state_dict(reference.state_dict())
    x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(1))
    reference(x).square().sum().backward()
    module(x.transpose(0, 1).contiguous())[0].square().sum().backward()
    grads = dict(reference.named_parameters())
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-5, msg=name)


def test_linear_attention_refuses_tensor_parallelism_in_one_line():
    with pytest.raises(ValueError, match="tensor_model_parallel_size 1 only") as caught:
        GatedDeltaNet(megatron_config(hf_config(), tp=2), layer_number=1)
    assert "\n" not in str(caught.value) and str(caught.value) == TP_REFUSAL and "train.engine=hf" in TP_REFUSAL


def test_gated_qkv_layout_round_trips_and_groups_query_and_gate():
    q = torch.arange(HEADS * 2 * HEAD_DIM * 3, dtype=torch.float32).reshape(-1, 3)
    k, v = -torch.rand(KV_HEADS * HEAD_DIM, 3), torch.rand(KV_HEADS * HEAD_DIM, 3) + 10
    fused = gated_qkv(q, k, v, KV_HEADS, HEAD_DIM)
    d, per_group = HEAD_DIM, HEADS // KV_HEADS * HEAD_DIM
    group0 = fused[: 2 * per_group + 2 * d]
    assert torch.equal(group0[:d], q[:d])  # head 0's query
    assert torch.equal(group0[d:2 * d], q[2 * d:3 * d])  # head 1's query
    assert torch.equal(group0[per_group:per_group + d], q[d:2 * d])  # head 0's gate
    assert torch.equal(group0[2 * per_group:2 * per_group + d], k[:d]) and torch.equal(group0[-d:], v[:d])
    assert all(torch.equal(a, b) for a, b in zip(split_gated_qkv(fused, HEADS, KV_HEADS, HEAD_DIM), (q, k, v)))


def layer_state(reference: torch.nn.Module, kind: str) -> dict[str, torch.Tensor]:
    """A Qwen3_5DecoderLayer's weights under the megatron layer's names."""
    w = reference.state_dict()
    state = {"input_layernorm.weight": w["input_layernorm.weight"],
             "pre_mlp_layernorm.weight": w["post_attention_layernorm.weight"],
             "mlp.linear_fc1.weight": torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]),
             "mlp.linear_fc2.weight": w["mlp.down_proj.weight"]}
    if kind == "linear_attention":
        state |= {f"self_attention.{k[len('linear_attn.'):]}": t for k, t in w.items() if k.startswith("linear_attn.")}
    else:
        state |= {"self_attention.linear_qkv.weight": gated_qkv(w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"],
                                                                w["self_attn.v_proj.weight"], KV_HEADS, HEAD_DIM),
                  "self_attention.linear_proj.weight": w["self_attn.o_proj.weight"],
                  "self_attention.q_layernorm.weight": w["self_attn.q_norm.weight"],
                  "self_attention.k_layernorm.weight": w["self_attn.k_norm.weight"]}
    return state


@pytest.mark.parametrize("kind", ["linear_attention", "attention"])
def test_decoder_layers_equal_transformers(megatron_state, kind):
    """A whole layer of each kind: zero-centred RMSNorms, the mixer (gated full attention with q/k norms and rotary
    on a quarter of each head, or the gated delta-net), the SwiGLU MLP."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    config = hf_config()
    index = 0 if kind == "linear_attention" else 1
    reference = hf.Qwen3_5DecoderLayer(config, layer_idx=index).eval()
    randomise(reference, seed=index + 11)
    block = hybrid_layer_specs(layer_spec(), [kind])
    mconfig = megatron_config(config)
    with cpu_current_device():
        layer = build_module(block.layer_specs[0], config=mconfig, layer_number=1).eval()
        rope = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=0.25, rotary_base=10000)
        T, B = 11, 2
        freqs = rope(T)
    result = layer.load_state_dict(layer_state(reference, kind), strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if not k.endswith("_extra_state")]
    x = torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(5))
    position_ids = torch.arange(T)[None].expand(B, -1)
    with torch.no_grad(), cpu_current_device():
        want = reference(x, position_embeddings=hf.Qwen3_5TextRotaryEmbedding(config)(x, position_ids),
                         attention_mask=None, position_ids=position_ids)
        got = layer(x.transpose(0, 1).contiguous(), attention_mask=None, rotary_pos_emb=freqs)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got.transpose(0, 1), want, atol=1e-5, rtol=1e-5)
    assert (want - x).abs().max() > 1e-2
    norm = build_module(block.layer_norm, config=mconfig, hidden_size=HIDDEN, eps=config.rms_norm_eps)
    reference_norm = hf.Qwen3_5RMSNorm(HIDDEN, eps=config.rms_norm_eps)
    randomise(reference_norm, seed=2)
    norm.load_state_dict(reference_norm.state_dict())
    torch.testing.assert_close(norm(x), reference_norm(x), atol=0, rtol=0)
