"""The GRPO driver: generate -> reward -> advantages -> log-probs -> train -> sync, one screen per step.

The plumbing lives elsewhere: roles in `workers.py` (in process, or actor groups on Ray), experience
building in `experience.py`, losses and advantages as pure functions, metrics and checkpoints in core.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rlcore import ConfigError, Trainer
from rlcore.checkpoint import load_state, resolve_resume, save_checkpoint
from rlcore.metrics import MetricsWriter

from .config import GRPOConfig
from .experience import ExperienceMaker
from .runtime import RoleRuntime


class PhaseTimer:
    """Seconds per phase of the current step, reported as `time/<phase>`."""

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{phase}"] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.times = dict(self.times), defaultdict(float)
        return out


class GRPOTrainer(Trainer):
    """Runs GRPO locally (every role in this process) or on Ray (`use_ray=True`), colocated or separate."""

    config: GRPOConfig

    def __init__(self, config: GRPOConfig, plugins: Any, *, use_ray: bool = False):
        super().__init__(config, plugins, use_ray=use_ray)
        self.output_dir = Path(config.output_dir)
        self.resume_from = resolve_resume(self.output_dir, config.resume)  # refuses to overwrite a run
        self.roles = RoleRuntime(config, use_ray=use_ray)  # validates the resource plan; allocates nothing yet
        self.experience = ExperienceMaker(config, plugins, dp_size=self.roles.train_workers)
        self.timer = PhaseTimer()
        self.metrics = MetricsWriter(self.output_dir / "metrics.jsonl")
        self.step = 0
        self.queue: list[Any] = []  # mini-batches left from the last generation
        self.pending: Any = None  # async_generate: the next round, generating while this one trains
        self.pending_data: dict[str, int] | None = None  # the data position before that round
        self.sync_stats: dict[str, float] = {}

    # -- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        cfg = self.config
        with self.roles.start(self.experience.model_path):
            self.experience.bind_orm(self.roles.orm)
            self.restore()
            self.sync_weights(check=cfg.check_weight_sync)
            self.hook.rlcore_train_start(trainer=self)
            last: dict[str, Any] = {}
            with self.progress() as bar:
                while self.step < cfg.max_steps:
                    if not self.queue:
                        self.queue = self.make_experience()
                    last = self.train_step(self.queue.pop(0))
                    self.step += 1
                    if self.step < cfg.max_steps:  # the rollout engine needs the new weights for another round
                        self.sync_weights()
                        last.update(self.sync_stats)
                    self.log(last, bar)
                    if cfg.save_steps and self.step % cfg.save_steps == 0:
                        self.save()
            if not cfg.save_steps or self.step % cfg.save_steps:
                self.save()
            self.hook.rlcore_train_end(trainer=self, metrics=last)
        return last

    def make_experience(self) -> list[Any]:
        """One generation round: the mini-batches of the next optimizer steps, and the round's metrics."""
        roles, maker = self.roles, self.experience
        with self.timer("generate"), roles.generating():
            if self.config.async_generate:  # this round was started during the last one's training
                pending = self.pending or maker.start_generate(roles.rollout, self.step)
                rows, generations = maker.finish_generate(pending)
                self.pending_data = maker.sampler.state_dict()  # what a checkpoint resumes from
                self.pending = maker.start_generate(roles.rollout, self.step + 1)
            else:
                rows, generations = maker.generate(roles.rollout, self.step)
        with self.timer("reward"):
            scored = maker.score(rows, generations, regenerate=lambda: maker.generate(roles.rollout, self.step))
        with self.timer("logprobs"):
            batch = maker.logprobs(scored, roles.train, roles.reference)
        return maker.mini_batches(batch, scored.metrics)

    def train_step(self, mini: Any) -> dict[str, Any]:
        batch, round_metrics, loss_fn = mini
        with self.timer("train"):
            out = self.roles.train.train_step(batch, loss_fn, self.config.per_device_train_batch_size, self.config.temperature)
        return {**round_metrics, **out}

    def sync_weights(self, check: bool = False) -> None:
        with self.timer("sync"):
            self.sync_stats = self.roles.sync_weights(self.config.weight_sync_bucket_mb << 20)
        if check:
            self.roles.check_weight_sync(self.experience.probe_sequence())

    # -- outputs --------------------------------------------------------------------------------

    def log(self, metrics: dict[str, Any], bar: Any) -> None:
        metrics.update(self.timer.pop(), step=self.step)
        self.metrics.write(metrics)
        self.hook.rlcore_step_end(trainer=self, step=self.step, metrics=metrics)
        bar.update(1)
        bar.set_postfix(
            reward=f"{metrics.get('reward', float('nan')):.3f}",
            gen=f"{metrics.get('time/generate', 0):.1f}s",
            train=f"{metrics.get('time/train', 0):.1f}s",
            refresh=False,
        )

    @contextlib.contextmanager
    def progress(self):
        from tqdm.auto import tqdm

        with tqdm(total=self.config.max_steps, initial=self.step, desc="grpo", unit="step", dynamic_ncols=True) as bar:
            yield bar

    def save(self) -> Path:
        """A checkpoint of the model, optimizer, data position and the rest of the current round: a resumed
        run continues mid-round exactly. A round still generating (async) is not saved; the data position
        is the one before it, so a resumed run generates it again."""
        state = {
            "step": self.step,
            "data": self.pending_data or self.experience.sampler.state_dict(),
            "config": self.config.model_dump(mode="json"),
        }

        def write(tmp: Path) -> None:
            self.roles.train.save(str(tmp / "model"))
            if self.queue:
                import torch

                torch.save(self.queue, tmp / "round.pt")

        return save_checkpoint(self.output_dir, self.step, state, write, keep=self.config.save_total_limit)

    def restore(self) -> None:
        if self.resume_from is None:
            self.metrics.resume_at(0)
            return
        state = load_state(self.resume_from)
        if state["step"] >= self.config.max_steps:
            raise ConfigError(
                f"resume: {self.resume_from} is at step {state['step']}, already max_steps={self.config.max_steps}; "
                f"raise max_steps to train further"
            )
        self.roles.train.load(str(self.resume_from / "model"))
        self.experience.sampler.load_state_dict(state["data"])
        if (self.resume_from / "round.pt").is_file():
            import torch

            self.queue = torch.load(self.resume_from / "round.pt", weights_only=False)
        self.step = state["step"]
        self.metrics.resume_at(self.step)
