"""The Hugging Face engines: `hf` as a train engine (transformers + torch, DDP across a group's workers),
as a forward engine (the same model without optimizer: a reference or a colocated teacher) and as a rollout
engine (a batched sampling loop with a KV cache). Importing this module imports neither torch nor
transformers; the factories do.
"""

from __future__ import annotations

from typing import Any

from rlcore import EngineSpec, build_engine, hookimpl
from rlcore.engines import options_check

from .keys import HFForwardKeys, HFTrainKeys
from .memory import forward_memory, rollout_memory, train_memory
from .rollout import HFRolloutEngine
from .train import HFOptions, HFTrainEngine

__all__ = ["make_forward_engine", "make_rollout_engine", "make_train_engine"]

# What a forward engine takes: the model and how to run it; nothing about training.
FORWARD_OPTIONS = ("model", "dtype", "device", "logprob_micro_batch_size", "seed", "chunked_lm_head", "padding_free",
                   "attn_implementation", "liger_kernel",
                   "torch_compile", "torch_compile_backend", "torch_compile_mode")


def _build(cls: type, kind: str, options: dict[str, Any], known: tuple[str, ...] = (), **fixed: Any) -> Any:
    return build_engine(cls, f"hf {kind} engine", options, known, **fixed)


def make_train_engine(**options: Any) -> Any:
    """An `HFTrainEngine(**options)`; unknown options are a ConfigError naming the closest one."""
    return _build(HFTrainEngine, "train", options, HFOptions.keys())


def make_forward_engine(**options: Any) -> Any:
    """An `HFTrainEngine(forward_only=True, **options)`: no optimizer, `train_step` refuses; options are
    those of FORWARD_OPTIONS."""
    return _build(HFTrainEngine, "forward", options, FORWARD_OPTIONS, forward_only=True)


def make_rollout_engine(**options: Any) -> Any:
    """An `HFRolloutEngine(**options)`; unknown options are a ConfigError naming the closest one."""
    return _build(HFRolloutEngine, "rollout", options)


@hookimpl
def rlcore_engines():
    imports = ("torch", "transformers")  # what a worker imports ahead of the build (EngineSpec.imports)
    yield EngineSpec("hf", kind="train", factory=make_train_engine, description="transformers + torch; DDP over a group",
                     imports=imports, check=options_check(HFOptions, "hf train engine"), memory=train_memory,
                     keys=HFTrainKeys)
    yield EngineSpec("hf", kind="forward", factory=make_forward_engine,
                     description="the hf train engine without optimizer: reference and teacher models", imports=imports,
                     memory=forward_memory, keys=HFForwardKeys)
    yield EngineSpec("hf", kind="rollout", factory=make_rollout_engine,
                     description="transformers sampling loop with a KV cache", imports=imports,
                     memory=rollout_memory)
    yield EngineSpec("hf", kind="teacher", factory=make_rollout_engine,
                     description="the hf rollout engine serving top-k log-probs", imports=imports,
                     memory=rollout_memory)
