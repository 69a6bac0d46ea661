"""Padding-free packing in the hf train engine on CUDA, bf16: packed log-probs and a GRPO step's loss and gradient
norm equal the padded ones within bf16's tolerance under sdpa (a dense block-causal mask) and flex_attention (a
document BlockMask), and no token attends across sequences.

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_hf_packing_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from rlcore import Batch
from rlcore.plugins.grpo.objective import PolicyObjective
from rlcore.plugins.hf.train import HFTrainEngine
from rlcore.testing import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ATTENTION = ["sdpa", "flex_attention"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "packing-qwen2", hidden_size=256, num_layers=4,
                            num_heads=8, num_kv_heads=2, intermediate_size=512, dtype="bfloat16")


def long_tailed(rows: int = 16, width: int = 384, seed: int = 0) -> Batch:
    """Rows whose lengths fall off like reasoning traces: most short, a few to the width."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.distributions.Exponential(1 / 60).sample((rows,)).long() + 8).clamp(max=width)
    lengths[0] = width
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = torch.randint(0, 256, (rows, width), generator=g).masked_fill(mask == 0, 265)
    completion = mask.clone()
    completion[:, :6] = 0
    return Batch(input_ids=ids, attention_mask=mask, completion_mask=completion,
                 advantages=torch.randn(rows, generator=g))


@pytest.mark.parametrize("attention", ATTENTION)
def test_packed_log_probs_equal_the_padded_ones_in_bf16(model, attention):
    batch = long_tailed()
    keys = dict(device="cuda", dtype="bfloat16", attn_implementation=attention, forward_only=True)
    padded = HFTrainEngine(str(model), padding_free=False, **keys)
    packed = HFTrainEngine(str(model), **keys)
    want, got = padded.forward_logprobs(batch), packed.forward_logprobs(batch)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=5e-2, rtol=2e-2)
    changed = Batch(dict(batch))
    changed["input_ids"] = batch["input_ids"].clone()
    changed["input_ids"][0] = (changed["input_ids"][0] + 7) % 256
    again = packed.forward_logprobs(changed)
    torch.testing.assert_close(again[1:][mask[1:]], got[1:][mask[1:]], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("attention", ATTENTION)
def test_a_packed_token_budget_grpo_step_equals_the_padded_step_in_bf16(model, attention):
    batch = long_tailed()
    reference = HFTrainEngine(str(model), device="cuda", dtype="bfloat16", padding_free=False, forward_only=True)
    batch["old_logprobs"] = reference.forward_logprobs(batch)
    objective = PolicyObjective(beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=None, loss_type="dapo",
                                importance_sampling_level="token", max_completion_length=384,
                                num_items_in_batch=float(batch["completion_mask"].sum()), num_sequences_in_batch=16.0)
    steps = {}
    for padding_free in (False, True):
        engine = HFTrainEngine(str(model), device="cuda", dtype="bfloat16", attn_implementation=attention,
                               padding_free=padding_free, learning_rate=1e-5)
        steps[padding_free] = engine.train_step(batch, objective, micro_batch_size=4)
    assert steps[True]["loss"] == pytest.approx(steps[False]["loss"], rel=2e-2, abs=1e-3)
    assert steps[True]["grad_norm"] == pytest.approx(steps[False]["grad_norm"], rel=5e-2)
    assert steps[True]["grad_norm"] > 0
