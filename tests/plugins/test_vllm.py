"""The vllm plugin on a machine without vLLM: it registers, imports nothing heavy, and rejects bad options
before vLLM is imported. Its GPU behaviour is tested in tests/gpu/test_vllm_engine.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlcore import ConfigError, RlcoreError, load_plugins
from rlcore.plugins.vllm import VLLMRolloutEngine


def test_registers_a_rollout_and_a_teacher_engine():
    engines = load_plugins().engines
    assert engines.get("vllm", kind="rollout").factory is VLLMRolloutEngine
    assert engines.get("teacher/vllm").factory is VLLMRolloutEngine


def test_importing_the_plugin_imports_neither_vllm_nor_torch():
    code = "import sys, rlcore.plugins.vllm; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]


def test_bad_options_are_all_reported_before_vllm_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of vllm would raise ImportError
    with pytest.raises(ConfigError) as info:
        VLLMRolloutEngine(
            model="",
            vllm_tensor_parallel_size=0,
            vllm_gpu_memory_utilization=1.5,
            vllm_max_model_len=-4,
            vllm_engine_kwargs={"gpu_memory_utilization": 0.5, "logprobs_mode": "raw_logprobs"},
        )
    keys = [key for key, _ in info.value.problems]
    assert keys == [
        "model",
        "vllm_tensor_parallel_size",
        "vllm_gpu_memory_utilization",
        "vllm_max_model_len",
        "vllm_engine_kwargs.gpu_memory_utilization",
        "vllm_engine_kwargs.logprobs_mode",
    ]
    assert "use vllm_gpu_memory_utilization instead" in str(info.value)


def test_missing_vllm_is_a_clear_error_after_choosing_the_in_process_engine_core(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after the test
    with pytest.raises(RlcoreError, match=r"the vllm engine needs vLLM: pip install 'rlcore\[vllm\]'"):
        VLLMRolloutEngine(model="/models/tiny")
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
