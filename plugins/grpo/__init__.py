"""GRPO: Group Relative Policy Optimization (DeepSeekMath; TRL's GRPOTrainer), as an rlcore plugin.

`GRPOConfig` and `GRPOTrainer` are exported here for subclassing; importing them loads no engine library.
"""

from __future__ import annotations

from pathlib import Path

from rlcore import AlgorithmSpec, hookimpl

from .config import GRPOConfig
from .trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]


@hookimpl
def rlcore_algorithms():
    yield AlgorithmSpec(
        "grpo", config=GRPOConfig, trainer=GRPOTrainer,
        description="GRPO (and DAPO, Dr. GRPO, GSPO variants) with HF or vLLM rollout, locally or on Ray",
        roles=("train", "rollout", "reference", "teacher"), demo=str(Path(__file__).with_name("demo.yaml")),
    )
