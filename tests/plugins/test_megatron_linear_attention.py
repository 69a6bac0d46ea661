"""Qwen3.5's blocks for megatron-core (plugins/megatron/linear_attention.py) against transformers' modules on the
same weights, float32 on the CPU: the gated delta-net alone, Qwen3.5's declaration in the mapping (the gated
q_proj's layout), and whole decoder layers of both kinds (zero-centred norms, gated full attention with partial
rotary, linear attention, MLP) loaded through the mapping."""

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
from rlcore.plugins.megatron import mapping  # noqa: E402
from rlcore.plugins.megatron.linear_attention import GatedDeltaNet, hybrid_layer_specs  # noqa: E402
from rlcore.runtime.rendezvous import join_torch_world  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16


def hf_config(**keys) -> Qwen3_5TextConfig:
    config = Qwen3_5TextConfig(
        vocab_size=300, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], architectures=["Qwen3_5ForCausalLM"], **keys,
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
        for p in module.parameters():
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


def test_the_delta_rule_gets_as_many_key_heads_as_value_heads(monkeypatch):
    """transformers 5.17 (the GPU image's) repeats q and k to the value heads in `Qwen3_5GatedDeltaNet.forward` and its
    `torch_chunk_gated_delta_rule` multiplies k by beta per value head: handed 2 key heads for 4 value heads it raised
    a size mismatch on the GPU. The module repeats them first, so the function sees equal heads on any release."""
    seen = []
    kernel = hf.torch_chunk_gated_delta_rule

    def equal_heads_only(query, key, value, **kwargs):
        seen.append((query.shape[2], key.shape[2], value.shape[2]))
        assert query.shape[2] == key.shape[2] == value.shape[2], seen[-1]
        return kernel(query, key, value, **kwargs)

    monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", equal_heads_only)
    config = hf_config()
    assert config.linear_num_value_heads == 2 * config.linear_num_key_heads
    reference = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    randomise(reference, seed=5)
    module = GatedDeltaNet(megatron_config(config), layer_number=1).eval()
    module.load_state_dict(reference.state_dict())
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = module(x.transpose(0, 1).contiguous())[0].transpose(0, 1)
    monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", kernel)
    with torch.no_grad():
        want = reference(x)
    assert seen == [(4, 4, 4)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


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
    message = mapping.LINEAR_ATTENTION_TP
    assert "\n" not in message and "train.engine=hf" in message
    with pytest.raises(ValueError) as caught:
        GatedDeltaNet(megatron_config(hf_config(), tp=2), layer_number=1)
    assert str(caught.value) == message
    spec = mapping.spec_from_hf_config(hf_config())
    assert mapping.parallel_problems(spec, 2, 1, None)[0] == ("tensor_model_parallel_size",
                                                               f"tensor_model_parallel_size=2: {message}")
    assert mapping.parallel_problems(spec, 1, 2, 2) == []  # pipeline stages split the layers, kinds and all


def test_the_declaration_reads_qwen3_5s_config():
    spec = mapping.spec_from_hf_config(hf_config())
    assert spec.layer_types == ("linear_attention", "attention") and spec.qk_norm
    assert spec.attention_output_gate and spec.zero_centered_norm and spec.rotary_percent == 0.25
    assert (spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim,
            spec.linear_value_head_dim, spec.linear_conv_kernel_dim) == (2, 4, 8, 12, 4)
    with pytest.raises(Exception, match="attention_bias=true is not mapped"):
        mapping.spec_from_hf_config(hf_config(attention_bias=True))


def test_gated_q_proj_goes_to_megatrons_query_and_gate_rows_and_back_bitwise():
    """transformers' q_proj is [query; gate] per head; megatron's gated linear_qkv is [queries; gates; key; value]
    per query group."""
    config = hf_config()
    spec = mapping.spec_from_hf_config(config)
    model = hf.Qwen3_5ForCausalLM(config)
    state = model.state_dict()
    d, per_group = HEAD_DIM, HEADS // KV_HEADS * HEAD_DIM
    q = state["model.layers.1.self_attn.q_proj.weight"] = torch.arange(HEADS * 2 * d)[:, None] * torch.ones(HIDDEN)
    k, v = state["model.layers.1.self_attn.k_proj.weight"], state["model.layers.1.self_attn.v_proj.weight"]
    full = mapping.hf_to_megatron(state, spec)
    group0 = full["decoder.layers.1.self_attention.linear_qkv.weight"][: 2 * per_group + 2 * d]
    assert torch.equal(group0[:d], q[:d]) and torch.equal(group0[d:2 * d], q[2 * d:3 * d])  # heads 0 and 1's queries
    assert torch.equal(group0[per_group:per_group + d], q[d:2 * d])  # head 0's gate
    assert torch.equal(group0[2 * per_group:2 * per_group + d], k[:d]) and torch.equal(group0[-d:], v[:d])
    back = dict(mapping.megatron_to_hf(full, spec))
    assert list(back) == mapping.hf_names(spec) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(back[name], state[name]) for name in back)


