"""The GRPO driver: generate -> reward -> advantages -> log-probs -> train -> sync, one screen per step.

The plumbing lives in core: `rlcore.RoleTrainer` builds the roles from the resource plan (in process or
on Ray) and runs the loop, metrics and checkpoints; this module says which roles, how to build them and
what one step does. Experience building
is in `experience.py`; losses and advantages are pure functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore import (
    Batch, GenerateWorker, ModelUse, RlcoreError, RoleSetup, RoleTrainer, ScoreWorker, TeacherTrainWorker, TrainWorker,
)
from rlcore.data import has_conversations
from rlcore.runtime import logger
from rlcore.rewards import RewardFailed
from rlcore.memory import RoleUse
from rlcore.sections import rollout_options, train_options

from .config import GRPOConfig
from .experience import ExperienceMaker


class GRPOTrainer(RoleTrainer):
    """Runs GRPO locally (every role in this process) or on Ray (`use_ray=True`), colocated or separate."""

    config: GRPOConfig
    name = "grpo"
    progress_keys = ("reward", "loss", "time/generate", "time/train")
    plot_keys = ("reward", "kl", "completions/mean_length", "loss", "grad_norm", "time/generate", "time/train")
    resume_fixed = (  # what the data position, the round's batches and the model's shapes depend on
        "model", "dataset", "seed", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
        "steps_per_generation", "device_groups", "train.gpus", "train.cpus", "train.lora_rank", "max_prompt_length",
        "teacher_model", "teacher.model",
    )
    checkpointed = "train"
    check_on_run = False  # a run reports a bad model or dataset as it loads them, one line each
    required = ("model",)

    def __init__(self, config: GRPOConfig, plugins: Any, *, use_ray: bool = False):
        super().__init__(config, plugins, use_ray=use_ray)
        self.experience = ExperienceMaker(self.config, plugins, dp_size=self.session.dp_size("train"))
        self.queue: list[Any] = []  # mini-batches left from the last generation
        self.pending: Any = None  # async_generate: the next round, generating while this one trains
        self.pending_data: dict[str, int] | None = None  # the data position before that round

    # -- the roles --------------------------------------------------------------------------------------

    @classmethod
    def roles(cls, cfg: GRPOConfig) -> list[str]:
        return (["train", "rollout"] + (["reference"] if cfg.beta > 0 else []) + (["orm"] if "orm" in cfg.reward_funcs else [])
                + (["teacher"] if cfg.teacher_path and cfg.separate_teacher else []))

    @classmethod
    def problems(cls, config: GRPOConfig, plugins: Any, run: bool = False) -> list[tuple[str, str]]:
        """Reward names and options, the dataset and the model's tokenizer."""
        return ExperienceMaker.check(config, plugins)

    @classmethod
    def models(cls, cfg: GRPOConfig) -> list[ModelUse]:
        """The policy holds a prompt and its completion (the rollout engine checks its own context key); the reward
        model's files."""
        lengths = [(("max_prompt_length", "max_completion_length"), (cfg.max_prompt_length, cfg.max_completion_length))]
        uses = [ModelUse("model", cfg.model, tuple(lengths), roles=("rollout",),
                         conversations=lambda: "dataset" if has_conversations(cfg.dataset) else None)]
        if "orm" in cls.roles(cfg) and cfg.orm.model:
            uses.append(ModelUse("orm.model", cfg.orm.model))
        if cfg.teacher_path:  # it reads the policy's token ids: the policy's tokenizer, the same vocabulary
            key = "teacher.model" if cfg.teacher.model else "teacher_model"
            uses.append(ModelUse(key, cfg.teacher_path, lengths[:1], tokenizer_of="model", roles=("teacher",)))
        return uses

    @staticmethod
    def train_setup_options(cfg: GRPOConfig, model: str) -> dict[str, Any]:
        """The policy's train options; a teacher inside the train workers (GKD's colocated teacher) is a forward-only
        engine of the train engine's kind, with its parallelism, beside the policy."""
        train = train_options(cfg, model)
        if cfg.teacher_path and not cfg.separate_teacher:
            teacher = {"model": cfg.teacher_path, "dtype": cfg.teacher.dtype, "seed": cfg.seed}
            teacher.update(cfg.train.engine_options(kind="forward"))  # the student's engine keys (megatron's sizes)
            if "device" in cfg.train.engine_kwargs:
                teacher["device"] = cfg.train.engine_kwargs["device"]
            train["teacher"] = {"engine": cfg.train.engine, "options": teacher, "offload": cfg.offload_teacher_model}
        return train

    @classmethod
    def memory_use(cls, cfg: GRPOConfig) -> dict[str, RoleUse]:
        """The policy trains micro-batches of prompt + completion; the rollout generates a round's completions;
        the reference scores them; train sends its weights to rollout."""
        if not cfg.model:
            return {}
        roles, length = cls.roles(cfg), cfg.max_prompt_length + cfg.max_completion_length
        rollouts = max(cfg.rollout.gpu_count or cfg.train_workers, 1)  # sequences per rollout GPU
        in_flight = -(-cfg.per_device_train_batch_size * cfg.train_workers * cfg.micro_steps_per_generation // rollouts)
        micro = {"micro_batch": "per_device_train_batch_size", "accumulation": "gradient_accumulation_steps"}
        uses = {
            "train": RoleUse(cfg.train.engine, "train", cls.train_setup_options(cfg, cfg.model), "training", cfg.model,
                             cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, length, sync="send", knobs=micro),
            "rollout": RoleUse(cfg.rollout.engine, "rollout", rollout_options(cfg.rollout, cfg.model, cfg.seed),
                               "generation", cfg.model, seq_len=length, sequences=in_flight, sync="receive"),
        }
        if "reference" in roles:
            uses["reference"] = RoleUse(cfg.reference.engine, "forward", rollout_options(cfg.reference, cfg.model, cfg.seed),
                                        "training", cfg.model, seq_len=length)
        if "teacher" in roles:
            uses["teacher"] = RoleUse(cfg.teacher.engine, "forward", rollout_options(cfg.teacher, cfg.teacher_path, cfg.seed),
                                      "training", cfg.teacher_path, seq_len=length)
        if "orm" in roles and cfg.orm.model:  # scores between generation and the update, as the reference
            uses["orm"] = RoleUse(cfg.orm.engine, "reward", cls.orm_options(cfg), "training", cfg.orm.model, seq_len=length)
        return uses

    @staticmethod
    def orm_options(cfg: GRPOConfig) -> dict[str, Any]:
        return {"model_path": cfg.orm.model, "dtype": cfg.orm.dtype, "batch_size": cfg.orm.batch_size}

    def setups(self) -> dict[str, RoleSetup]:
        cfg, roles = self.config, self.roles(self.config)
        model = cfg.model
        setups = {
            "train": RoleSetup(TeacherTrainWorker if cfg.teacher_path and not cfg.separate_teacher else TrainWorker,
                               cfg.train.engine, self.train_setup_options(cfg, model)),
            "rollout": RoleSetup(GenerateWorker, cfg.rollout.engine, rollout_options(cfg.rollout, model, cfg.seed)),
        }
        if "reference" in roles:
            setups["reference"] = RoleSetup(TrainWorker, cfg.reference.engine, rollout_options(cfg.reference, model, cfg.seed),
                                            kind="forward")
        if "orm" in roles:  # the reward-model engine (`hf`: the rewards plugin's), of kind `reward`
            setups["orm"] = RoleSetup(ScoreWorker, cfg.orm.engine, self.orm_options(cfg))
        if "teacher" in roles:  # a group of its own: a forward engine, as the reference
            setups["teacher"] = RoleSetup(TrainWorker, cfg.teacher.engine, rollout_options(cfg.teacher, cfg.teacher_path, cfg.seed),
                                          kind="forward")
        return setups

    def session_options(self) -> dict[str, Any]:
        return {"syncs": (("train", "rollout"),)}

    def on_start(self) -> None:
        self.steps_run = self.steps_trained = 0  # this run's steps, and those with something to learn from
        self.experience.bind_orm(self.session.get("orm"))
        self.sync_weights()
        self.timer.pop()  # the first sync is not a step's

    # -- one step ---------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        from .advantages import moves_policy

        cfg = self.config
        if not self.queue:
            self.queue = self.make_experience()
        batch, round_metrics, loss_fn = self.queue.pop(0)
        with self.timer("train"):
            out = self.session["train"].train_step(batch, loss_fn, cfg.per_device_train_batch_size, cfg.temperature)
        metrics = {**round_metrics, **out}
        self.steps_run += 1
        if cfg.beta or moves_policy(batch["advantages"], batch["completion_mask"]):  # a KL term, or an advantage
            self.steps_trained += 1
        if self.step + 1 < cfg.max_steps:  # the rollout engine needs the new weights for another round
            metrics.update(self.sync_weights())
        return metrics

    def on_end(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """A run none of whose steps had anything to learn from (every group's rewards equal or missing, no KL
        term: the weights never moved) says so; under strict_rewards that fails the run."""
        if self.steps_run and not self.steps_trained:
            teacher = ", and the teacher's term was 0" if self.config.teacher_path else ""
            what = (f"none of the {self.steps_run} steps of this run trained anything: in every step each group's "
                    f"rewards were all equal or missing (reward {metrics.get('reward')}, reward_errors "
                    f"{metrics.get('reward_errors')}){teacher}, so every advantage was 0 and the weights did not "
                    f"change. Check reward_funcs")
            if self.config.strict_rewards:
                raise RewardFailed(f"{what} (strict_rewards is set)")
            logger.warning(what)
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
        if self.config.multi_turn:
            self.log_episodes(scored)
        with self.timer("logprobs"):
            batch = maker.logprobs(scored, session["train"], session.get("reference"), self.teacher())
        return maker.mini_batches(batch, scored.metrics)

    def teacher(self) -> Any:
        """What answers the teacher's log-probs: its own group's `forward_logprobs`, or the train workers'
        `teacher_logprobs` (a teacher inside them); None without a teacher."""
        if not self.config.teacher_path:
            return None
        if "teacher" in self.session.roles:
            return self.session["teacher"].forward_logprobs
        return self.session["train"].teacher_logprobs

    def log_episodes(self, scored: Any, count: int = 2) -> None:
        """The round's first `count` conversations, appended to output_dir/episodes.jsonl (the step they train)."""
        import json
        import os

        path = Path(self.config.output_dir) / "episodes.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as out:
            for episode, advantage in list(zip(scored.generations, scored.advantages.tolist()))[:count]:
                out.write(json.dumps({
                    "step": self.step + 1, "messages": episode.messages, "turns": episode.turns,
                    "finish_reason": episode.finish_reason, "environment_reward": episode.reward,
                    "advantage": advantage, "error": episode.error,
                }, default=str) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def sync_weights(self) -> dict[str, float]:
        """The train engine's weights into the rollout engine, the first two syncs checked (`sync_probe`)."""
        return super().sync_weights("train", "rollout", self.sync_probe(self.experience.probe_sequence))

    # -- checkpoints: the model and optimizer, the data position, the rest of the current round ----------

    def state_dict(self) -> dict[str, Any]:
        """A round still generating (async) is not saved: the data position is the one before it, so a
        resumed run generates it again."""
        return {"data": self.pending_data or self.experience.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.experience.sampler.load_state_dict(state["data"])
        self.pending = self.pending_data = None  # a round begun ahead is generated again from this position

    def save_model(self, path: Path) -> None:
        super().save_model(path)
        if self.queue:  # the rest of this round: a resumed run continues mid-round exactly
            import dataclasses

            import torch

            rest = [{"batch": dict(batch), "metrics": metrics, "objective": dataclasses.asdict(objective)}
                    for batch, metrics, objective in self.queue]
            torch.save(rest, path / "round.pt")  # tensors, numbers and strings: loaded with weights_only

    def on_recover(self, path: Path | None) -> None:
        """Before the first checkpoint, the round under way is generated again from the start of the data."""
        if path is None:
            self.queue = []
        super().on_recover(path)

    def load_model(self, path: Path) -> None:
        super().load_model(path)
        self.queue = []  # the round after the checkpoint's, where a recovery in the run (max_restarts) goes back
        if (path / "round.pt").is_file():
            import torch

            from .objective import PolicyObjective

            try:  # a checkpoint is data, never code
                rest = torch.load(path / "round.pt", weights_only=True)
                self.queue = [(Batch(r["batch"]), r["metrics"], PolicyObjective(**r["objective"])) for r in rest]
            except Exception as exc:
                raise RlcoreError(f"{path / 'round.pt'} cannot be read as the rest of a round: {exc}") from exc
