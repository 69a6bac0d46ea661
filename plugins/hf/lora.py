"""LoRA weights as the base model's Hugging Face names, merged: what a rollout engine without adapters loads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def lora_merged_tensors(peft_model: Any) -> Iterator[tuple[str, Any]]:
    """(base name, tensor) for every base weight, with W + scale * B @ A for the adapted ones.

    Computed on the fly rather than by merge/unmerge, so the trained base weights never drift by rounding.
    Call under `torch.no_grad()`.
    """
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    merged: dict[str, Any] = {}
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight.detach()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
            merged[f"{module_name}.base_layer.weight"] = weight
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        tensor = merged.get(name, param.detach())
        yield name.replace(".base_layer.", "."), tensor
