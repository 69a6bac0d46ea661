"""The `vllm` engine: rollout and teacher roles served by vLLM's offline engine in the worker's process.

Importing this plugin does not import vLLM; building an engine does (`pip install 'rlcore[vllm]'`).
"""

from __future__ import annotations

from rlcore import EngineSpec, hookimpl

from .checks import advice, config_problems, syncs_adapter
from .engine import VLLMRolloutEngine, check_options
from .keys import VLLMKeys, VLLMRolloutKeys
from .memory import vllm_memory

__all__ = ["VLLMKeys", "VLLMRolloutEngine", "VLLMRolloutKeys"]


@hookimpl
def rlcore_engines():
    yield EngineSpec("vllm", kind="rollout", factory=VLLMRolloutEngine, description="vLLM offline engine; sleep mode, in-process weight loading",
                     imports=("vllm",), check=check_options, memory=vllm_memory, keys=VLLMRolloutKeys,
                     config_check=config_problems, syncs_adapter=syncs_adapter, advice=advice)
    yield EngineSpec("vllm", kind="teacher", factory=VLLMRolloutEngine, description="vLLM prompt top-k log-probs for distillation",
                     imports=("vllm",), check=check_options, memory=vllm_memory, keys=VLLMKeys,
                     advice=advice)
