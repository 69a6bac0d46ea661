"""The hf train engine's activation term against what autograd really saves: one train step of a real tiny Qwen2
on the CPU under `torch.autograd.graph.saved_tensors_hooks`, every saved floating-point storage counted once (the
weights left out), in float32 and bfloat16, full and LoRA, with and without gradient checkpointing. The GPU check of
the whole peak is tests/gpu/test_memory_gpu.py."""

from __future__ import annotations

import pytest
import torch

from rlcore import Batch
from rlcore.memory import ModelShape, shape_of
from rlcore.plugins.hf.memory import saved_per_token
from rlcore.plugins.hf.train import HFTrainEngine

ROWS, LENGTH = 3, 40


def saved_bytes(engine: HFTrainEngine) -> int:
    """Bytes of the floating-point storages one train step's forward saves for backward, each storage once."""
    weights = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if tensor.is_floating_point() and storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def nll(outputs, micro):
        logprobs = outputs.logprobs()
        return -(logprobs.sum(dim=1) * micro["weight"]).sum(), {}

    ids = torch.randint(3, 200, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), weight=torch.full((ROWS,), 1 / ROWS))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        engine.train_step(batch, nll, micro_batch_size=ROWS)
    return sum(seen.values())


@pytest.mark.parametrize("dtype,options", [
    ("float32", {}), ("bfloat16", {}), ("bfloat16", {"gradient_checkpointing": True}), ("float32", {"lora_rank": 8}),
    ("bfloat16", {"lora_rank": 8}), ("bfloat16", {"lora_rank": 8, "lora_dropout": 0.1}),
    ("bfloat16", {"lora_rank": 8, "gradient_checkpointing": True}),
], ids=["full-float32", "full-bfloat16", "checkpointing", "lora-float32", "lora-bfloat16", "lora-dropout",
        "lora-checkpointing"])
def test_the_activation_term_is_what_autograd_saves(tiny_model, dtype, options):
    engine = HFTrainEngine(str(tiny_model), device="cpu", dtype=dtype, learning_rate=1e-5, **options)
    shape: ModelShape = shape_of(str(tiny_model))
    checkpointing = bool(options.get("gradient_checkpointing"))
    d = torch.finfo(getattr(torch, dtype)).bits // 8
    mask = 4 if options.get("lora_dropout") else 0  # the CPU's dropout keeps its mask in the (float32) input's dtype
    predicted = ROWS * LENGTH * saved_per_token(shape, d, options.get("lora_rank", 0), mask, checkpointing)
    # cos and sin of every position, shared by the layers (under checkpointing each layer recomputes what it needs)
    rotary = 0 if checkpointing else 2 * LENGTH * shape.head_dim * d
    counted = saved_bytes(engine)
    assert counted == pytest.approx(predicted + rotary, rel=0.02), f"autograd saved {counted}, the term {predicted}"
