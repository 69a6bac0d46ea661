"""ms-swift's batch and schedule keys, read as rlcore's: Megatron's `micro_batch_size` and `global_batch_size`
(accumulation from the data-parallel size the plan will make), `train_iters`, `num_train_epochs` (steps from the
dataset's rows), the warm-up and Megatron's learning-rate decay. `Schedule` is a part of the ms-swift translator
(`ms_swift.py`), kept apart to keep each file to one job: it reads and writes the translator's config as the rest
of it does (`take`, `put`, `note`, `refuse`).
"""

from __future__ import annotations

import math
from typing import Any

from ..config import gpu_count
from ..data import dataset_file, load_rows
from ..errors import ConfigError
from ..runtime.resources import parse_ranks

LR_SCHEDULES = {"constant": "constant", "linear": "linear", "cosine": "cosine"}


def row_count(dataset: str) -> int | None:
    """The rows of `dataset` (`FILE#N`: N; a local file: its rows), None when that is not known here."""
    file, first = dataset_file(dataset)
    if first is not None or not file.is_file():
        return first
    try:
        return len(load_rows(file))
    except ConfigError:  # the data checks report it
        return None


def as_list(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value or ())


class Schedule:
    """The batch and schedule half of the ms-swift translator."""

    def train_role(self) -> str | None:
        return "train" if "train" in self.sections else ("default" if "default" in self.sections else None)

    def data_parallel(self) -> tuple[int | None, str]:
        """The train role's data-parallel size as the plan will make it, and how it was counted."""
        role = self.train_role()
        if role is None:
            return None, "no train role"
        section = self.data.get(role) or {}
        workers = None
        if isinstance(self.data.get("device_groups"), dict):
            for spec in self.data["device_groups"].values():
                if isinstance(spec, dict) and role in as_list(spec.get("workers")):
                    try:
                        ranks = parse_ranks(spec.get("ranks"))
                    except ValueError:
                        return None, f"the device group of {role} has ranks that do not parse"
                    workers = ranks if isinstance(ranks, int) else len(ranks)
            if workers is None:
                return None, f"no device group lists {role}"
        else:
            workers = gpu_count(section.get("gpus")) or section.get("cpus", 1)
        tp = section.get("tensor_model_parallel_size", 1)
        pp = section.get("pipeline_model_parallel_size", 1)
        if not all(isinstance(n, int) and n >= 1 for n in (workers, tp, pp)) or workers % (tp * pp):
            return None, f"{workers} {role} workers / tensor {tp} x pipeline {pp}"
        return workers // (tp * pp), f"{workers} {role} workers / (tensor {tp} x pipeline {pp})"

    def batch(self) -> None:
        if self.foreign("micro_batch_size"):
            self.put("micro_batch_size", "per_device_train_batch_size", self.take("micro_batch_size"))
        if not self.foreign("global_batch_size"):
            return
        total = self.take("global_batch_size")
        if "gradient_accumulation_steps" not in self.own:
            self.refuse("global_batch_size", "has no meaning here: this algorithm takes no optimizer step")
            return
        micro = self.data.setdefault("per_device_train_batch_size", 1)  # Megatron's micro_batch_size default
        dp, how = self.data_parallel()
        if dp is None or not isinstance(total, int) or not isinstance(micro, int):
            self.refuse("global_batch_size", f"({total!r}) cannot be checked against the plan ({how}); give "
                        "per_device_train_batch_size and gradient_accumulation_steps instead")
            return
        if total % (micro * dp):
            self.refuse("global_batch_size", f"({total}) must be a multiple of micro_batch_size ({micro}) x the "
                        f"data-parallel size ({dp}: {how}) = {micro * dp}")
            return
        accumulation = total // (micro * dp)
        self.put(f"global_batch_size: {total} / (micro {micro} x data-parallel {dp})", "gradient_accumulation_steps",
                 accumulation)
        if "steps_per_generation" in self.own and isinstance(self.data.get("steps_per_generation"), int):
            # Megatron's steps_per_generation counts optimizer steps; rlcore's (TRL's) counts micro-steps
            steps = self.data.pop("steps_per_generation")
            self.put(f"steps_per_generation: {steps} optimizer steps (x {accumulation} micro-batches)",
                     "steps_per_generation", steps * accumulation)

    def rows(self) -> int | None:
        """The rows the dataset has: `FILE#N`'s N, or a local file's rows."""
        sets = as_list(self.data.get("dataset"))
        counts = [row_count(d) for d in sets if isinstance(d, str)]
        return sum(counts) if counts and None not in counts else None

    def schedule(self) -> None:
        if self.foreign("train_iters"):
            self.put("train_iters", "max_steps", self.take("train_iters"))
        if self.foreign("num_train_epochs"):
            self.epochs(self.take("num_train_epochs"))
        for key in ("lr_warmup_fraction", "warmup_ratio"):
            if self.foreign(key):
                self.warmup(key, self.take(key))
        if self.foreign("lr_warmup_iters"):
            self.put("lr_warmup_iters", "warmup_steps", self.take("lr_warmup_iters"))
        if self.foreign("min_lr"):
            self.refuse("min_lr", "has no meaning here: this algorithm has no learning-rate schedule")
        style, source = None, "lr_decay_style"
        if self.foreign("lr_decay_style"):
            style = self.take("lr_decay_style")
        elif self.megatron and "lr_scheduler_type" in self.own and "lr_scheduler_type" not in self.data:
            style, source = "cosine", "lr_decay_style (Megatron's default, cosine)"
        if self.flat_schedule():
            if style is not None and source == "lr_decay_style":
                self.note("lr_decay_style", style, "min_lr = lr: the learning rate stays at lr, whatever the style")
            return
        if style in LR_SCHEDULES:
            self.put(source, "lr_scheduler_type", LR_SCHEDULES[style])
        elif style is not None:
            self.refuse("lr_decay_style", f"'{style}' is not one of rlcore's schedules ({', '.join(LR_SCHEDULES)})")

    def epochs(self, epochs: Any) -> None:
        """An algorithm counting optimizer steps (grpo, gkd) runs the steps the epochs take, where the
        dataset's size is known from its spelling (`FILE#N`); train_iters, when given, wins as in ms-swift."""
        if "max_steps" in self.data:
            self.note("num_train_epochs", epochs, "train_iters / max_steps is given and wins",
                      origin="TRL's and ms-swift's")
            return
        rows = self.rows()
        per_step = self.data.get("per_device_train_batch_size", 1)
        dp, how = self.data_parallel()
        accumulation = self.data.get("gradient_accumulation_steps", 1)
        if dp is None and rows is not None:
            self.refuse("num_train_epochs", f"cannot become max_steps: the data-parallel size is not known ({how}); "
                        "set max_steps (ms-swift's train_iters)")
            return
        if rows is None or dp is None or not isinstance(epochs, (int, float)):
            self.refuse("num_train_epochs", "cannot become max_steps: the dataset's size is unknown here (no local "
                        "dataset file); set max_steps (ms-swift's train_iters), or dataset: FILE#N (its first N rows)")
            return
        samples = rows * (self.data.get("num_generations", 8) if "num_generations" in self.own else 1)
        steps = max(1, math.floor(epochs * samples / (per_step * dp * accumulation)))
        self.put(f"num_train_epochs: {epochs} over {rows} rows", "max_steps", steps)

    def warmup(self, key: str, fraction: Any) -> None:
        kind = self.model.model_fields.get("warmup_steps")
        if kind is None:
            self.refuse(key, "has no meaning here: this algorithm has no learning-rate schedule")
        elif kind.annotation is float:  # a fraction below 1 is native (sft)
            self.put(key, "warmup_steps", fraction)
        else:
            steps = self.data.get("max_steps", self.model.model_fields["max_steps"].default)
            self.put(f"{key}: {fraction} of {steps} steps", "warmup_steps", round(fraction * steps))

    def flat_schedule(self) -> bool:
        """Megatron's `min_lr` equal to `lr` without warm-up: a constant learning rate, said as rlcore's constant
        schedule (min_lr below lr stays: the floor the cosine schedule decays to)."""
        low, lr = self.data.get("min_lr"), self.data.get("learning_rate", self.data.get("lr"))
        if not self.megatron or low is None or low != lr or self.data.get("warmup_steps"):
            return False
        self.data.pop("min_lr")
        self.put(f"min_lr: {low} (= lr)", "lr_scheduler_type", "constant")
        return True
