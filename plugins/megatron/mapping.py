"""Hugging Face <-> megatron-core weights for Qwen2 and Llama, with megatron-core's local layer spec.

rlcore's own small bridge (the ones on PyPI assume Transformer Engine's fused names). Per layer:

| Hugging Face (model.layers.i.)          | megatron local spec (decoder.layers.j.)   | tensor-parallel split         |
|---|---|---|
| input_layernorm.weight                   | input_layernorm.weight                    | replicated                    |
| self_attn.{q,k,v}_proj.{weight,bias}     | self_attention.linear_qkv.{weight,bias}   | by query group: [q.., k, v] per group |
| self_attn.o_proj.weight                  | self_attention.linear_proj.weight         | columns                       |
| post_attention_layernorm.weight          | pre_mlp_layernorm.weight                  | replicated                    |
| mlp.{gate,up}_proj.weight                | mlp.linear_fc1.weight                     | [gate shard; up shard] per rank |
| mlp.down_proj.weight                     | mlp.linear_fc2.weight                     | columns                       |

plus `model.embed_tokens.weight` -> `embedding.word_embeddings.weight` (first stage), `model.norm.weight` ->
`decoder.final_layernorm.weight` and `lm_head.weight` -> `output_layer.weight` (last stage; from the
embeddings when tied), vocabulary rows padded with zeros to a multiple of the tensor size and trimmed on
the way back. `j` is the layer's index inside its pipeline stage. Everything here is pure tensor code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.errors import ConfigError

if TYPE_CHECKING:
    import torch

# Hugging Face architectures with a mapping, and whether their attention has q/k/v biases.
ARCHITECTURES = {"Qwen2ForCausalLM": True, "LlamaForCausalLM": False}


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

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def spec_from_hf_config(config: Any) -> ModelSpec:
    """A `ModelSpec` from a transformers config; a ConfigError for an architecture without a mapping."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        message = (
            f"architecture {', '.join(archs) or type(config).__name__} has no Hugging Face <-> megatron mapping; "
            f"supported: {', '.join(ARCHITECTURES)} (use train.engine=hf for others)"
        )
        raise ConfigError(f"megatron engine: {message}", [("model", message)])
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
    problems = []
    if rope_type not in ("default", None):
        problems.append(("model", f"rope_type {rope_type!r} is not mapped (only the default rotary embedding)"))
    if arch == "LlamaForCausalLM" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
        problems.append(("model", "Llama with attention_bias or mlp_bias is not mapped"))
    if getattr(config, "use_sliding_window", False):
        problems.append(("model", "sliding-window attention is not mapped"))
    if problems:
        raise ConfigError("megatron engine: " + "; ".join(m for _, m in problems), problems)
    theta = (rope.get("rope_theta") if isinstance(rope, Mapping) else None) or getattr(config, "rope_theta", 10000.0)
    heads = config.num_attention_heads
    return ModelSpec(
        architecture=arch,
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
        qkv_bias=ARCHITECTURES[arch],
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def parallel_problems(spec: ModelSpec, tp: int, pp: int, world_size: int) -> list[tuple[str, str]]:
    """What keeps `spec` from being split `tp` x `pp` over `world_size` workers; checked before allocation."""
    problems = []
    if spec.num_heads % tp:
        problems.append(("tensor_model_parallel_size",
                         f"tensor_model_parallel_size={tp} does not divide the model's {spec.num_heads} attention heads"))
    if spec.num_kv_heads % tp:
        problems.append(("tensor_model_parallel_size",
                         f"tensor_model_parallel_size={tp} does not divide the model's {spec.num_kv_heads} key/value heads"))
    if spec.ffn_hidden_size % tp:
        problems.append(("tensor_model_parallel_size",
                         f"tensor_model_parallel_size={tp} does not divide the MLP width {spec.ffn_hidden_size}"))
    if spec.num_layers % pp:
        problems.append(("pipeline_model_parallel_size",
                         f"pipeline_model_parallel_size={pp} does not divide the model's {spec.num_layers} layers"))
    if world_size % (tp * pp):
        problems.append(("tensor_model_parallel_size",
                         f"the group's {world_size} workers are not a multiple of tensor x pipeline = {tp} x {pp}"))
    return problems


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """The vocabulary rounded up to a multiple of `divisible_by * tp` (megatron's convention)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def layer_range(spec: ModelSpec, pp_rank: int, pp: int) -> range:
    """The global layer indices pipeline stage `pp_rank` holds."""
    per_stage = spec.num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


# --------------------------------------------------------------------------- Hugging Face -> megatron

def _layer_hf(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "input_layernorm": p + "input_layernorm.weight",
        "q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
        "o": p + "self_attn.o_proj.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight",
    }


def hf_names(spec: ModelSpec, pp_rank: int = 0, pp: int = 1) -> list[str]:
    """The Hugging Face parameter names stage `pp_rank` of `pp` holds, in `named_parameters` order."""
    names = ["model.embed_tokens.weight"] if pp_rank == 0 else []
    for i in layer_range(spec, pp_rank, pp):
        h = _layer_hf(i)
        for x in "qkv":
            names.append(h[x] + ".weight")
            if spec.qkv_bias:
                names.append(h[x] + ".bias")
        names += [h["o"], h["gate"], h["up"], h["down"], h["input_layernorm"], h["post_norm"]]
    if pp_rank == pp - 1:
        names.append("model.norm.weight")
        if not spec.tied:
            names.append("lm_head.weight")
    return names


def _interleave_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[q heads of group g; k_g; v_g] for every query group g, along dim 0 (weights or biases)."""
    import torch

    G, d, tail = spec.num_kv_heads, spec.head_dim, q.shape[1:]
    parts = (q.reshape(G, spec.heads_per_group * d, *tail), k.reshape(G, d, *tail), v.reshape(G, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_qkv(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    G, d, tail = spec.num_kv_heads, spec.head_dim, qkv.shape[1:]
    q, k, v = qkv.reshape(G, (spec.heads_per_group + 2) * d, *tail).split([spec.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    import torch

    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], spec: ModelSpec, *, tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1,
    padded_vocab: int | None = None,
) -> dict[str, torch.Tensor]:
    """The megatron state dict (local-spec names) of tensor rank `tp_rank`, pipeline stage `pp_rank`.

    `hf` maps Hugging Face names to tensors (a dict, or a lazy reader with `__getitem__`); only the names
    this stage needs are read. Shards are contiguous copies.
    """
    import torch

    vocab = padded_vocab or padded_vocab_size(spec.vocab_size, tp)
    out: dict[str, torch.Tensor] = {}

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[tp_rank].contiguous()

    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = shard(_pad_rows(hf["model.embed_tokens.weight"], vocab), 0)
    for j, i in enumerate(layer_range(spec, pp_rank, pp)):
        h, m = _layer_hf(i), f"decoder.layers.{j}."
        out[m + "input_layernorm.weight"] = hf[h["input_layernorm"]].clone()
        kinds = ("weight", "bias") if spec.qkv_bias else ("weight",)
        for kind in kinds:
            qkv = _interleave_qkv(spec, *(hf[f"{h[x]}.{kind}"] for x in "qkv"))
            out[m + f"self_attention.linear_qkv.{kind}"] = shard(qkv, 0)
        out[m + "self_attention.linear_proj.weight"] = shard(hf[h["o"]], 1)
        out[m + "pre_mlp_layernorm.weight"] = hf[h["post_norm"]].clone()
        out[m + "mlp.linear_fc1.weight"] = torch.cat([shard(hf[h["gate"]], 0), shard(hf[h["up"]], 0)])
        out[m + "mlp.linear_fc2.weight"] = shard(hf[h["down"]], 1)
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
    return shards[0]  # replicated: norms


def megatron_to_hf(
    full: Mapping[str, torch.Tensor], spec: ModelSpec, *, pp_rank: int = 0, pp: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) pairs of stage `pp_rank` from its full (tensor-merged) megatron tensors,
    in `hf_names` order; vocabulary padding trimmed, `lm_head.weight` only when untied."""
    if pp_rank == 0:
        yield "model.embed_tokens.weight", full["embedding.word_embeddings.weight"][: spec.vocab_size]
    for j, i in enumerate(layer_range(spec, pp_rank, pp)):
        h, m = _layer_hf(i), f"decoder.layers.{j}."
        qkv_w = _split_qkv(spec, full[m + "self_attention.linear_qkv.weight"])
        qkv_b = _split_qkv(spec, full[m + "self_attention.linear_qkv.bias"]) if spec.qkv_bias else None
        for n, x in enumerate("qkv"):
            yield h[x] + ".weight", qkv_w[n]
            if qkv_b is not None:
                yield h[x] + ".bias", qkv_b[n]
        yield h["o"], full[m + "self_attention.linear_proj.weight"]
        gate, up = full[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        yield h["gate"], gate
        yield h["up"], up
        yield h["down"], full[m + "mlp.linear_fc2.weight"]
        yield h["input_layernorm"], full[m + "input_layernorm.weight"]
        yield h["post_norm"], full[m + "pre_mlp_layernorm.weight"]
    if pp_rank == pp - 1:
        yield "model.norm.weight", full["decoder.final_layernorm.weight"]
        if not spec.tied:
            yield "lm_head.weight", full["output_layer.weight"][: spec.vocab_size]
