"""`dtype: auto` (every role's default) on a GPU: a bf16 checkpoint gives bf16 train and rollout engines (hf,
vLLM, megatron with fp32 main parameters beside them); a float32 checkpoint gives bf16 too, and float32 only
where it is asked for. The CPU side is tests/core/test_engine_checks.py.

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_dtype_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from rlcore.testing import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-bf16", dtype="bfloat16"))


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-fp32", dtype="float32"))


def test_hf_engines_load_a_bf16_checkpoint_in_bf16(bf16_model, fp32_model):
    from rlcore.plugins.hf.rollout import HFRolloutEngine
    from rlcore.plugins.hf.train import HFTrainEngine

    train = HFTrainEngine(bf16_model, device="cuda")
    assert {p.dtype for p in train.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in HFRolloutEngine(bf16_model, device="cuda").model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in HFTrainEngine(fp32_model, device="cuda").model.parameters()} == {torch.bfloat16}
    asked = HFTrainEngine(bf16_model, device="cuda", dtype="float32")
    assert {p.dtype for p in asked.model.parameters()} == {torch.float32}


def test_megatron_trains_bf16_weights_with_fp32_main_params(bf16_model):
    pytest.importorskip("megatron.core")
    from rlcore.plugins.megatron import make_train_engine

    engine = make_train_engine(model=bf16_model, device="cuda", learning_rate=1e-3, seed=0)
    assert engine.dtype == torch.bfloat16
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    main = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert main and {p.dtype for p in main} == {torch.float32}  # megatron's mixed precision: fp32 master copy


def test_vllm_does_not_upcast_a_bf16_checkpoint(bf16_model):
    pytest.importorskip("vllm")
    from rlcore.plugins.vllm.engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(bf16_model, vllm_gpu_memory_utilization=0.2, vllm_enforce_eager=True,
                               vllm_max_model_len=256)
    assert engine.llm.llm_engine.model_config.dtype == torch.bfloat16
