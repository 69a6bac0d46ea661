"""The Hugging Face <-> megatron mapping as pure tensor code: every tensor and pipeline split of untied and
tied Qwen2/Llama-shaped weights comes back bitwise, and the layouts are megatron's."""

from __future__ import annotations

import pytest
import torch

from rlcore import ConfigError
from rlcore.plugins.megatron import mapping


def _config(arch: str, tied: bool, layers: int = 4, heads: int = 8, kv_heads: int = 4):
    from transformers import LlamaConfig, Qwen2Config

    cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    config = cls(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    config.architectures = ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"]
    return config


def _random_hf(spec: mapping.ModelSpec) -> dict[str, torch.Tensor]:
    """Random tensors of the shapes a Hugging Face model of `spec` has, for every name `hf_names` lists."""
    g = torch.Generator().manual_seed(0)
    H, d, F = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    shapes = {
        "q_proj.weight": (spec.num_heads * d, H), "q_proj.bias": (spec.num_heads * d,),
        "k_proj.weight": (spec.num_kv_heads * d, H), "k_proj.bias": (spec.num_kv_heads * d,),
        "v_proj.weight": (spec.num_kv_heads * d, H), "v_proj.bias": (spec.num_kv_heads * d,),
        "o_proj.weight": (H, spec.num_heads * d), "gate_proj.weight": (F, H), "up_proj.weight": (F, H),
        "down_proj.weight": (H, F), "layernorm.weight": (H,), "norm.weight": (H,),
        "embed_tokens.weight": (spec.vocab_size, H), "lm_head.weight": (spec.vocab_size, H),
    }
    out = {}
    for name in mapping.hf_names(spec):
        shape = next(s for suffix, s in shapes.items() if name.endswith(suffix))
        out[name] = torch.randn(shape, generator=g)
    return out


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("qwen2", False), ("llama", True), ("llama", False)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 2), (1, 4)])
def test_every_split_comes_back_bitwise(arch, tied, tp, pp):
    spec = mapping.spec_from_hf_config(_config(arch, tied))
    hf = _random_hf(spec)
    vocab = mapping.padded_vocab_size(spec.vocab_size, tp, divisible_by=8)
    back = {}
    for pp_rank in range(pp):
        shards = [mapping.hf_to_megatron(hf, spec, tp_rank=r, tp=tp, pp_rank=pp_rank, pp=pp, padded_vocab=vocab)
                  for r in range(tp)]
        full = {name: mapping.merge_tp(name, [s[name] for s in shards]) for name in shards[0]}
        pairs = list(mapping.megatron_to_hf(full, spec, pp_rank=pp_rank, pp=pp))
        assert [n for n, _ in pairs] == mapping.hf_names(spec, pp_rank, pp)
        back.update(pairs)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_layouts_are_megatrons():
    spec = mapping.spec_from_hf_config(_config("qwen2", tied=False, layers=2, heads=4, kv_heads=2))
    hf = _random_hf(spec)
    d, hpg = spec.head_dim, spec.heads_per_group
    shard = mapping.hf_to_megatron(hf, spec, tp_rank=1, tp=2, padded_vocab=304)
    qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
    # tensor rank 1 holds query group 1: its two query heads, then its key head, then its value head
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(qkv, torch.cat([q[hpg * d:2 * hpg * d], k[d:2 * d], v[d:2 * d]]))
    fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[24:], up[24:]]))  # [gate shard; up shard] of rank 1
    emb = shard["embedding.word_embeddings.weight"]
    assert emb.shape == (152, 32) and torch.equal(emb[:148], hf["model.embed_tokens.weight"][152:])
    assert not emb[148:].any()  # rows 300..303: padding
    proj = shard["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(proj, hf["model.layers.0.self_attn.o_proj.weight"][:, 16:])
    tied = mapping.spec_from_hf_config(_config("llama", tied=True, layers=2))
    names = set(mapping.hf_to_megatron(_random_hf(tied), tied))
    assert "output_layer.weight" not in names  # one stage, tied: the output layer reads the embedding
    last = mapping.hf_to_megatron(_random_hf(tied), tied, pp_rank=1, pp=2)
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    assert set(last) >= {"decoder.layers.0.mlp.linear_fc2.weight", "decoder.final_layernorm.weight"}


def test_padded_vocab_is_a_multiple_of_divisor_times_tp():
    assert mapping.padded_vocab_size(151936, 1) == 151936
    assert mapping.padded_vocab_size(151936, 8) == 152576
    assert mapping.padded_vocab_size(267, 2, divisible_by=1) == 268


def test_a_config_without_architectures_is_the_causal_lm_its_model_type_loads_as():
    from transformers import GPT2Config, Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    assert not config.architectures  # as AutoModelForCausalLM loads it: Qwen2ForCausalLM
    config.architectures = ["Qwen2ForCausalLM"]
    named = mapping.spec_from_hf_config(config)
    config.architectures = None
    assert mapping.spec_from_hf_config(config) == named
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no Hugging Face <-> megatron mapping"):
        mapping.spec_from_hf_config(GPT2Config())  # what gpt2's model_type loads as is named


def test_an_architecture_without_a_mapping_is_refused():
    from transformers import GPT2Config

    config = GPT2Config()
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no Hugging Face <-> megatron mapping; supported: Qwen2ForCausalLM, LlamaForCausalLM"):
        mapping.spec_from_hf_config(config)
    scaled = _config("llama", tied=True)
    scaled.rope_parameters = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(ConfigError, match=r"rope_type 'yarn' is not mapped \(default, linear and llama3 are\)"):
        mapping.spec_from_hf_config(scaled)
    scaled.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ConfigError, match="rope_type 'llama3' is mapped with megatron-core's low_freq_factor 1.0, "
                                          "high_freq_factor 4.0, original_max_position_embeddings 8192 only"):
        mapping.spec_from_hf_config(scaled)
    scaled.rope_parameters["low_freq_factor"] = 1.0
    spec = mapping.spec_from_hf_config(scaled)
    assert (spec.rope_type, spec.rope_factor, spec.rope_theta) == ("llama3", 8.0, 5e5)


