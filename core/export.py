"""The trained model as a Hugging Face folder (weights, config, generation config, tokenizer): what
`AutoModelForCausalLM.from_pretrained` and vLLM load. A train engine's `export_weights` gives the weights in
Hugging Face names (LoRA merged into the base weights, megatron's mapped back), so one writer serves all."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .log import logger


def write_hf_model(path: str | Path, buckets: Iterable[list[tuple[str, Any]]], source: str, write: bool = True) -> None:
    """Write `buckets` (`export_weights`' lists of (name, tensor)) as safetensors into `path`, with the
    config, generation config and tokenizer of `source` (the model the engine was built from). Every rank
    iterates its buckets (megatron's export is a collective); only where `write` is the folder written. From a
    `*ForConditionalGeneration` checkpoint the language model's weights take the checkpoint's names and the rest of
    it (the vision tower) is copied unchanged, so the folder loads as its config says (`rlcore.conditional`)."""
    tensors = {}
    for bucket in buckets:
        if write:
            tensors.update((name, tensor.detach().to("cpu", copy=True).contiguous()) for name, tensor in bucket)
    if not write:
        return
    from .conditional import checkpoint_layout

    layout = checkpoint_layout(source)
    if layout is not None:  # a conditional-generation checkpoint: its names, and its vision tower as it was
        tensors = dict(layout.with_carried(tensors.items()))
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(tensors, path, max_shard_size="5GB")
    config = AutoConfig.from_pretrained(source)
    floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floating) == 1:  # the weights' dtype, so a loader with dtype="auto" reads them as written
        config.dtype = floating.pop()
    config.save_pretrained(path)
    with contextlib.suppress(OSError, ValueError):
        GenerationConfig.from_pretrained(source).save_pretrained(path)
    try:
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
    except (OSError, ValueError) as exc:
        logger.warning(f"{path}: the model was written without a tokenizer; {source} has none that loads ({exc})")
