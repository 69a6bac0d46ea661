"""TensorBoard and Weights & Biases loggers, chosen with `report_to: [tensorboard, wandb]` as in transformers.

A plugin on the public hooks only: `rlcore_settings` adds its keys to every algorithm's config,
`rlcore_configure` checks that each chosen logger's library is installed before the run takes anything,
and the lifecycle hooks open the loggers, write each step's numeric metrics and close them. The
libraries are imported only when a run asks for them, so the plugin loads without them.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
import weakref
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from rlcore import ConfigError, SettingSpec, hookimpl

# what each logger imports, and the extra that installs it
NEEDS = {"tensorboard": ("torch", "tensorboard"), "wandb": ("wandb",)}


def _names(value: Any) -> Any:
    """transformers' spellings: one name, `none`, or `all` stand for a list."""
    if value is None or value == "none":
        return []
    if value == "all":
        return list(NEEDS)
    return [value] if isinstance(value, str) else value


ReportTo = Annotated[list[Literal["tensorboard", "wandb"]], BeforeValidator(_names)]


@hookimpl
def rlcore_settings():
    yield SettingSpec("report_to", ReportTo, default=[],
                      description="loggers for the metrics besides metrics.jsonl: tensorboard, wandb (default: none)")
    yield SettingSpec("logging_dir", str | None, default=None,
                      description="where TensorBoard writes its event files (default: {output_dir}/runs)")
    yield SettingSpec("wandb_project", str | None, default=None,
                      description="W&B project (default: $WANDB_PROJECT, else 'rlcore'); WANDB_MODE=offline: no upload")
    yield SettingSpec("run_name", str | None, default=None, description="the W&B run's name (default: W&B's own)")


@hookimpl
def rlcore_configure(config):
    _check_installed(getattr(config, "report_to", []))


_open: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()  # trainer -> its loggers


@hookimpl
def rlcore_train_start(trainer):
    report_to = getattr(trainer.config, "report_to", [])
    _check_installed(report_to)  # a run started from Python skips rlcore_configure
    _open[trainer] = [LOGGERS[name](trainer) for name in report_to]


@hookimpl(trylast=True)  # after the other plugins' step-end hooks, so the metrics they add are logged too
def rlcore_step_end(trainer, step, metrics):
    scalars = {
        key: float(value) for key, value in metrics.items()
        if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)
    }
    for logger in _open.get(trainer, ()):
        logger.log(scalars, step)


@hookimpl
def rlcore_train_end(trainer):
    for logger in _open.pop(trainer, ()):
        logger.close()


def _check_installed(report_to: list[str]) -> None:
    for name in report_to:
        missing = [module for module in NEEDS[name] if importlib.util.find_spec(module) is None]
        if missing:
            message = (f"report_to: {name} needs {' and '.join(missing)}, not installed here: "
                       f"pip install 'rlcore[{name}]'")
            raise ConfigError(message, [("report_to", message)])


class TensorBoard:
    """Event files in `logging_dir` (default `{output_dir}/runs`), through torch's SummaryWriter."""

    def __init__(self, trainer: Any):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = getattr(trainer.config, "logging_dir", None) or Path(trainer.output_dir) / "runs"
        # a resumed run drops the later steps an earlier run logged, as metrics.jsonl does
        self.writer = SummaryWriter(str(log_dir), purge_step=trainer.step + 1 if trainer.step else None)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a run that fails keeps what it logged (rlcore_train_end is not called then)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run under `{output_dir}/wandb`, with the config as its hyperparameters."""

    def __init__(self, trainer: Any):
        import wandb

        config = trainer.config
        Path(trainer.output_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=getattr(config, "wandb_project", None) or os.environ.get("WANDB_PROJECT") or "rlcore",
            name=getattr(config, "run_name", None),
            dir=str(trainer.output_dir),
            config=config.model_dump(mode="json") if hasattr(config, "model_dump") else {},
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


LOGGERS = {"tensorboard": TensorBoard, "wandb": WandB}
