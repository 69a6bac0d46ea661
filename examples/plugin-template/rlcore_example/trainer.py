"""The `example` algorithm: fit y = slope * x + intercept by gradient descent, in pure Python.

Small enough to read in a minute, yet it does what a real trainer does: splits each step's data over
workers with a registered dispatcher, joins their gradients with a registered collector, appends
metrics.jsonl, checkpoints atomically, resumes, and calls the lifecycle hooks.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rlcore import ConfigError, RlcoreError, RunConfig, Trainer


class LineFitConfig(RunConfig):
    """Fit a line to noisy points by full-batch gradient descent."""

    output_dir: str = Field("output/example", description="metrics.jsonl and state.json go here")
    steps: int = Field(100, ge=1, description="gradient steps")
    lr: float = Field(0.1, gt=0, description="learning rate")
    slope: float = Field(2.0, description="slope of the true line")
    intercept: float = Field(-1.0, description="intercept of the true line")
    num_points: int = Field(64, ge=1, description="points sampled uniformly in [-1, 1]")
    noise: float = Field(0.05, ge=0, description="standard deviation of the noise added to y")
    num_workers: int = Field(2, ge=1, description="shards each step's data is split into")
    dispatch: str = Field("reverse_slice", description="dispatcher that splits the data over workers")
    collect: str = Field("sum", description="collector that joins the workers' gradients")
    resume: Literal["auto"] | None = Field(None, description="'auto': continue from output_dir/state.json")


class LineFitTrainer(Trainer):
    """Gradient descent on mean squared error; override `make_data`, `gradient` or `learning_rate`."""

    config: LineFitConfig

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

    def fit(self) -> dict[str, Any]:
        cfg = self.config
        out = Path(cfg.output_dir)
        split = self.plugins.dispatchers.get(cfg.dispatch).split
        collect = self.plugins.collectors.get(cfg.collect).collect
        w, b, start = self._restore(out)
        xs, ys = self.make_data()
        loss = math.nan
        self.hook.rlcore_train_start(trainer=self)
        for step in range(start + 1, cfg.steps + 1):
            calls = split(cfg.num_workers, (xs, ys), {}, None)
            grad_w, grad_b, squared = collect([self.gradient(w, b, *call[0]) for call in calls if call])
            loss = squared / len(xs)
            if not math.isfinite(loss):
                raise RlcoreError(f"example: training diverged at step {step} (loss {loss}); lower lr (now {cfg.lr})")
            w -= self.learning_rate(step) * grad_w / len(xs)
            b -= self.learning_rate(step) * grad_b / len(xs)
            metrics = {"step": step, "loss": loss, "w": w, "b": b}
            self._append_metrics(out, metrics)
            self._save(out, step, w, b)
            self.hook.rlcore_step_end(trainer=self, step=step, metrics=metrics)
        summary = {"steps": cfg.steps, "loss": loss, "w": w, "b": b}
        self.hook.rlcore_train_end(trainer=self, metrics=summary)
        return summary

    def _restore(self, out: Path) -> tuple[float, float, int]:
        """(w, b, last step) to continue from; a fresh run refuses an output_dir that holds one."""
        state_file = out / "state.json"
        if not state_file.exists():
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
            return 0.0, 0.0, 0
        state = json.loads(state_file.read_text())
        if self.config.resume != "auto":
            raise ConfigError(
                f"output_dir '{out}' already holds a run (at step {state['step']}); continue it with "
                f"--resume (resume=auto) or choose another output_dir=..."
            )
        return state["w"], state["b"], state["step"]

    @staticmethod
    def _append_metrics(out: Path, metrics: dict[str, Any]) -> None:
        with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _save(out: Path, step: int, w: float, b: float) -> None:
        tmp = out / "state.json.tmp"
        tmp.write_text(json.dumps({"step": step, "w": w, "b": b}))
        os.replace(tmp, out / "state.json")
