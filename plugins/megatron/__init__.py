"""The megatron engine: megatron-core's GPTModel with tensor, pipeline and data parallelism, as a train engine
and as a forward engine (the same model without optimizer: a reference or a colocated teacher). Weights
come in and go out in Hugging Face names (the architectures `mapping.ARCHITECTURES` declares). Importing this module imports
neither torch nor megatron-core; the factories do (`pip install 'rlcore[megatron]'`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlcore import ConfigError, EngineSpec, build_engine, hookimpl
from rlcore.engines import common_problems, unknown_options

from .keys import MegatronKeys
from .memory import megatron_forward_memory, train_memory
from .support import MegatronOptions, model_problems, option_problems

__all__ = ["make_forward_engine", "make_train_engine"]

# what a worker imports ahead of the build (EngineSpec.imports): megatron-core's model, DDP and optimizer
IMPORTS = ("torch", "transformers", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer")

# What a forward engine takes: the model, where and how to split it; nothing about training.
FORWARD_OPTIONS = (
    "model", "dtype", "device", "logprob_micro_batch_size", "seed", "dist_timeout_s",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "make_vocab_size_divisible_by",
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


def _check(kind: str, known: tuple[str, ...] = ()) -> Any:
    """`EngineSpec.check`: the engine's own problems with `options` (unknown keys; option values; the model's
    architecture, its configuration and the parallel sizes against its heads, layers and experts), found from the
    model's config.json without a device. Where the options name no device the workers get one later, so the
    CPU's limits are checked only for `device: cpu`."""
    name = f"megatron {kind} engine"

    def check(**options: Any) -> list[tuple[str, str]]:
        keys = known or tuple(k for k in MegatronOptions.keys() if k != "forward_only")
        unknown = unknown_options(name, options, keys)
        if unknown:
            return unknown
        o = MegatronOptions.of(**options, forward_only=kind == "forward")
        flat = {**{f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.name != "optimizer"},
                **dataclasses.asdict(o.optimizer), "device": options.get("device", "cuda")}
        problems = common_problems(o.model, o.dtype, "cpu") + option_problems(flat)
        if not any(key == "model" for key, _ in problems):
            problems += model_problems(flat, None)[1]
        return problems

    return check


def layout(**options: Any) -> tuple[int, int]:
    """(tensor, pipeline): the workers one replica of the model spans, from the engine's own keys."""
    return int(options.get("tensor_model_parallel_size", 1)), int(options.get("pipeline_model_parallel_size", 1))


@hookimpl
def rlcore_engines():
    yield EngineSpec("megatron", kind="train", factory=make_train_engine, imports=IMPORTS, check=_check("train"),
                     memory=train_memory, layout=layout, keys=MegatronKeys,
                     description="megatron-core GPTModel (local spec): TP/PP/EP/DP, distributed optimizer, vocab-parallel log-probs")
    yield EngineSpec("megatron", kind="forward", factory=make_forward_engine, imports=IMPORTS,
                     check=_check("forward", FORWARD_OPTIONS), memory=megatron_forward_memory, layout=layout, keys=MegatronKeys,
                     description="the megatron train engine without optimizer: reference and teacher models")
