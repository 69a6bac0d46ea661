"""Sampling and distillation (ms-swift's `swift sample`) as an rlcore plugin: algorithms `sample` and `distill`.

The sampler role generates `num_return_sequences` candidates per prompt (vLLM on GPUs, HF on the CPU; for
distill, a teacher behind an OpenAI-compatible endpoint or a local engine), the orm and prm roles score
them, best-of-N keeps the best with a rejected partner, and the rows go to a JSONL file that `--resume`
continues after a crash without losing or repeating a row.
"""

from __future__ import annotations

from pathlib import Path

from rlcore import AlgorithmSpec, hookimpl

from .config import DistillConfig, SampleConfig
from .trainer import SampleTrainer

__all__ = ["DistillConfig", "SampleConfig", "SampleTrainer"]


@hookimpl
def rlcore_algorithms():
    yield AlgorithmSpec(
        "sample", config=SampleConfig, trainer=SampleTrainer, roles=("sampler", "prm", "orm"),
        demo=str(Path(__file__).with_name("demo.yaml")),
        description="best-of-N sampling: N candidates per prompt scored by an ORM and/or a PRM, resumable JSONL",
    )
    yield AlgorithmSpec(
        "distill", config=DistillConfig, trainer=SampleTrainer, roles=("sampler", "prm", "orm"),
        description="responses from a teacher (an OpenAI-compatible endpoint or a local engine), resumable JSONL",
    )
