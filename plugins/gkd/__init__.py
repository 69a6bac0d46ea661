"""GKD: Generalized Knowledge Distillation (Agarwal et al., 2024; TRL's GKDTrainer), as an rlcore plugin.

`GKDConfig`, `GKDTrainer` and the loss (`rlcore.plugins.gkd.loss.jsd_loss`, `topk_jsd_loss`) are there for
reuse; importing the plugin loads no engine library (the loss module imports torch).
"""

from __future__ import annotations

from pathlib import Path

from rlcore import AlgorithmSpec, hookimpl

from .config import GKDConfig
from .trainer import GKDTrainer

__all__ = ["GKDConfig", "GKDTrainer"]


@hookimpl
def rlcore_algorithms():
    yield AlgorithmSpec(
        "gkd", config=GKDConfig, trainer=GKDTrainer,
        description="GKD on-policy distillation (generalized JSD, full vocabulary or top-k); teacher colocated or served",
        roles=("train", "rollout", "teacher"), demo=str(Path(__file__).with_name("demo.yaml")),
    )
