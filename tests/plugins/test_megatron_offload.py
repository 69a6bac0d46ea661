"""The megatron engine's offload bookkeeping (`HostOffload`) and its SDPA layer spec, on the CPU.

`HostOffload("cpu")` runs the same storage bookkeeping the GPU offload runs (copy out, resize to zero bytes,
resize back, copy in) on CPU storages, so what breaks it (views into a shared buffer, an optimizer param that
is a model param, Adam state keyed by param) is tried here on a real megatron engine and its optimizer. The
GPU half (pinned copies, memory falling to near zero, vLLM sleeping beside it) is `tests/gpu/test_megatron_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from rlcore.batch import Batch

pytest.importorskip("megatron.core")

from rlcore.plugins.megatron import make_train_engine  # noqa: E402
from rlcore.plugins.megatron.support import HostOffload  # noqa: E402


def _batch() -> Batch:
    ids = torch.randint(0, 260, (4, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": mask})


def _loss(outputs, micro):
    return -(outputs.logprobs() * micro["completion_mask"]).sum() / 40, {}


def test_views_and_a_shared_storage_come_back_bitwise_and_move_once():
    buffer = torch.randn(64)
    views = [buffer[:16].view(4, 4), buffer[16:]]  # megatron's params: views into one contiguous buffer
    alias = buffer[:16]  # an fp32 param that is its own main param
    moment = torch.randn(16)
    grads = torch.randn(64)
    expected = buffer.clone(), moment.clone()
    host = HostOffload("cpu")
    host.offload("grads", [grads], keep=False)
    host.offload("optimizer", [alias, moment], skip=views)  # the alias stays for "params" to move
    host.offload("params", views)
    assert buffer.untyped_storage().nbytes() == 0 and moment.untyped_storage().nbytes() == 0
    assert grads.untyped_storage().nbytes() == 0
    assert [n for _, n, _ in host.away["optimizer"]] == [64]  # the moment alone, 16 float32
    assert "params" in host and "optimizer" in host
    for what in ("params", "grads", "optimizer"):
        host.reload(what)
    assert torch.equal(buffer, expected[0]) and torch.equal(moment, expected[1])
    assert torch.equal(views[0].flatten(), expected[0][:16]) and torch.equal(alias, expected[0][:16])
    assert torch.equal(grads, torch.zeros(64))  # dropped grads come back as zeros
    assert "params" not in host


def test_an_engine_offloaded_and_reloaded_trains_on_exactly_as_one_that_stayed(tiny_model):
    kept = make_train_engine(model=str(tiny_model), learning_rate=1e-2, seed=0)
    moved = make_train_engine(model=str(tiny_model), learning_rate=1e-2, seed=0)
    for engine in (kept, moved):
        engine.train_step(_batch(), _loss, micro_batch_size=2)  # Adam state exists from here on
    params = list(moved.module.parameters())
    before = [p.detach().clone() for p in params]
    host = HostOffload("cpu")  # the GPU path's bookkeeping on this engine's real tensors
    host.offload("optimizer", moved._optimizer_tensors(), skip=params)
    host.offload("params", params)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    host.reload("params")
    host.reload("optimizer")
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    second = [engine.train_step(_batch(), _loss, micro_batch_size=2) for engine in (kept, moved)]
    assert second[0]["loss"] == second[1]["loss"] and second[0]["grad_norm"] == second[1]["grad_norm"]
    for a, b in zip(kept.module.parameters(), moved.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_core_attention_is_sdpa(tiny_model):
    from rlcore.plugins.megatron.attention import SdpaAttention

    engine = make_train_engine(model=str(tiny_model), seed=0)
    layers = engine.module.decoder.layers
    assert layers and all(isinstance(layer.self_attention.core_attention, SdpaAttention) for layer in layers)