def test_parallel_problems_name_what_does_not_divide():
    spec = mapping.spec_from_hf_config(_config("qwen2", tied=True, layers=6, heads=6, kv_heads=2))
    assert mapping.parallel_problems(spec, 2, 3, 6) == []
    messages = [m for _, m in mapping.parallel_problems(spec, 4, 4, 8)]
    assert "tensor_model_parallel_size=4 does not divide the model's 6 attention heads" in messages
    assert "tensor_model_parallel_size=4 does not divide the model's 2 key/value heads" in messages
    assert "pipeline_model_parallel_size=4 does not divide the model's 6 layers" in messages
    assert "the group's 8 workers are not a multiple of tensor x pipeline = 4 x 4" in messages


# -- every declared architecture, from a real tiny checkpoint --------------------------------------------------

MAPPED = ("qwen2", "qwen2_untied", "llama", "mistral", "qwen3", "qwen3_moe", "gemma3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    root = tmp_path_factory.mktemp("archs")
    return {arch: build_tiny_model(root / arch, arch=arch, num_layers=2) for arch in MAPPED}


def _hf_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _load(path):
    from safetensors.torch import load_file

    return mapping.spec_from_hf_config(_hf_config(path)), load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("arch", MAPPED)
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2)])
def test_every_architecture_comes_back_bitwise(checkpoints, arch, tp, pp, ep):
    """The checkpoint's own tensors (every name it has, nothing more) through every tensor x pipeline (x expert)
    split and back; the experts of a MoE layer spread over the expert ranks."""
    spec, hf = _load(checkpoints[arch])
    if ep > 1 and not spec.num_experts:
        assert mapping.parallel_problems(spec, tp, pp, None, ep=ep)[0][0] == "expert_model_parallel_size"
        return
    back = {}
    for pp_rank in range(pp):
        full: dict[str, torch.Tensor] = {}
        for ep_rank in range(ep):
            shards = [mapping.hf_to_megatron(hf, spec, tp_rank=r, tp=tp, pp_rank=pp_rank, pp=pp, ep_rank=ep_rank, ep=ep)
                      for r in range(tp)]
            for name in shards[0]:
                merged = mapping.merge_tp(name, [s[name] for s in shards])
                local = name.split("local_experts.")
                if len(local) == 2:  # expert e' of rank ep_rank is global expert ep_rank * E/ep + e'
                    index, rest = local[1].split(".", 1)
                    name = f"{local[0]}local_experts.{ep_rank * spec.num_experts // ep + int(index)}.{rest}"
                assert name not in full or torch.equal(full[name], merged), name  # replicated: the same everywhere
                full[name] = merged
        pairs = list(mapping.megatron_to_hf(full, spec, pp_rank=pp_rank, pp=pp))
        assert [n for n, _ in pairs] == mapping.hf_names(spec, pp_rank, pp)
        back.update(pairs)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_declarations_name_what_each_architecture_adds(checkpoints):
    spec, _ = _load(checkpoints["qwen3_moe"])
    assert (spec.qk_norm, spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size) == (True, 4, 2, 64)
    layer = {f"{p.megatron}.{x}" for p in mapping.layer_pairs(spec, 0) for x in p.params}
    assert {"self_attention.q_layernorm.weight", "mlp.router.weight",
            "mlp.experts.local_experts.{e}.linear_fc1.weight"} <= layer and "mlp.linear_fc1.weight" not in layer
    shard = mapping.hf_to_megatron(_load(checkpoints["qwen3_moe"])[1], spec, ep_rank=1, ep=2)
    experts = sorted(n for n in shard if n.startswith("decoder.layers.0.mlp.experts.") and n.endswith("fc2.weight"))
    assert experts == [f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight" for e in (0, 1)]
    untied, _ = _load(checkpoints["qwen2_untied"])
    assert not untied.tied and untied.qkv_bias and "lm_head.weight" in mapping.hf_names(untied)
    assert mapping.spec_from_hf_config(_hf_config(checkpoints["qwen2"])).tied


def test_configurations_the_declarations_refuse_are_named(checkpoints):
    gemma = _hf_config(checkpoints["gemma3"])
    spec = mapping.spec_from_hf_config(gemma)
    assert spec.layer_types == ("sliding_attention", "attention") and spec.sliding_window == 16
    assert (spec.rope_theta, spec.local_rope_theta, spec.softmax_scale) == (1e6, 1e4, 256 ** -0.5)  # query_pre_attn_scalar
    assert {p.hf[0] for p in mapping.layer_pairs(spec, 0) if "norm" in p.hf[0]} >= {
        "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"}
    gemma.final_logit_softcapping = 30.0
    gemma.rope_parameters["sliding_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}
    with pytest.raises(ConfigError, match=r"rope_type 'linear' of the sliding-window layers is not mapped .*; "
                                          r"Gemma3ForCausalLM: final_logit_softcapping is not mapped"):
        mapping.spec_from_hf_config(gemma)
    windowed = _hf_config(checkpoints["mistral"])
    windowed.sliding_window = 4096  # Mistral 7B v0.1's: every layer
    spec = mapping.spec_from_hf_config(windowed)
    assert (spec.layer_types, spec.sliding_window) == (("sliding_attention",) * 2, 4096)
    mixed = _hf_config(checkpoints["qwen3_moe"])
    mixed.mlp_only_layers = [1]
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM: dense layers among the MoE layers"):
        mapping.spec_from_hf_config(mixed)
    spec, _ = _load(checkpoints["qwen3_moe"])
    messages = [m for _, m in mapping.parallel_problems(spec, 1, 1, 4, ep=3)]
    assert messages == ["expert_model_parallel_size=3 does not divide the model's 4 experts",
                        "expert_model_parallel_size=3 does not divide the group's data-parallel size 4 (workers / (tensor x pipeline))"]
