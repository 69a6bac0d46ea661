"""The GRPO driver: generate -> reward -> advantages -> log-probs -> train -> sync, one screen per step.

The plumbing lives in core: the roles and their placement in `rlcore.session` (built from the resource
plan, in process or on Ray), the loop, metrics and checkpoints in `rlcore.Trainer`. Experience building
is in `experience.py`; losses and advantages are pure functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcore import Trainer
from rlcore.resources import plan_from_config
from rlcore.roles import GenerateWorker, ScoreWorker, TrainWorker
from rlcore.sections import rollout_options, train_options
from rlcore.session import RoleSession, RoleSetup, announce

from .config import GRPOConfig
from .experience import ExperienceMaker


class GRPOTrainer(Trainer):
    """Runs GRPO locally (every role in this process) or on Ray (`use_ray=True`), colocated or separate."""

    config: GRPOConfig
    name = "grpo"
    progress_keys = ("reward", "loss", "time/generate", "time/train")
    resume_fixed = (  # what the data position, the round's batches and the model's shapes depend on
        "model", "dataset", "seed", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
        "steps_per_generation", "device_groups", "train.gpus", "train.cpus", "train.lora_rank", "max_prompt_length",
    )

    def __init__(self, config: GRPOConfig, plugins: Any, *, use_ray: bool = False):
        super().__init__(config.for_run(), plugins, use_ray=use_ray)  # the embedded demo takes its own settings
        self.session = self.make_session()  # validates the resource plan; allocates nothing yet
        self.experience = ExperienceMaker(self.config, plugins, dp_size=self.session.dp_size("train"))
        self.queue: list[Any] = []  # mini-batches left from the last generation
        self.pending: Any = None  # async_generate: the next round, generating while this one trains
        self.pending_data: dict[str, int] | None = None  # the data position before that round

    @staticmethod
    def roles_of(cfg: GRPOConfig) -> list[str]:
        return ["train", "rollout"] + (["reference"] if cfg.beta > 0 else []) + (["orm"] if "orm" in cfg.reward_funcs else [])

    @classmethod
    def check(cls, config: GRPOConfig, plugins: Any) -> None:
        """The resource plan, reward names and options, the dataset and the model's tokenizer, all at once."""
        from rlcore.config import config_error, problems_of

        config = config.for_run()
        problems = problems_of([("(resource plan)", lambda: plan_from_config(
            config, roles=cls.roles_of(config), policy=config.placement, plugins=plugins))])
        problems.extend(ExperienceMaker.check(config, plugins))
        if problems:
            raise config_error(problems)

    def make_session(self) -> RoleSession:
        cfg = self.config
        roles = self.roles_of(cfg)
        plan = plan_from_config(cfg, roles=roles, policy=cfg.placement, plugins=self.plugins)
        model = cfg.model or str(Path(cfg.output_dir) / "tiny-model")  # the demo's model is built before start
        setups = {
            "train": RoleSetup(TrainWorker, cfg.train.engine, train_options(cfg, model)),
            "rollout": RoleSetup(GenerateWorker, cfg.rollout.engine, rollout_options(cfg.rollout, model, cfg.seed)),
        }
        if "reference" in roles:
            reference = dict(model=model, dtype=cfg.reference.dtype, seed=cfg.seed)
            setups["reference"] = RoleSetup(TrainWorker, cfg.reference.engine, {**reference, **cfg.reference.engine_kwargs}, kind="forward")
        if "orm" in roles:
            from rlcore.plugins.rewards.orm import OrmScorer

            orm = {"model_path": cfg.orm.model, "dtype": cfg.orm.dtype, "batch_size": cfg.orm.batch_size}
            setups["orm"] = RoleSetup(ScoreWorker, OrmScorer, orm)
        return RoleSession.from_config(cfg, plan, setups, use_ray=self.use_ray, plugins=self.plugins,
                                       syncs=(("train", "rollout"),))

    @contextlib.contextmanager
    def start(self) -> Iterator[None]:
        announce(self.session.describe())
        with self.session.start():
            self.experience.bind_orm(self.session.get("orm"))
            yield

    def on_start(self) -> None:
        self.sync_weights(check=self.config.check_weight_sync)
        self.timer.pop()  # the first sync is not a step's

    # -- one step ---------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        cfg = self.config
        if not self.queue:
            self.queue = self.make_experience()
        batch, round_metrics, loss_fn = self.queue.pop(0)
        with self.timer("train"):
            out = self.session["train"].train_step(batch, loss_fn, cfg.per_device_train_batch_size, cfg.temperature)
        metrics = {**round_metrics, **out}
        if self.step + 1 < cfg.max_steps:  # the rollout engine needs the new weights for another round
            metrics.update(self.sync_weights())
        return metrics

    def make_experience(self) -> list[Any]:
        """One generation round: the mini-batches of the next optimizer steps, and the round's metrics."""
        session, maker, rollout = self.session, self.experience, self.session["rollout"]

        def generate() -> tuple[list[dict], list[Any]]:  # the rollout role holds its devices (colocated: awake)
            with self.timer("generate"), session.active("rollout"):
                if not self.config.async_generate:
                    return maker.generate(rollout, self.step)
                started = self.pending or maker.start_generate(rollout, self.step)  # started during the last round
                rows, generations = maker.finish_generate(started)
                self.pending_data = maker.sampler.state_dict()  # what a checkpoint resumes from
                self.pending = maker.start_generate(rollout, self.step + 1)
                return rows, generations

        def regenerate() -> tuple[list[dict], list[Any]]:  # dynamic_sample: more groups, within the generate phase
            with self.timer("generate"), session.active("rollout"):
                return maker.generate(rollout, self.step)

        rows, generations = generate()
        with self.timer("reward"):
            scored = maker.score(rows, generations, regenerate=regenerate)
        with self.timer("logprobs"):
            batch = maker.logprobs(scored, session["train"], session.get("reference"))
        return maker.mini_batches(batch, scored.metrics)

    def sync_weights(self, check: bool = False) -> dict[str, float]:
        with self.timer("sync"):
            stats = self.session.sync_weights("train", "rollout", self.config.weight_sync_bucket_mb << 20)
        if check:
            self.session.check_weight_sync("train", "rollout", self.experience.probe_sequence())
        return stats

    # -- checkpoints: the model and optimizer, the data position, the rest of the current round ----------

    def state_dict(self) -> dict[str, Any]:
        """A round still generating (async) is not saved: the data position is the one before it, so a
        resumed run generates it again."""
        return {"data": self.pending_data or self.experience.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.experience.sampler.load_state_dict(state["data"])

    def save_model(self, path: Path) -> None:
        self.session["train"].save(str(path / "model"))
        if self.queue:  # the rest of this round: a resumed run continues mid-round exactly
            import dataclasses

            import torch

            rest = [{"batch": dict(batch), "metrics": metrics, "objective": dataclasses.asdict(objective)}
                    for batch, metrics, objective in self.queue]
            torch.save(rest, path / "round.pt")  # tensors, numbers and strings: loaded with weights_only

    def load_model(self, path: Path) -> None:
        self.session["train"].load(str(path / "model"))
        if (path / "round.pt").is_file():
            import torch

            from rlcore import Batch, RlcoreError

            from .objective import PolicyObjective

            try:  # a checkpoint is data, never code
                rest = torch.load(path / "round.pt", weights_only=True)
                self.queue = [(Batch(r["batch"]), r["metrics"], PolicyObjective(**r["objective"])) for r in rest]
            except Exception as exc:
                raise RlcoreError(f"{path / 'round.pt'} cannot be read as the rest of a round: {exc}") from exc
