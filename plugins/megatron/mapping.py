"""Hugging Face <-> megatron-core weights, with megatron-core's local layer spec: one small declaration per
architecture (`Architecture`, in `ARCHITECTURES`) and one generic loader both ways.

rlcore's own small bridge (the ones on PyPI assume Transformer Engine's fused names). A layer is a table of
`Pair`s: one megatron module (under decoder.layers.j.) and the Hugging Face modules it holds (under
model.layers.i.), with how it is split over tensor-parallel ranks. The dense attention layer's table:

| Hugging Face (model.layers.i.)          | megatron local spec (decoder.layers.j.)   | split     |
|---|---|---|
| self_attn.{q,k,v}_proj.{weight,bias}     | self_attention.linear_qkv.{weight,bias}   | qkv: by query group, [q.., k, v] per group |
| self_attn.o_proj.weight                  | self_attention.linear_proj.weight         | columns   |
| self_attn.{q,k}_norm.weight (q/k norm)   | self_attention.{q,k}_layernorm.weight     | replicated |
| mlp.{gate,up}_proj.weight                | mlp.linear_fc1.weight                     | gate_up: [gate shard; up shard] per rank |
| mlp.down_proj.weight                     | mlp.linear_fc2.weight                     | columns   |
| mlp.gate.weight (MoE router)             | mlp.router.weight                         | replicated |
| mlp.experts.{e}.{gate,up}_proj.weight    | mlp.experts.local_experts.{e'}.linear_fc1.weight | gate_up |
| mlp.experts.{e}.down_proj.weight         | mlp.experts.local_experts.{e'}.linear_fc2.weight | columns |
| input_layernorm.weight                   | input_layernorm.weight                    | replicated |
| post_attention_layernorm.weight          | pre_mlp_layernorm.weight                  | replicated |

and with sandwich norms (Gemma 3) post_attention_layernorm -> self_attention.post_layernorm,
pre_feedforward_layernorm -> pre_mlp_layernorm, post_feedforward_layernorm -> mlp.post_layernorm (`gemma.py`);
plus `model.embed_tokens.weight` -> `embedding.word_embeddings.weight` (first stage), `model.norm.weight` ->
`decoder.final_layernorm.weight` and `lm_head.weight` -> `output_layer.weight` (last stage; from the
embeddings when tied), vocabulary rows padded with zeros to a multiple of the tensor size and trimmed on
the way back. `j` is the layer's index inside its pipeline stage, `e'` an expert's index inside its expert-parallel
rank. A layer's block kinds come from `ModelSpec.layer_types` ("attention"; "sliding_attention", Gemma 3's, holds the
same modules; or "linear_attention": Qwen3.5's gated
delta-net, whose modules `linear_attention.GatedDeltaNet` names as transformers does, linear_attn.X ->
self_attention.X, one to one at tensor size 1). With `attention_output_gate` (Qwen3.5) q_proj holds [query; gate] per
head and linear_qkv [queries; gates; k; v] per group. Everything here is pure tensor code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlcore import ConfigError

if TYPE_CHECKING:
    import torch

# How a megatron tensor is cut over tensor-parallel ranks, and how its Hugging Face tensors fuse into it.
SPLITS = ("replicated", "rows", "columns", "qkv", "gate_up")


@dataclass(frozen=True)
class Pair:
    """One megatron module and the Hugging Face modules it holds: `params` ("weight", "bias") of each; `split`
    one of `SPLITS`; `megatron_params`: the params' megatron names where they differ (a shared expert's gate is
    `gate_weight` there). Names are relative to the layer; "{e}" stands for an expert's index."""

    megatron: str
    hf: tuple[str, ...]
    split: str = "replicated"
    params: tuple[str, ...] = ("weight",)
    megatron_params: tuple[str, ...] = ()

    def named_params(self) -> tuple[tuple[str, str], ...]:
        """(Hugging Face name, megatron name) of each param."""
        return tuple(zip(self.params, self.megatron_params or self.params))


def attention_kinds(config: Any) -> tuple[str, ...]:
    """Each layer's kind from the config's `layer_types` ("sliding_attention" or full), else every layer
    "sliding_attention" where the config has a `sliding_window` (Mistral's), else every layer "attention"."""
    types = getattr(config, "layer_types", None)
    if types:
        return tuple("sliding_attention" if t == "sliding_attention" else "attention" for t in types)
    return ("sliding_attention" if getattr(config, "sliding_window", None) else "attention",) * config.num_hidden_layers