@pytest.mark.parametrize("kind", ["linear_attention", "attention"])
def test_decoder_layers_equal_transformers(megatron_state, kind):
    """A whole layer of each kind: zero-centred RMSNorms, the mixer (gated full attention with q/k norms and rotary
    on a quarter of each head, or the gated delta-net), the SwiGLU MLP."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    config = hf_config()
    index = 0 if kind == "linear_attention" else 1
    model = hf.Qwen3_5ForCausalLM(config).eval()
    randomise(model, seed=index + 11)
    reference = model.model.layers[index]
    prefix = f"decoder.layers.{index}."
    state = {k[len(prefix):]: t for k, t in mapping.hf_to_megatron(model.state_dict(), mapping.spec_from_hf_config(config)).items()
             if k.startswith(prefix)}
    block = hybrid_layer_specs(layer_spec(), [kind])
    mconfig = megatron_config(config)
    with cpu_current_device():
        layer = build_module(block.layer_specs[0], config=mconfig, layer_number=1).eval()
        rope = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=0.25, rotary_base=10000)
        T, B = 11, 2
        freqs = rope(T)
    result = layer.load_state_dict(state, strict=False)
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


# -- Qwen3.5 on the megatron engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen3_5", arch="qwen3_5", num_layers=4))


def _right_padded(seed: int = 0, rows: int = 4, width: int = 12):
    """Right-padded rows (the engines' layout), the last 9 tokens of each a completion."""
    from rlcore.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 260, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = mask[3, 6:] = 0
    completion = mask.clone()
    completion[:, :3] = 0
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": completion,
                  "batch_tokens": torch.full((rows,), float(completion.sum()))})


def test_qwen3_5_on_the_megatron_engine_equals_transformers(tiny_qwen3_5, tmp_path):
    """Weights in and out bitwise; log-probs (at a temperature) and the full distribution equal transformers'
    teacher-forced forward within 1e-5, float32 on the CPU, over linear and full attention layers alternating; the
    export is a checkpoint transformers loads and runs alike."""
    from transformers import AutoModelForCausalLM

    from rlcore.export import write_hf_model
    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron import make_forward_engine
    from rlcore.plugins.megatron.linear_attention import GatedDeltaNet, GatedSelfAttention

    engine = make_forward_engine(model=tiny_qwen3_5)
    kinds = [type(layer.self_attention) for layer in engine.module.decoder.layers]
    assert kinds == [GatedDeltaNet, GatedSelfAttention] * 2
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5, dtype=torch.float32).eval()
    exported = [pair for bucket in engine.export_weights(bucket_bytes=64 << 10) for pair in bucket]
    weights = dict(reference.named_parameters())
    assert [name for name, _ in exported] == list(weights)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in exported)

    batch = _right_padded()
    with torch.no_grad():
        expected = model_outputs(reference, batch["input_ids"], batch["attention_mask"], temperature=0.7)
    torch.testing.assert_close(engine.forward_logprobs(batch, 0.7), expected.logprobs(), atol=1e-5, rtol=0)
    torch.testing.assert_close(engine.forward_topk(batch, None, 0.7), expected.full_logprobs(), atol=1e-5, rtol=0)

    write_hf_model(str(tmp_path / "final"), engine.export_weights(), tiny_qwen3_5, write=True)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=batch["input_ids"]).logits, reference(input_ids=batch["input_ids"]).logits)


