"""A decoder's shapes as its config.json gives them, and what they take in memory: parameters, LoRA adapters, the KV
cache per token, the activations backward keeps per token. Nothing is loaded; `rlcore.memory` sums the engines'
terms built on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shapes, read from config.json: what its weights, KV cache and activations take."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    attention_bias: bool = False
    experts: int = 0  # routed experts of a MoE layer (0: dense)
    expert_intermediate: int = 0
    experts_per_token: int = 0
    shared_intermediate: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape | None:
        """The shape a config.json (or its `text_config`) gives; None where it lacks a decoder's keys."""
        c = config.get("text_config") or config
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if not all(isinstance(c.get(k), int) for k in need):
            return None
        heads = c["num_attention_heads"]
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
        return cls(
            hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate=c.get("intermediate_size") or 4 * c["hidden_size"], vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", True))),
            attention_bias=bool(c.get("attention_bias", c.get("model_type", config.get("model_type")) == "qwen2")),
            experts=int(experts), expert_intermediate=int(c.get("moe_intermediate_size") or 0),
            experts_per_token=int(c.get("num_experts_per_tok") or 0),
            shared_intermediate=int(c.get("shared_expert_intermediate_size") or 0),
        )

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's linear weights: attention, then the MLP (a MoE's routed and shared experts)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [(h, q), (h, kv), (h, kv), (q, h)]
        if self.experts:
            expert = self.expert_intermediate
            out += [(h, expert), (h, expert), (expert, h)] * self.experts
            out.append((h, self.experts))
            if self.shared_intermediate:
                out += [(h, self.shared_intermediate), (h, self.shared_intermediate), (self.shared_intermediate, h)]
        else:
            out += [(h, self.intermediate), (h, self.intermediate), (self.intermediate, h)]
        return out

    @property
    def params(self) -> int:
        """Every weight: embeddings, layers (linears, biases, norms), final norm, and the head when untied."""
        per_layer = sum(i * o for i, o in self.linears()) + 2 * self.hidden
        if self.attention_bias:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden + head

    def linear_names(self) -> list[str]:
        """The Hugging Face name of each of `linears()` (a MoE's experts and shared expert as their projections, its
        router as `gate`)."""
        mlp = ["gate_proj", "up_proj", "down_proj"]
        names = ["q_proj", "k_proj", "v_proj", "o_proj"]
        if self.experts:
            names += mlp * self.experts + ["gate"] + (mlp if self.shared_intermediate else [])
        else:
            names += mlp
        return names

    def lora_params(self, rank: int, targets: Any = "all-linear") -> int:
        """LoRA's A and B on the linears `targets` names (peft's `target_modules`): `all-linear` is every linear of
        every layer but a MoE's router, the head left out; a list names projections (`q_proj`, ..., `lm_head`;
        megatron's fused linears name those they hold); anything else (a pattern, a name this shape does not know)
        counts every linear and the head, an upper bound."""
        names, linears = lora_names(targets), self.linear_names()
        if names is None:
            named, head = set(linears) - {"gate"}, not self.tied
        else:
            named, head = names - {HEAD}, HEAD in names
        per_layer = sum(rank * (i + o) for (i, o), name in zip(self.linears(), linears) if name in named)
        return self.layers * per_layer + (rank * (self.hidden + self.vocab) if head else 0)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_bytes_per_token(self, dtype_bytes: int, checkpointing: bool = False) -> int:
        """What backward keeps of one token, summed over the layers, with flash/SDPA attention (no [T, T] scores).

        Per layer, a pre-norm decoder with SwiGLU saves (Korthikanti et al. 2022, "Reducing Activation
        Recomputation in Large Transformer Models", counted for this block): the two norms' inputs and outputs (4h),
        q, k, v and their rotated q, k (2q + 3kv), the attention output (q), the gate and up outputs, the activation
        and the product (4I; a MoE: each token's `experts_per_token` experts plus the shared one), all in the
        model's dtype. With gradient checkpointing only each layer's input (h) is kept, plus one layer recomputed.
        """
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        inter = self.intermediate
        if self.experts:
            inter = self.experts_per_token * self.expert_intermediate + self.shared_intermediate
        layer = (4 * h + 3 * q + 3 * kv + 4 * inter) * dtype_bytes
        if checkpointing:
            return self.layers * h * dtype_bytes + layer
        return self.layers * layer


HEAD = "lm_head"
ALL_LINEAR = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# megatron's fused linears (the megatron engine's names) and the Hugging Face projections each holds
FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "qkv_proj": ("q_proj", "k_proj", "v_proj"),
         "linear_proj": ("o_proj",), "linear_fc1": ("gate_proj", "up_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "linear_fc2": ("down_proj",), "output_layer": (HEAD,)}


def lora_names(targets: Any) -> set[str] | None:
    """The projections `lora_target_modules` adapts, as Hugging Face names; None where they cannot be told from the
    names alone (a pattern, or a name that is no projection this shape counts)."""
    if targets == "all-linear":
        return set(ALL_LINEAR)
    if isinstance(targets, str) or not isinstance(targets, (list, tuple, set)):
        return None
    names: set[str] = set()
    for target in targets:
        last = str(target).rsplit(".", 1)[-1]  # peft matches an entry at the end of a module's name
        if last == "all-linear":
            names |= ALL_LINEAR
        elif last in FUSED:
            names.update(FUSED[last])
        elif last in ALL_LINEAR or last == HEAD:
            names.add(last)
        else:
            return None
    return names


def shape_of(name: str | None) -> ModelShape | None:
    """The shape of a model (a directory, or a hub id in the local cache) from its config.json; None where it
    cannot be read (nothing is downloaded)."""
    if not name:
        return None
    from .model_checks import read_model

    files = read_model(str(name))
    return ModelShape.from_config(files.config) if files is not None and files.config else None


def dtype_bytes(dtype: str | None, cuda: bool = True) -> int:
    """Bytes per weight of `dtype` as the engines resolve it: `auto` on a GPU is the checkpoint's half precision
    (bfloat16 for a float32 checkpoint), on the CPU float32."""
    if dtype and dtype != "auto":
        return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2)
    return 2 if cuda else 4