@dataclass(frozen=True)
class Architecture:
    """A Hugging Face causal LM as megatron-core's GPT model builds it: what its layers hold beyond Llama's.

    `refuse` holds (predicate on the transformers config, message) pairs for configurations the mapping does not
    express; `layer_types(config)` gives each layer's mixer kind (a key of `MIXERS`).
    """

    hf_class: str
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    shared_expert: bool = False  # beside the routed experts, one always-on expert scaled by sigmoid(a gate)
    output_gate: bool = False  # q_proj holds [query; gate] per head, the attention output times sigmoid(gate)
    zero_centered_norm: bool = False  # every RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too (Gemma's post_*_layernorm)
    scaled_embedding: bool = False  # the embedding output times sqrt(hidden_size)
    activation: str = "silu"  # the gated MLP's: silu or gelu_tanh
    refuse: tuple[tuple[Callable[[Any], bool], str], ...] = ()
    layer_types: Callable[[Any], tuple[str, ...]] = field(default=attention_kinds)


def _set(key: str) -> Callable[[Any], bool]:
    return lambda config: bool(getattr(config, key, None))


_BIASES = ((_set("attention_bias"), "attention_bias=true is not mapped"), (_set("mlp_bias"), "mlp_bias=true is not mapped"))
_MIXED_MOE = ((lambda c: bool(getattr(c, "mlp_only_layers", None)) or getattr(c, "decoder_sparse_step", 1) != 1,
               "dense layers among the MoE layers (mlp_only_layers, decoder_sparse_step != 1) are not mapped"),)