def test_qwen3_5_trains_on_the_megatron_engine_like_the_hf_engine(tiny_qwen3_5):
    """Same weights, batch and AdamW: the losses and gradient norms of three steps agree with the hf engine's (the
    gradients through the gated delta rule, the convolution and the gates are megatron's here), and fall."""
    from rlcore.plugins.hf import make_train_engine as make_hf_engine
    from rlcore.plugins.megatron import make_train_engine

    options = dict(model=tiny_qwen3_5, learning_rate=1e-2, max_grad_norm=1.0, max_steps=3, seed=0)
    batch = _right_padded(seed=1)

    def loss_fn(outputs, micro):  # the completion tokens' mean negative log-likelihood
        mask = micro["completion_mask"].float()
        return -(outputs.logprobs() * mask).sum() / micro["batch_tokens"][0], {}

    def steps(engine):
        return [engine.train_step(batch, loss_fn, micro_batch_size=2) for _ in range(3)]

    megatron, hf_rows = steps(make_train_engine(**options)), steps(make_hf_engine(**options))
    losses = [m["loss"] for m in megatron]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05
    for mine, theirs in zip(megatron, hf_rows, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-4)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)


def test_grpo_trains_qwen3_5_on_the_megatron_engine_like_the_hf_engine(tiny_qwen3_5, tmp_path):
    """Two GRPO steps with the hf rollout engine, training on megatron and on hf from one seed: the same rollouts
    (so the weights synced after step 1 were the same), gradient norms and losses alike; `final/` written."""
    import json

    from rlcore import load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    rows = {}
    for engine in ("hf", "megatron"):
        config = GRPOConfig(
            model=tiny_qwen3_5, output_dir=str(tmp_path / engine), learning_rate=1e-3, max_completion_length=6,
            per_device_train_batch_size=4, num_generations=4, max_steps=2, train={"engine": engine},
        )
        GRPOTrainer(config, load_plugins()).fit()
        rows[engine] = [json.loads(line) for line in (tmp_path / engine / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows["megatron"]] == [1, 2]
    for mine, theirs in zip(rows["megatron"], rows["hf"], strict=True):
        assert mine["reward"] == theirs["reward"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
    assert (tmp_path / "megatron" / "final" / "model.safetensors").is_file()


def test_qwen3_5_moe_on_the_megatron_engine_equals_transformers_and_trains_like_hf(tmp_path_factory):
    """Qwen3.5-MoE: the hybrid layers with megatron's MoE layer (softmax top-2 of 4 routed experts, renormalised)
    and its gated shared expert. Weights in and out bitwise (experts one by one, as checkpoints name them),
    log-probs equal transformers' within 1e-5, three train steps like the hf engine's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlcore.plugins.hf import make_train_engine as make_hf_engine
    from rlcore.plugins.hf.common import model_outputs
    from rlcore.plugins.megatron import make_train_engine
    from rlcore.testing import build_tiny_model

    path = str(build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen3_5_moe", arch="qwen3_5_moe", num_layers=2))
    engine = make_train_engine(model=path, learning_rate=1e-3, seed=0)
    assert engine.spec.shared_expert_ffn_hidden_size == 128 and engine.spec.num_experts == 4
    saved = load_file(f"{path}/model.safetensors")
    exported = dict(pair for bucket in engine.export_weights(bucket_bytes=64 << 10) for pair in bucket)
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in saved.items())

    batch = _right_padded(seed=2)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model_outputs(reference, batch["input_ids"], batch["attention_mask"], temperature=0.7)
    torch.testing.assert_close(engine.forward_logprobs(batch, 0.7), expected.logprobs(), atol=1e-5, rtol=0)

    def loss_fn(outputs, micro):
        mask = micro["completion_mask"].float()
        return -(outputs.logprobs() * mask).sum() / micro["batch_tokens"][0], {}

    hf_engine = make_hf_engine(model=path, learning_rate=1e-3, seed=0)
    for _ in range(3):
        mine, theirs = (e.train_step(batch, loss_fn, micro_batch_size=2) for e in (engine, hf_engine))
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_the_config_check_refuses_tensor_parallel_linear_attention_in_one_line(tiny_qwen3_5):
    """What `rlcore config validate` and the engine's own check say for Qwen3.5 at tensor size 2, before any device."""
    from rlcore import load_plugins

    check = load_plugins().engines.get("megatron", kind="train").check
    assert check(model=tiny_qwen3_5) == []
    assert check(model=tiny_qwen3_5, tensor_model_parallel_size=2) == [
        ("tensor_model_parallel_size", f"tensor_model_parallel_size=2: {mapping.LINEAR_ATTENTION_TP}")]
