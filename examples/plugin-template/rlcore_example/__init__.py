"""An example third-party rlcore plugin: what it provides is declared by the hooks below."""

from __future__ import annotations

from collections.abc import Iterator

from rlcore import (
    AlgorithmSpec, CollectorSpec, DispatcherSpec, EngineSpec, PlacementSpec, RewardSpec, RoleSpec, hookimpl,
)

from .echo import EchoEngine, EchoKeys
from .policies import reverse_placement, reverse_slice, sum_results
from .rewards import letter_ratio
from .scorer import Scorer
from .trainer import LineFitConfig, LineFitTrainer

__version__ = "0.1.0"


@hookimpl
def rlcore_roles() -> Iterator[RoleSpec]:
    yield RoleSpec("scorer", description="scores numbers on CPU workers (rlcore_example.scorer.Scorer)", worker=Scorer)


@hookimpl
def rlcore_dispatchers() -> Iterator[DispatcherSpec]:
    yield DispatcherSpec("reverse_slice", split=reverse_slice, description="slice, last shard to worker 0")


@hookimpl
def rlcore_collectors() -> Iterator[CollectorSpec]:
    yield CollectorSpec("sum", collect=sum_results, description="add the workers' results")


@hookimpl
def rlcore_placements() -> Iterator[PlacementSpec]:
    yield PlacementSpec("reverse", place=reverse_placement, description="fill GPUs from the last rank down")


@hookimpl
def rlcore_engines() -> Iterator[EngineSpec]:  # a rollout engine whose key `echo_repeat` every rollout section takes
    yield EngineSpec("echo", kind="rollout", factory=EchoEngine, keys=EchoKeys, description="repeats a prompt's last token")


@hookimpl
def rlcore_rewards() -> Iterator[RewardSpec]:
    yield RewardSpec("letter_ratio", fn=letter_ratio, description="fraction of characters equal to `letter` (option)")


@hookimpl
def rlcore_algorithms() -> Iterator[AlgorithmSpec]:
    yield AlgorithmSpec(
        "example", config=LineFitConfig, trainer=LineFitTrainer, description="fit a line by SGD (no torch)"
    )