_GEMMA3 = _BIASES[:1] + (
    (_set("attn_logit_softcapping"), "attn_logit_softcapping is not mapped (it must be null)"),
    (_set("final_logit_softcapping"), "final_logit_softcapping is not mapped (it must be null)"),
    (_set("use_bidirectional_attention"), "use_bidirectional_attention is not mapped"),
    (lambda c: getattr(c, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
     "hidden_activation other than gelu_pytorch_tanh is not mapped"),
    (lambda c: not set(c.layer_types) <= {"sliding_attention", "full_attention"},
     "layer_types other than sliding_attention and full_attention are not mapped"),
)


def _qwen3_5_layers(config: Any) -> tuple[str, ...]:
    return tuple("linear_attention" if t == "linear_attention" else "attention" for t in config.layer_types)


_QWEN3_5 = _BIASES[:1] + ((lambda c: not set(c.layer_types) <= {"linear_attention", "full_attention"},
                           "layer_types other than linear_attention and full_attention are not mapped"),)

ARCHITECTURES: dict[str, Architecture] = {a.hf_class: a for a in (
    Architecture("Qwen2ForCausalLM", qkv_bias=True),
    Architecture("LlamaForCausalLM", refuse=_BIASES),
    Architecture("MistralForCausalLM"),
    Architecture("Qwen3ForCausalLM", qk_norm=True, refuse=_BIASES[:1]),
    Architecture("Qwen3MoeForCausalLM", qk_norm=True, moe=True, refuse=_BIASES[:1] + _MIXED_MOE),
    Architecture("Qwen3_5ForCausalLM", qk_norm=True, output_gate=True, zero_centered_norm=True, refuse=_QWEN3_5,
                 layer_types=_qwen3_5_layers),
    Architecture("Qwen3_5MoeForCausalLM", qk_norm=True, moe=True, shared_expert=True, output_gate=True,
                 zero_centered_norm=True, refuse=_QWEN3_5, layer_types=_qwen3_5_layers),
    Architecture("Gemma3ForCausalLM", qk_norm=True, zero_centered_norm=True, sandwich_norms=True, scaled_embedding=True,
                 activation="gelu_tanh", refuse=_GEMMA3),
)}


# Checkpoints published as a language model with a vision tower: the megatron engine trains their language model,
# this causal LM's declaration on the config's text_config; the rest of the checkpoint rides along unchanged
# (`rlcore.engines.CheckpointLayout`: the language model's names there are `model.language_model.*`).
CONDITIONAL: dict[str, str] = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of a Hugging Face causal LM that the mapping and megatron's config need."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    tied: bool
    qk_norm: bool = False
    num_experts: int = 0  # routed experts per layer (0: a dense MLP)
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    shared_expert_ffn_hidden_size: int = 0  # the gated shared expert's width (0: none)
    layer_types: tuple[str, ...] = ()  # each layer's mixer kind (a key of MIXERS); () means every layer attention
    attention_output_gate: bool = False
    zero_centered_norm: bool = False
    rotary_percent: float = 1.0  # the share of each head's dimensions the rotary embedding turns
    # gated delta-net linear attention (layers of kind "linear_attention"), as megatron's TransformerConfig names them
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    sandwich_norms: bool = False
    scaled_embedding: bool = False
    activation: str = "silu"
    softmax_scale: float | None = None  # None: head_dim ** -0.5
    # layers of kind "sliding_attention" (Gemma 3): their window and their rotary embedding's base
    sliding_window: int = 0
    local_rope_theta: float = 0.0
    rope_type: str = "default"  # one of ROPE_TYPES
    rope_factor: float = 1.0  # linear and llama3 scaling's factor

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "attention"


def _attention(spec: ModelSpec) -> tuple[Pair, ...]:
    params = ("weight", "bias") if spec.qkv_bias else ("weight",)
    pairs = [
        Pair("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "qkv", params),
        Pair("self_attention.linear_proj", ("self_attn.o_proj",), "columns"),
    ]
    if spec.qk_norm:
        pairs += [Pair("self_attention.q_layernorm", ("self_attn.q_norm",)),
                  Pair("self_attention.k_layernorm", ("self_attn.k_norm",))]
    return tuple(pairs)


# A layer's mixer (its attention-like block) by kind: the modules it holds.
def _linear_attention(spec: ModelSpec) -> tuple[Pair, ...]:
    """Gated delta-net (`linear_attention.GatedDeltaNet` names its modules as transformers does); tensor size 1."""
    pairs = [Pair("self_attention", ("linear_attn",), params=("dt_bias", "A_log"))]
    pairs += [Pair(f"self_attention.{m}", (f"linear_attn.{m}",))
              for m in ("conv1d", "norm", "out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
    return tuple(pairs)


MIXERS: dict[str, Callable[[ModelSpec], tuple[Pair, ...]]] = {"attention": _attention,
                                                              "sliding_attention": _attention,
                                                              "linear_attention": _linear_attention}
LINEAR_ATTENTION_TP = ("gated delta-net linear attention (Qwen3.5) runs at tensor_model_parallel_size 1 only; "
                       "set tensor_model_parallel_size: 1 or use train.engine=hf")


def _mlp(spec: ModelSpec) -> tuple[Pair, ...]:
    if not spec.num_experts:
        return (Pair("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj"), "gate_up"),
                Pair("mlp.linear_fc2", ("mlp.down_proj",), "columns"))
    return (Pair("mlp.router", ("mlp.gate",)),
            Pair("mlp.experts.local_experts.{e}.linear_fc1", ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"), "gate_up"),
            Pair("mlp.experts.local_experts.{e}.linear_fc2", ("mlp.experts.{e}.down_proj",), "columns")) + (
            (Pair("mlp.shared_experts.linear_fc1", ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), "gate_up"),
             Pair("mlp.shared_experts.linear_fc2", ("mlp.shared_expert.down_proj",), "columns"),
             Pair("mlp.shared_experts", ("mlp.shared_expert_gate",), megatron_params=("gate_weight",)))
            if spec.shared_expert_ffn_hidden_size else ())


_NORMS = (Pair("input_layernorm", ("input_layernorm",)), Pair("pre_mlp_layernorm", ("post_attention_layernorm",)))
_SANDWICH_NORMS = (Pair("input_layernorm", ("input_layernorm",)),
                   Pair("self_attention.post_layernorm", ("post_attention_layernorm",)),
                   Pair("pre_mlp_layernorm", ("pre_feedforward_layernorm",)),
                   Pair("mlp.post_layernorm", ("post_feedforward_layernorm",)))


def layer_pairs(spec: ModelSpec, i: int) -> tuple[Pair, ...]:
    """Global layer `i`'s table, in Hugging Face's `named_parameters` order: mixer, MLP, norms."""
    return MIXERS[spec.layer_type(i)](spec) + _mlp(spec) + (_SANDWICH_NORMS if spec.sandwich_norms else _NORMS)


def _refuse(message: str) -> ConfigError:
    return ConfigError(f"megatron engine: {message}", [("model", message)])


# Rotary embeddings megatron-core's RotaryEmbedding computes as transformers does: default; linear (positions over
# `factor`, megatron's seq_len_interpolation_factor); llama3 (megatron's rope_scaling, whose other numbers are fixed).
ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_type(params: Any) -> str:
    kind = params.get("rope_type", params.get("type")) if isinstance(params, Mapping) else None
    return kind or "default"


def _causal_lm_of(config: Any) -> list[str]:
    """The class AutoModelForCausalLM loads a config.json without `architectures` as (its model_type's), as the hf
    engine would load it; none where transformers maps none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None) or "")
    return [name] if name else []


def spec_from_hf_config(config: Any) -> ModelSpec:
    """A `ModelSpec` from a transformers config; a ConfigError for an architecture without a mapping, or one whose
    configuration the mapping does not express."""
    archs = list(getattr(config, "architectures", None) or []) or _causal_lm_of(config)
    name = next((a for a in archs if a in ARCHITECTURES), None)
    conditional = next((a for a in archs if a in CONDITIONAL), None)
    if name is None and conditional is not None:  # its language model, on the text config
        name, config = CONDITIONAL[conditional], config.get_text_config()
    if name is None:
        raise _refuse(
            f"architecture {', '.join(archs) or type(config).__name__} has no Hugging Face <-> megatron mapping; "
            f"supported: {', '.join([*ARCHITECTURES, *CONDITIONAL])} (use train.engine=hf for others)"
        )
    arch = ARCHITECTURES[name]
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # Gemma 3: a rotary embedding per layer kind, {"full_attention": {...}, "sliding_attention": {...}}
    local_rope = rope.get("sliding_attention") if isinstance(rope, Mapping) else None
    rope = rope.get("full_attention", rope) if isinstance(rope, Mapping) else rope
    problems = []
    rope_type, local_type = _rope_type(rope), _rope_type(local_rope)
    if rope_type not in ROPE_TYPES:
        problems.append(("model", f"rope_type {rope_type!r} is not mapped (default, linear and llama3 are)"))
    elif rope_type == "llama3" and any(rope.get(key) != value for key, value in LLAMA3_ROPE.items()):
        problems.append(("model", "rope_type 'llama3' is mapped with megatron-core's "
                                  + ", ".join(f"{k} {v}" for k, v in LLAMA3_ROPE.items()) + " only"))
    if local_type != "default":
        problems.append(("model", f"rope_type {local_type!r} of the sliding-window layers is not mapped (only the default)"))
    problems += [("model", f"{name}: {message}") for refused, message in arch.refuse if refused(config)]
    if problems:
        raise ConfigError("megatron engine: " + "; ".join(m for _, m in problems), problems)
    theta = (rope.get("rope_theta") if isinstance(rope, Mapping) else None) or getattr(config, "rope_theta", 10000.0)
    heads = config.num_attention_heads
    experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)) if arch.moe else 0
    layer_types = arch.layer_types(config)
    rotary = rope.get("partial_rotary_factor") if isinstance(rope, Mapping) else None
    linear = {key: int(getattr(config, key)) for key in ("linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")} \
        if "linear_attention" in layer_types else {}
    return ModelSpec(
        architecture=name,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        ffn_hidden_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=float(theta),
        norm_eps=float(config.rms_norm_eps),
        qkv_bias=arch.qkv_bias,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        qk_norm=arch.qk_norm,
        num_experts=int(experts),
        moe_topk=int(config.num_experts_per_tok) if experts else 0,
        moe_ffn_hidden_size=int(config.moe_intermediate_size) if experts else 0,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
        shared_expert_ffn_hidden_size=int(config.shared_expert_intermediate_size) if arch.shared_expert else 0,
        layer_types=() if set(layer_types) == {"attention"} else tuple(layer_types),
        attention_output_gate=arch.output_gate,
        zero_centered_norm=arch.zero_centered_norm,
        rotary_percent=float(rotary or getattr(config, "partial_rotary_factor", None) or 1.0),
        **linear,
        sandwich_norms=arch.sandwich_norms,
        scaled_embedding=arch.scaled_embedding,
        activation=arch.activation,
        softmax_scale=float(config.query_pre_attn_scalar) ** -0.5 if hasattr(config, "query_pre_attn_scalar") else None,
        sliding_window=int(config.sliding_window) if "sliding_attention" in layer_types else 0,
        local_rope_theta=float(local_rope["rope_theta"]) if isinstance(local_rope, Mapping) else 0.0,
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0)) if rope_type != "default" else 1.0,
    )


def parallel_problems(spec: ModelSpec, tp: int, pp: int, world_size: int | None, ep: int = 1) -> list[tuple[str, str]]:
    """What keeps `spec` from being split `tp` x `pp` (experts over `ep`) over `world_size` workers (None: not
    known yet, as in `rlcore config validate`); checked before allocation."""
    problems = []
    if tp != 1 and "linear_attention" in spec.layer_types:
        problems.append(("tensor_model_parallel_size", f"tensor_model_parallel_size={tp}: {LINEAR_ATTENTION_TP}"))
    if spec.num_heads % tp:
        problems.append(("tensor_model_parallel_size",
                         f"tensor_model_parallel_size={tp} does not divide the model's {spec.num_heads} attention heads"))
    if spec.num_kv_heads % tp:
        problems.append(("tensor_model_parallel_size",
                         f"tensor_model_parallel_size={tp} does not divide the model's {spec.num_kv_heads} key/value heads"))
    if spec.ffn_hidden_size % tp and not spec.num_experts:
        problems.append(("tensor_model_parallel_size",
                         f"tensor_model_parallel_size={tp} does not divide the MLP width {spec.ffn_hidden_size}"))
    if spec.shared_expert_ffn_hidden_size % tp:
        problems.append(("tensor_model_parallel_size", f"tensor_model_parallel_size={tp} does not divide the shared "
                                                       f"expert's width {spec.shared_expert_ffn_hidden_size}"))
    if spec.num_experts and spec.moe_ffn_hidden_size % tp:
        problems.append(("tensor_model_parallel_size",
                         f"tensor_model_parallel_size={tp} does not divide the experts' width {spec.moe_ffn_hidden_size}"))
    if spec.num_layers % pp:
        problems.append(("pipeline_model_parallel_size",
                         f"pipeline_model_parallel_size={pp} does not divide the model's {spec.num_layers} layers"))
    if ep != 1 and not spec.num_experts:
        problems.append(("expert_model_parallel_size",
                         f"expert_model_parallel_size={ep} needs a model with experts; {spec.architecture} has none"))
    elif spec.num_experts % ep:
        problems.append(("expert_model_parallel_size",
                         f"expert_model_parallel_size={ep} does not divide the model's {spec.num_experts} experts"))
    if world_size is not None and world_size % (tp * pp):
        problems.append(("tensor_model_parallel_size",
                         f"the group's {world_size} workers are not a multiple of tensor x pipeline = {tp} x {pp}"))
    elif world_size is not None and (world_size // (tp * pp)) % ep:
        problems.append(("expert_model_parallel_size",
                         f"expert_model_parallel_size={ep} does not divide the group's data-parallel size "
                         f"{world_size // (tp * pp)} (workers / (tensor x pipeline))"))
    return problems


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """The vocabulary rounded up to a multiple of `divisible_by * tp` (megatron's convention)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def layer_range(spec: ModelSpec, pp_rank: int, pp: int) -> range:
    """The global layer indices pipeline stage `pp_rank` holds."""
    per_stage = spec.num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def _expanded(spec: ModelSpec, i: int, j: int, ep_rank: int = 0, ep: int = 1) -> Iterator[tuple[Pair, str, list[str]]]:
    """(pair, megatron prefix, Hugging Face prefixes) of global layer `i` (stage-local `j`), an expert's pairs
    once per expert of expert rank `ep_rank`."""
    local = spec.num_experts // ep
    for pair in layer_pairs(spec, i):
        experts = [(e, ep_rank * local + e) for e in range(local)] if "{e}" in pair.megatron else [(0, 0)]
        for mine, glob in experts:
            yield (pair, f"decoder.layers.{j}.{pair.megatron.format(e=mine)}.",
                   [f"model.layers.{i}.{h.format(e=glob)}." for h in pair.hf])


def hf_names(spec: ModelSpec, pp_rank: int = 0, pp: int = 1) -> list[str]:
    """The Hugging Face parameter names stage `pp_rank` of `pp` holds, in `named_parameters` order (experts one
    by one, as checkpoints name them)."""
    names = ["model.embed_tokens.weight"] if pp_rank == 0 else []
    for j, i in enumerate(layer_range(spec, pp_rank, pp)):
        for pair, _, hf in _expanded(spec, i, j):
            names += [h + p for h in hf for p in pair.params]
    if pp_rank == pp - 1:
        names.append("model.norm.weight")
        if not spec.tied:
            names.append("lm_head.weight")
    return names


# --------------------------------------------------------------------------- Hugging Face -> megatron

def _interleave_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[q heads of group g; k_g; v_g] for every query group g, along dim 0 (weights or biases)."""
    import torch

    G, d, tail = spec.num_kv_heads, spec.head_dim, q.shape[1:]
    rows = spec.heads_per_group * d
    if spec.attention_output_gate:  # q_proj: [query; gate] per head; megatron: [queries; gates] per group
        query, gate = q.reshape(spec.num_heads, 2, d, *tail).unbind(1)
        q, rows = torch.cat([query.reshape(G, rows, *tail), gate.reshape(G, rows, *tail)], dim=1), 2 * rows
    parts = (q.reshape(G, rows, *tail), k.reshape(G, d, *tail), v.reshape(G, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_qkv(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    G, d, tail = spec.num_kv_heads, spec.head_dim, qkv.shape[1:]
    rows = spec.heads_per_group * d * (2 if spec.attention_output_gate else 1)
    q, k, v = qkv.reshape(G, rows + 2 * d, *tail).split([rows, d, d], dim=1)
    if spec.attention_output_gate:
        query, gate = (t.reshape(spec.num_heads, d, *tail) for t in q.split(rows // 2, dim=1))
        q = torch.stack([query, gate], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    import torch

    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], spec: ModelSpec, *, tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1,
    padded_vocab: int | None = None, ep_rank: int = 0, ep: int = 1,
) -> dict[str, torch.Tensor]:
    """The megatron state dict (local-spec names) of tensor rank `tp_rank`, pipeline stage `pp_rank`, expert
    rank `ep_rank`.

    `hf` maps Hugging Face names to tensors (a dict, or a lazy reader with `__getitem__`); only the names
    this stage needs are read. Shards are contiguous copies.
    """
    import torch

    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, tp)
    out: dict[str, torch.Tensor] = {}

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[tp_rank].contiguous()

    def fuse(split: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if split == "qkv":
            return shard(_interleave_qkv(spec, *tensors), 0)
        if split == "gate_up":
            return torch.cat([shard(t, 0) for t in tensors])
        if split in ("rows", "columns"):
            return shard(tensors[0], 0 if split == "rows" else 1)
        return tensors[0].clone()

    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = shard(_pad_rows(hf["model.embed_tokens.weight"], vocab), 0)
    for j, i in enumerate(layer_range(spec, pp_rank, pp)):
        for pair, m, hf_prefixes in _expanded(spec, i, j, ep_rank, ep):
            for p, mp in pair.named_params():
                out[m + mp] = fuse(pair.split, [hf[h + p] for h in hf_prefixes])
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not spec.tied or pp > 1:  # tied on one stage: the output layer reads the embedding itself
            head = hf["model.embed_tokens.weight"] if spec.tied else hf["lm_head.weight"]
            out["output_layer.weight"] = shard(_pad_rows(head, vocab), 0)
    return out


# --------------------------------------------------------------------------- megatron -> Hugging Face

def merge_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """One full (tensor-parallel size 1) megatron tensor from its tensor shards, rank order."""
    import torch

    if len(shards) == 1:
        return shards[0]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(shards, dim=1)
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return torch.cat(shards, dim=0)
    return shards[0]  # replicated: norms, the router


def megatron_to_hf(
    full: Mapping[str, torch.Tensor], spec: ModelSpec, *, pp_rank: int = 0, pp: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs of stage `pp_rank` from its full (tensor-merged, every expert) megatron
    tensors, in `hf_names` order; vocabulary padding trimmed, `lm_head.weight` only when untied."""
    if pp_rank == 0:
        yield "model.embed_tokens.weight", full["embedding.word_embeddings.weight"][: spec.vocab_size]
    for j, i in enumerate(layer_range(spec, pp_rank, pp)):
        for pair, m, hf_prefixes in _expanded(spec, i, j):
            pieces = {}
            for p, mp in pair.named_params():
                tensor = full[m + mp]
                if pair.split == "qkv":
                    pieces[p] = _split_qkv(spec, tensor)
                elif pair.split == "gate_up":
                    pieces[p] = tensor.chunk(2, dim=0)
                else:
                    pieces[p] = (tensor,)
            for n, h in enumerate(hf_prefixes):
                for p in pair.params:
                    yield h + p, pieces[p][n]
    if pp_rank == pp - 1:
        yield "model.norm.weight", full["decoder.final_layernorm.weight"]
        if not spec.tied:
            yield "lm_head.weight", full["output_layer.weight"][: spec.vocab_size]
