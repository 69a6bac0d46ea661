"""SFT and pre-training on the `default` role: every worker trains, one data-parallel world across Ray
workers and nodes (gloo on the CPU, NCCL on GPUs), or one process without Ray.

`sft` runs TRL's SFTTrainer in each worker, `pt` transformers' Trainer; rlcore adds the placement, the
world, the config, metrics JSONL and hooks, and checkpoints that --resume continues. Importing this module
loads no engine library.
"""

from __future__ import annotations

from pathlib import Path

from rlcore import AlgorithmSpec, hookimpl

from .config import PretrainConfig, SFTConfig
from .trainer import LMTrainer, PretrainTrainer, SFTTrainer

__all__ = ["LMTrainer", "PretrainConfig", "PretrainTrainer", "SFTConfig", "SFTTrainer"]


@hookimpl
def rlcore_algorithms():
    yield AlgorithmSpec(
        "sft", config=SFTConfig, trainer=SFTTrainer, roles=("default",), demo=str(Path(__file__).with_name("demo_sft.yaml")),
        description="supervised fine-tuning (TRL's SFTTrainer per worker), one data-parallel world, locally or on Ray",
    )
    yield AlgorithmSpec(
        "pt", config=PretrainConfig, trainer=PretrainTrainer, roles=("default",), demo=str(Path(__file__).with_name("demo_pt.yaml")),
        description="pre-training on plain text (transformers' Trainer per worker), one data-parallel world",
    )
