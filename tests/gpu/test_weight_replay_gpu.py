"""ReplayLoader over vLLM's own `load_weights` on a tiny Qwen2 model: a traced sync, then a replayed one,
against vLLM's plain `load_weights` of the same weights, bitwise, parameter by parameter.

The buckets are views of one flat buffer per dtype (`rlcore.runtime.weight_sync.flatten_bucket`), as a real sync
hands them to the engine. One vLLM instance serves the module.
"""

from __future__ import annotations

import pytest
import torch

from rlcore.plugins.vllm.weight_replay import ReplayLoader
from rlcore.runtime.weight_sync import flatten_bucket, iter_buckets, unflatten_bucket

BUCKET_BYTES = 1 << 20  # several buckets for this model, as a real sync has


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("qwen2") / "model", hidden_size=256, num_heads=4, num_kv_heads=2,
        intermediate_size=512, dtype="bfloat16",
    )


@pytest.fixture(scope="module")
def model(model_dir):
    """The vLLM model of an in-process engine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        llm = LLM(
            model=str(model_dir), gpu_memory_utilization=0.2, max_model_len=256, enforce_eager=True,
            dtype="bfloat16", seed=0,
        )
        yield llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


@pytest.fixture(scope="module")
def hf_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    """The Hugging Face names and shapes a train engine exports for this model."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def weights(shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(name, (torch.randn(*shape, generator=g) * 0.02).to(dtype)) for name, shape in shapes.items()]


def buckets(named: list[tuple[str, torch.Tensor]], device: str) -> list[list[tuple[str, torch.Tensor]]]:
    """The weights in buckets, each bucket's tensors views of one flat buffer per dtype on `device`."""
    return [unflatten_bucket(flatten_bucket(bucket, device=device)) for bucket in iter_buckets(named, BUCKET_BYTES)]


def snapshot(model) -> dict[str, torch.Tensor]:
    torch.cuda.synchronize()
    return {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("dtype, device", [(torch.bfloat16, "cuda"), (torch.float32, "cuda"), (torch.bfloat16, "cpu")])
def test_a_replayed_sync_loads_what_vllms_load_weights_loads(model, hf_shapes, dtype, device):
    loader = ReplayLoader(model.load_weights, [*model.parameters(), *model.buffers()])
    sync_a, sync_b = buckets(weights(hf_shapes, 1, dtype), device), buckets(weights(hf_shapes, 2, dtype), device)
    assert len(sync_a) > 1
    for bucket in sync_a:
        loader(bucket)
    for bucket in sync_b:
        loader(bucket)
    replayed = snapshot(model)
    assert loader.why_not == {}
    assert loader.stats() == {
        "traced": len(sync_a), "replayed": len(sync_b), "fallback": 0, "layouts": len(sync_a), "not_replayable": 0,
    }

    for bucket in sync_b:
        model.load_weights(weights=bucket)
    plain = snapshot(model)
    assert replayed.keys() == plain.keys()
    for name, want in plain.items():
        assert torch.equal(replayed[name], want), name

