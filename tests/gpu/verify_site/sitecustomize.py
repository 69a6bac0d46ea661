"""Loaded by every Python process that `tests/gpu/verify.py` starts side by side on one GPU (it puts this folder first
on PYTHONPATH; Ray's workers and vLLM's engine processes inherit it).

Every vLLM engine those processes build takes a fixed KV cache (RLCORE_VERIFY_KV_CACHE_BYTES) unless its caller chose
one. vLLM 0.26 otherwise sizes its cache from a memory profile of the whole device, and counts what the tests beside
it allocate meanwhile as its own, and refuses to start where `gpu_memory_utilization` of the device is not free.
With a fixed cache it skips the profile; its utilization is lowered to what the fixed cache needs, for the start
check only. FlashInfer's autotune (about 20 s a start) tunes kernels for tiny models that nothing here times.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_BYTES = int(os.environ.get("RLCORE_VERIFY_KV_CACHE_BYTES") or 0)
_MODULE = "vllm.engine.arg_utils"


def _fix(engine_args_class: type) -> None:
    post_init = engine_args_class.__post_init__

    def __post_init__(self) -> None:
        if getattr(self, "kv_cache_memory_bytes", None) is None:
            self.kv_cache_memory_bytes = _BYTES
            self.gpu_memory_utilization = min(self.gpu_memory_utilization, 0.05)
            if getattr(self, "enable_flashinfer_autotune", None) is None:
                self.enable_flashinfer_autotune = False
        post_init(self)

    engine_args_class.__post_init__ = __post_init__


class _Patch(importlib.abc.MetaPathFinder):
    """Patches vLLM's EngineArgs once its module has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _fix(module.EngineArgs)

        spec.loader.exec_module = exec_module
        return spec


if _BYTES > 0:
    sys.meta_path.insert(0, _Patch())
