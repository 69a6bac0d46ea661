"""Step clocks the benchmarks share: one for an rlcore trainer (a plugin), one for a transformers Trainer
(TRL's), so both sides of a comparison are timed the same way. The scripts import it as `clocks` (they run
as `python benchmarks/<name>.py`, with this folder on sys.path)."""

from __future__ import annotations

import time
from typing import Any

from rlcore import hookimpl


class StepClock:
    """An rlcore plugin: `start()` just before `fit()`, then the time at every step's end (`stamps`) and the
    step's metrics (`rows`)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.rows: list[dict[str, Any]] = []

    def start(self) -> None:
        self.stamps.append(time.perf_counter())

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        self.stamps.append(time.perf_counter())
        self.rows.append(dict(metrics))

    def step_s(self) -> list[float]:
        """Each step's seconds."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def trainer_clock(log_key: str | None = None) -> Any:
    """A transformers TrainerCallback with the same `stamps` (train begin, then every step's end) and
    `step_s()`, keeping each log that has `log_key` in `logs`."""
    from transformers import TrainerCallback

    class TrainerClock(TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.logs: list[dict[str, Any]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if log_key is not None and logs and log_key in logs:
                self.logs.append(dict(logs))

        def step_s(self) -> list[float]:
            return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    return TrainerClock()
