"""What both Hugging Face engines share: model loading and the model outputs a loss reads (per-token, at given
ids, full vocabulary, top-k). The option and device checks every engine shares are `rlcore.engine_checks`'."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rlcore import ConfigError
from rlcore.batch import right_padded
from rlcore.engines import ModelOutputs, TopK, aligned_rows, check_ids, checkpoint_layout, resolve_dtype
from rlcore.runtime import logger

if TYPE_CHECKING:
    import torch



def load_causal_lm(model: str, dtype: str, device: torch.device, liger_kernel: bool = False,
                   attn_implementation: str | None = None) -> Any:
    """AutoModelForCausalLM from a local directory or a hub id, on `device`, in `dtype` (`auto`: see
    `rlcore.engine_checks.resolve_dtype`), in eval mode, with `attn_implementation` (None: transformers' default);
    with `liger_kernel`, with liger-kernel's kernels (`apply_liger`). `compile_layers` is applied by the engine,
    after peft."""
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype, model, device.type == "cuda")
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        lm = AutoModelForCausalLM.from_pretrained(os.path.expanduser(str(model)), dtype=dtype, **extra)
    except OSError as exc:
        raise ConfigError(f"model={str(model)!r} could not be loaded: {exc}", [("model", str(exc))]) from exc
    lm = lm.to(device).eval()
    if liger_kernel:
        apply_liger(lm, device)
    return lm


def conditional_problems(model: Any) -> list[tuple[str, str]]:
    """What keeps the hf train engine from a `*ForConditionalGeneration` checkpoint, read before any weight: no
    language model found in it, or no causal LM of transformers for its config (the engine trains the language model
    that `AutoModelForCausalLM` loads and carries the rest). Other checkpoints: nothing."""
    try:
        layout = checkpoint_layout(model) if isinstance(model, str) and model else None
    except ConfigError as exc:
        return list(exc.problems or [("model", str(exc))])
    if layout is None:
        return []
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(layout.directory)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return []
    return [("model", f"'{model}' ({', '.join(config.architectures or [])}): transformers {_version('transformers')} has "
                      f"no causal LM for {type(config).__name__}, so its language model cannot be trained alone; "
                      "use a checkpoint of the language model")]


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def apply_liger(model: Any, device: Any) -> bool:
    """liger-kernel's fused RMSNorm, SwiGLU and rotary kernels in `model` (a CUDA device only: they are Triton
    kernels); its cross-entropy kernels stay off. Whether they were applied."""
    if device.type != "cuda":
        logger.info("liger_kernel: liger-kernel's kernels run on CUDA only; the model on %s keeps its torch modules", device)
        return False
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return True


def compile_layers(model: Any, backend: str = "inductor", mode: str | None = None) -> int:
    """`torch.compile` each decoder layer of `model` in place (regional compilation, as PyTorch's recipe does):
    the layers are the modules whose class transformers names in `_no_split_modules` (Qwen2DecoderLayer,
    LlamaDecoderLayer, ...). They share one class, so one compiled graph serves every layer; shapes are dynamic,
    so the micro-batches' varying widths reuse it too. `nn.Module.compile` keeps the module and its parameter
    names (no `_orig_mod.` prefix), so weight sync, saving and DDP see the same model. How many were compiled."""
    inner = getattr(model, "module", model)  # DistributedDataParallel
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"torch_compile: {type(base).__name__} names no decoder layer class in _no_split_modules "
                          "to compile; set torch_compile: false", [("torch_compile", "no decoder layers found")])
    for layer in layers:
        layer.compile(backend=backend, mode=mode, dynamic=True)
    logger.info("torch_compile: %d %s layers compiled (backend %s, mode %s); the first steps compile them",
                len(layers), type(layers[0]).__name__, backend, mode or "default")
    return len(layers)


class HFModelOutputs(ModelOutputs):
    """`ModelOutputs` from a causal LM's logits [B, T, V]: log-softmax at `temperature` in float32, each result
    computed once. `logprobs` and `logprobs_at` take the normaliser one row at a time and gather, so they
    never build the [B, T, V] log-probs that `full_logprobs` is."""

    def __init__(self, logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0):
        self.next_logits = logits[:, :-1]  # position t-1 predicts token t
        self.input_ids = input_ids
        self.valid = attention_mask.bool().clone()  # rows that hold a distribution: not row 0, not padding
        self.valid[:, 0] = False
        self.temperature = temperature
        self._cache: dict[str, torch.Tensor] = {}

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return logits / self.temperature if self.temperature != 1.0 else logits

    def _normaliser(self) -> torch.Tensor:
        """logsumexp of the scaled logits, [B, T-1]."""
        import torch

        if "lse" not in self._cache:
            self._cache["lse"] = torch.stack([torch.logsumexp(self._scaled(row), dim=-1) for row in self.next_logits])
        return self._cache["lse"]

    def _aligned(self, values: torch.Tensor) -> torch.Tensor:
        return aligned_rows(values, self.valid)

    def logprobs(self) -> torch.Tensor:
        if "logprobs" not in self._cache:
            picked = self.next_logits.gather(-1, self.input_ids[:, 1:, None]).squeeze(-1)
            self._cache["logprobs"] = self._aligned(self._scaled(picked) - self._normaliser())
        return self._cache["logprobs"]

    def logprobs_at(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.input_ids)
        ids = ids[:, 1:].to(self.next_logits.device, non_blocking=True).long()
        picked = self.next_logits.gather(-1, ids)
        return self._aligned(self._scaled(picked) - self._normaliser()[..., None])

    def full_logprobs(self) -> torch.Tensor:
        import torch

        if "full" not in self._cache:
            self._cache["full"] = self._aligned(torch.log_softmax(self._scaled(self.next_logits), dim=-1))
        return self._cache["full"]

    def topk(self, k: int) -> TopK:
        """The k most likely tokens of every row, in `TopK`'s layout (ids 0 where a row holds no distribution)."""
        top = self.full_logprobs().topk(min(k, self.next_logits.shape[-1]), dim=-1)
        return TopK(ids=top.indices.masked_fill(~self.valid[..., None], 0), logprobs=top.values)


def chunked_head_of(model: Any) -> Any | None:
    """The LM head (an `nn.Linear`) a chunked path can apply to `model`'s last hidden states itself, or None
    where the model's logits are more than that (a logit scale, soft-capping, an adapter on the head) or its
    forward takes no `logits_to_keep`."""
    import inspect

    import torch

    inner = getattr(model, "module", model)  # DistributedDataParallel
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft
    lm_head = base.get_output_embeddings()
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    plain = type(lm_head) is torch.nn.Linear and all(
        getattr(config, key, None) in (None, 1.0) for key in ("logit_scale", "output_multiplier", "lm_head_multiplier",
                                                              "logits_scaling", "final_logit_softcapping"))
    takes = "logits_to_keep" in inspect.signature(type(base).forward).parameters
    return lm_head if plain and takes else None


ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def packs_sequences(model: Any) -> bool:
    """Whether `model` keeps each sequence of a packed row to itself: every layer is attention, whose mask
    transformers builds from the restarting position ids. Layers that carry a state along the row (Qwen3.5's
    gated delta-net, Mamba's scan, their short convolutions) run through the sequences' boundaries in transformers,
    so such a model runs padded."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t not in ATTENTION_LAYERS for t in layer_types):
        return False
    names = " ".join(getattr(config, "architectures", None) or []) + " " + str(getattr(config, "model_type", ""))
    return not any(word in names.lower() for word in ("mamba", "jamba", "rwkv", "ssm", "next", "hybrid", "lfm2"))


def model_outputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                  chunked: bool = False, use_trl: bool | None = None, host_mask: torch.Tensor | None = None,
                  packed: bool = False, varlen: bool = False) -> ModelOutputs:
    """One forward pass of `model` (differentiable when grad is on): `HeadModelOutputs` of its last hidden
    states with `chunked` where `chunked_head_of(model)` allows it (the forward projects one position only),
    else `HFModelOutputs` of its logits. `host_mask`: the attention mask on the CPU, where the caller has it
    (the rows are found there, without waiting for the GPU).

    Where `host_mask` is right-padded the model is given no mask: a causal model's states at the real tokens are
    the same, transformers then builds no [B, 1, T, T] mask (nor reads the mask's values on the GPU to see whether
    it may skip it), and SDPA runs causal without a mask (its flash kernel where the device has one). With `packed`
    such rows run padding-free where they hold padding (`PackedRows`): the model sees their real tokens only; with
    `varlen` (the model's attention is a variable-length kernel) the sequences' boundaries go with them, as
    transformers' `cu_seq_lens_q/k` and `max_length_q/k`. The outputs keep `attention_mask` for which positions
    count, in the padded layout either way."""
    lm_head = chunked_head_of(model) if chunked else None
    padded = host_mask is not None and right_padded(host_mask)
    pack = PackedRows.of(input_ids, host_mask) if packed and padded else None
    model_mask = None if padded else attention_mask
    inputs = dict(input_ids=input_ids, attention_mask=model_mask, use_cache=False)
    if pack is not None:  # one row of every real token; transformers masks each sequence off from the others
        inputs = dict(input_ids=pack.input_ids, position_ids=pack.position_ids, attention_mask=None, use_cache=False)
        if varlen:
            inputs.update(cu_seq_lens_q=pack.cu_seq_lens, cu_seq_lens_k=pack.cu_seq_lens, max_length_q=pack.max_length,
                          max_length_k=pack.max_length)
    if lm_head is None:
        logits = model(**inputs).logits
        logits = logits if pack is None else pack.unpack(logits)
        return HFModelOutputs(logits, input_ids, attention_mask, temperature)
    base = getattr(model, "base_model", None)
    if base is not None and base is not model and not hasattr(model, "module") and not hasattr(model, "get_base_model"):
        # a plain causal LM: its decoder's last hidden state, without every layer's (output_hidden_states keeps
        # them all until the outputs go) or the head's one position
        hidden = base(**inputs).last_hidden_state
    else:  # through the wrapper's own forward (DDP's gradient hooks, peft's adapters)
        hidden = model(**inputs, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    hidden = hidden if pack is None else pack.unpack(hidden)
    from rlcore.head import HeadModelOutputs  # torch, at first use: importing the plugin imports none

    return HeadModelOutputs(hidden, lm_head, input_ids, attention_mask, temperature, use_trl, host_mask)


class PackedRows:
    """Right-padded rows [B, T] as one row of their real tokens [1, N] (padding-free), with each sequence's own
    position ids, as transformers' `DataCollatorWithFlattening` lays them out. Given position ids that restart and
    no attention mask, transformers' causal mask keeps every token to its own sequence
    (`masking_utils.find_packed_sequence_indices`: a block-causal mask for sdpa and eager, a document `BlockMask`
    for flex_attention, varlen kernels for flash_attention_2/3), so a token's states are those of its padded row.
    `unpack` puts a packed [1, N, ...] result back in the padded layout [B, T, ...] (zeros at padding; a
    differentiable `index_copy`), so a loss reads the same shapes either way. `cu_seq_lens` (int32, on the device)
    and `max_length` are the sequences' boundaries and longest length, as variable-length kernels take them."""

    def __init__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, index: torch.Tensor, shape: tuple[int, int],
                 cu_seq_lens: torch.Tensor, max_length: int):
        self.input_ids, self.position_ids, self.index, self.shape = input_ids, position_ids, index, shape
        self.cu_seq_lens, self.max_length = cu_seq_lens, max_length

    @classmethod
    def of(cls, input_ids: torch.Tensor, host_mask: torch.Tensor) -> PackedRows | None:
        """The packed form of `input_ids` whose right-padded CPU mask is `host_mask`, or None where packing saves
        nothing (one row, or no padding: the model then runs causal on the rows as they are)."""
        import torch

        from rlcore.batch import copy_to

        B, T = host_mask.shape
        mask = host_mask.bool()
        if B < 2 or bool(mask.all()) or not bool(mask.any()):
            return None
        index = mask.reshape(-1).nonzero().squeeze(1)  # found on the CPU: no wait for the device
        positions = (mask.long().cumsum(dim=1) - 1).reshape(-1).index_select(0, index)
        lengths = mask.sum(dim=1, dtype=torch.int32)
        lengths = lengths[lengths > 0]
        cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        device = input_ids.device
        index, positions, cu_seq_lens = (copy_to(t, device) for t in (index, positions, cu_seq_lens))
        return cls(input_ids.reshape(-1).index_select(0, index)[None], positions[None], index, (B, T), cu_seq_lens,
                   int(lengths.max()))

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] -> [B, T, ...], zeros where the rows are padding."""
        flat = packed[0]
        out = flat.new_zeros(self.shape[0] * self.shape[1], *flat.shape[1:])
        return out.index_copy(0, self.index, flat).view(*self.shape, *flat.shape[1:])
