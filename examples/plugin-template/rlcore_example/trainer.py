"""The `example` algorithm: fit y = slope * x + intercept by gradient descent, in pure Python.

Small enough to read in a minute, yet it does what a real trainer does: splits each step's data over
workers with a registered dispatcher and joins their gradients with a registered collector. The loop
itself is rlcore's (`rlcore.Trainer`): the progress bar, metrics.jsonl, the lifecycle hooks, atomic
checkpoints and `--resume` come with it; this algorithm writes its step and its state.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, Literal

from pydantic import Field

from rlcore import Registered, RlcoreError, RunConfig, Trainer


class LineFitConfig(RunConfig):
    """Fit a line to noisy points by full-batch gradient descent."""

    output_dir: str = Field("output/example", description="metrics.jsonl and checkpoint-N folders go here")
    steps: int = Field(100, ge=1, le=1_000_000, description="gradient steps")
    lr: float = Field(0.1, gt=0, le=1000, description="learning rate")
    slope: float = Field(2.0, ge=-1e6, le=1e6, description="slope of the true line")
    intercept: float = Field(-1.0, ge=-1e6, le=1e6, description="intercept of the true line")
    num_points: int = Field(64, ge=1, le=1 << 20, description="points sampled uniformly in [-1, 1]")
    noise: float = Field(0.05, ge=0, le=1e6, description="standard deviation of the noise added to y")
    num_workers: int = Field(2, ge=1, le=1 << 16, description="shards each step's data is split into")
    # Registered: a name that no plugin registers is a configuration error, found before the run starts
    dispatch: Annotated[str, Registered("dispatchers")] = Field(
        "reverse_slice", description="dispatcher that splits the data over workers"
    )
    collect: Annotated[str, Registered("collectors")] = Field(
        "sum", description="collector that joins the workers' gradients"
    )
    save_steps: int = Field(50, ge=0, le=1_000_000, description="checkpoint every N steps (and at the end); 0: only at the end")
    save_total_limit: int | None = Field(2, ge=1, le=1_000_000, description="keep the newest N checkpoints")
    resume: Literal["no", "auto"] | str = Field("no", description="'auto': continue from the newest checkpoint; or a path")


class LineFitTrainer(Trainer):
    """Gradient descent on mean squared error; override `make_data`, `gradient` or `learning_rate`."""

    config: LineFitConfig
    name = "example"
    progress_keys = ("loss", "w", "b")
    plot_keys = ("loss", "w", "b")  # `rlcore plot`'s panels

    def __init__(self, config: LineFitConfig, plugins, *, use_ray: bool = False):
        super().__init__(config, plugins, use_ray=use_ray)
        self.split = plugins.dispatchers.get(config.dispatch).split
        self.collect = plugins.collectors.get(config.collect).collect
        self.w = self.b = 0.0
        self.xs, self.ys = self.make_data()

    @property
    def max_steps(self) -> int:
        return self.config.steps

    def make_data(self) -> tuple[list[float], list[float]]:
        """The points to fit, drawn from the config's seed."""
        rng = random.Random(self.config.seed)
        xs = [rng.uniform(-1.0, 1.0) for _ in range(self.config.num_points)]
        ys = [self.config.slope * x + self.config.intercept + rng.gauss(0.0, self.config.noise) for x in xs]
        return xs, ys

    def gradient(self, w: float, b: float, xs: list[float], ys: list[float]) -> tuple[float, float, float]:
        """One worker's share: sums of d(err^2)/dw, d(err^2)/db and err^2 over its points."""
        errors = [w * x + b - y for x, y in zip(xs, ys)]
        return (
            sum(2 * e * x for e, x in zip(errors, xs)),
            sum(2 * e for e in errors),
            sum(e * e for e in errors),
        )

    def learning_rate(self, step: int) -> float:
        return self.config.lr

    def train_step(self) -> dict[str, Any]:
        """One gradient step over all points, split over `num_workers` and joined again."""
        n, step = len(self.xs), self.step + 1
        with self.timer("gradient"):
            calls = self.split(self.config.num_workers, (self.xs, self.ys), {}, None)
            grad_w, grad_b, squared = self.collect([self.gradient(self.w, self.b, *call[0]) for call in calls if call])
        loss = squared / n
        if not math.isfinite(loss):
            raise RlcoreError(f"example: training diverged at step {step} (loss {loss}); lower lr (now {self.config.lr})")
        self.w -= self.learning_rate(step) * grad_w / n
        self.b -= self.learning_rate(step) * grad_b / n
        return {"loss": loss, "w": self.w, "b": self.b}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "b": self.b}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w, self.b = state["w"], state["b"]
