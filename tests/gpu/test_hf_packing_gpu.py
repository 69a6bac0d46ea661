"""Packing in the hf train engine on CUDA, bf16: with torch's varlen_attn (`rlcore_varlen`, what a packed row runs
with on the GPU) and, forced, under sdpa (a dense block-causal mask) and flex_attention (a document BlockMask),
packed log-probs, a GRPO step's loss and gradients equal the padded ones within bf16's tolerance, and no token
attends across sequences; unset `padding_free` follows `PACK_WITH_VARLEN_BY_DEFAULT`.

Tolerances: bf16 keeps 8 bits (eps 2^-7 = 0.0078). A log-prob is a log-softmax over logits that carry bf16's
rounding from every layer, computed in other orders packed and padded: `LOGPROB` allows about 6 eps absolute and
2.5 eps relative. A parameter's gradient sums many such terms: `GRAD_NORM_ERROR` bounds the norm of the difference
at 8 eps of the padded gradient's norm (over all parameters: a gradient that is zero in exact arithmetic, k_proj's
bias, carries only rounding); a token attending across sequences moves it by order 1.

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_hf_packing_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from rlcore import Batch
from rlcore.plugins.grpo.objective import PolicyObjective
from rlcore.plugins.hf import attention
from rlcore.plugins.hf.train import HFTrainEngine
from rlcore.testing import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ATTENTION = [None, "sdpa", "flex_attention"]  # None: the engine's choice, torch's varlen_attn on an H200
BF16_EPS = torch.finfo(torch.bfloat16).eps
LOGPROB = dict(atol=6.4 * BF16_EPS, rtol=2.56 * BF16_EPS)
GRAD_NORM_ERROR = 8 * BF16_EPS
VARLEN_OP = "torch_attn::_varlen_attn"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """4 layers, 8 query heads sharing 2 key/value heads (GQA, as Qwen2's)."""
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


def packed_engine(model, attention_name, **keys) -> HFTrainEngine:
    engine = HFTrainEngine(str(model), device="cuda", dtype="bfloat16", attn_implementation=attention_name,
                           padding_free=True, **keys)
    assert engine.padding_free
    if attention_name is None:  # the varlen kernel took the model's attention
        assert engine.varlen and engine.model.config._attn_implementation == attention.VARLEN
    return engine


def ops_of(fn) -> set[str]:
    """The names of the torch ops `fn()` ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("attention_name", ATTENTION)
def test_packed_log_probs_equal_the_padded_ones_in_bf16(model, attention_name):
    batch = long_tailed()
    keys = dict(device="cuda", dtype="bfloat16", attn_implementation=attention_name, forward_only=True)
    padded = HFTrainEngine(str(model), padding_free=False, **keys)
    packed = packed_engine(model, attention_name, forward_only=True)
    want = padded.forward_logprobs(batch)
    got = None

    def run():
        nonlocal got
        got = packed.forward_logprobs(batch)

    ops = ops_of(run)
    if attention_name is None:  # every layer's attention ran torch's varlen kernel, none sdpa
        assert VARLEN_OP in ops and not any("scaled_dot_product" in op for op in ops)
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], **LOGPROB)
    changed = Batch(dict(batch))
    changed["input_ids"] = batch["input_ids"].clone()
    changed["input_ids"][0] = (changed["input_ids"][0] + 7) % 256
    again = packed.forward_logprobs(changed)
    torch.testing.assert_close(again[1:][mask[1:]], got[1:][mask[1:]], **LOGPROB)


def gradients(engine: HFTrainEngine) -> dict[str, torch.Tensor]:
    """Each trainable parameter's gradient once a train step has accumulated it (the step then zeroes it)."""
    grads: dict[str, torch.Tensor] = {}
    for name, p in engine.model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.float().clone()))
    return grads


@pytest.mark.parametrize("attention_name", ATTENTION)
def test_a_packed_token_budget_grpo_step_equals_the_padded_step_in_bf16(model, attention_name):
    batch = long_tailed()
    reference = HFTrainEngine(str(model), device="cuda", dtype="bfloat16", padding_free=False, forward_only=True)
    batch["old_logprobs"] = reference.forward_logprobs(batch)
    objective = PolicyObjective(beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=None, loss_type="dapo",
                                importance_sampling_level="token", max_completion_length=384,
                                num_items_in_batch=float(batch["completion_mask"].sum()), num_sequences_in_batch=16.0)
    steps, grads = {}, {}
    for packed in (False, True):
        engine = packed_engine(model, attention_name, learning_rate=1e-5) if packed else HFTrainEngine(
            str(model), device="cuda", dtype="bfloat16", attn_implementation=attention_name, padding_free=False,
            learning_rate=1e-5)
        grads[packed] = gradients(engine)
        steps[packed] = engine.train_step(batch, objective, micro_batch_size=4)
    assert steps[True]["loss"] == pytest.approx(steps[False]["loss"], rel=2.56 * BF16_EPS, abs=1e-3)
    assert steps[True]["grad_norm"] == pytest.approx(steps[False]["grad_norm"], rel=GRAD_NORM_ERROR)
    assert steps[True]["grad_norm"] > 0
    assert grads[True].keys() == grads[False].keys() and grads[False]
    # against the norm over every parameter: a gradient that is ~0 (k_proj's bias) carries only rounding
    norm = torch.stack([g.norm() for g in grads[False].values()]).norm()
    errors = {name: (grads[True][name] - want).norm() for name, want in grads[False].items()}
    worst = max(errors, key=errors.get)
    assert torch.stack(list(errors.values())).norm() <= GRAD_NORM_ERROR * norm, f"{worst} is off by {errors[worst]:.3g}"


def test_unset_padding_free_follows_the_gpu_default(model):
    """On an H200 in bf16 torch's varlen_attn is there; whether an unset padding_free packs with it is the one
    constant the GPU A/B decides."""
    engine = HFTrainEngine(str(model), device="cuda", dtype="bfloat16", forward_only=True)
    kernel, why = attention.varlen_kernel(engine.model, engine.device, None)
    assert kernel == attention.VARLEN, why
    assert engine.padding_free is attention.PACK_WITH_VARLEN_BY_DEFAULT
    assert engine.varlen is attention.PACK_WITH_VARLEN_BY_DEFAULT
