"""GRPO: Group Relative Policy Optimization (DeepSeekMath; TRL's GRPOTrainer), as an rlcore plugin."""

from __future__ import annotations

from rlcore import AlgorithmSpec, hookimpl

from .config import GRPOConfig


@hookimpl
def rlcore_algorithms():
    from .trainer import GRPOTrainer

    yield AlgorithmSpec(
        "grpo",
        config=GRPOConfig,
        trainer=GRPOTrainer,
        description="GRPO (and DAPO, Dr. GRPO, GSPO variants) with HF or vLLM rollout, locally or on Ray",
        roles=("train", "rollout", "reference"),
    )
