"""The megatron engine: megatron-core's GPTModel with tensor, pipeline and data parallelism, as a train engine
and as a forward engine (the same model without optimizer: a reference or a colocated teacher). Weights
come in and go out in Hugging Face names (Qwen2 and Llama; `mapping`). Importing this module imports
neither torch nor megatron-core; the factories do (`pip install 'rlcore[megatron]'`).
"""

from __future__ import annotations

from typing import Any

from rlcore import EngineSpec, build_engine, hookimpl
from rlcore.errors import ConfigError

from .support import MegatronOptions

__all__ = ["make_forward_engine", "make_train_engine"]

# what a worker imports ahead of the build (EngineSpec.imports): megatron-core's model, DDP and optimizer
IMPORTS = ("torch", "transformers", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer")

# What a forward engine takes: the model, where and how to split it; nothing about training.
FORWARD_OPTIONS = (
    "model", "dtype", "device", "logprob_micro_batch_size", "seed", "dist_timeout_s",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by",
)


def _engine_class() -> type:
    try:
        from .engine import MegatronTrainEngine
    except ImportError as exc:
        raise ConfigError(
            f"the megatron engine needs megatron-core ({exc}); install it with pip install 'rlcore[megatron]'",
            [("engine", "megatron-core is not installed")],
        ) from exc
    return MegatronTrainEngine


def _build(kind: str, options: dict[str, Any], known: tuple[str, ...] = (), **fixed: Any) -> Any:
    known = known or tuple(k for k in MegatronOptions.keys() if k != "forward_only")
    return build_engine(_engine_class(), f"megatron {kind} engine", options, known, **fixed)


def make_train_engine(**options: Any) -> Any:
    """A `MegatronTrainEngine(**options)`; unknown options are a ConfigError naming the closest one."""
    return _build("train", options)


def make_forward_engine(**options: Any) -> Any:
    """A `MegatronTrainEngine(forward_only=True, **options)`: no optimizer, `train_step` refuses."""
    return _build("forward", options, FORWARD_OPTIONS, forward_only=True)


@hookimpl
def rlcore_engines():
    yield EngineSpec("megatron", kind="train", factory=make_train_engine, imports=IMPORTS,
                     description="megatron-core GPTModel (local spec): TP/PP/DP, distributed optimizer, vocab-parallel log-probs")
    yield EngineSpec("megatron", kind="forward", factory=make_forward_engine, imports=IMPORTS,
                     description="the megatron train engine without optimizer: reference and teacher models")
