"""The GKD driver: completions (the student's own with probability lmbda, else the dataset's) -> the teacher's
distributions -> a train step on the generalized JSD -> (before the next on-policy step) a weight sync.

Where the teacher lives decides who computes its side: colocated in the train workers (`teacher_model`), it
answers each micro-batch inside the train step (full vocabulary or top-k, nothing crosses a process); served as
a group of its own (`teacher:`), it returns top-k log-probs of the exact token sequences, split across its
replicas, which travel with the batch ([B, T, k], never [B, T, V]).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlcore import GenerateWorker, ModelUse, RoleSetup, RoleTrainer, SamplingParams, problems_of
from rlcore.batch import pad_width
from rlcore.data import PromptEncoder, model_problem
from rlcore.episodes import episode_metrics
from rlcore.memory import RoleUse
from rlcore.sections import rollout_options, train_options

from .config import GKDConfig
from .data import DistillData
from .objective import DistillObjective
from .workers import DistillWorker, TeacherWorker

# the hf student's engine options a colocated hf teacher takes too: its kernels and its compilation
TEACHER_KEYS = ("liger_kernel", "torch_compile", "torch_compile_backend", "torch_compile_mode")


class GKDTrainer(RoleTrainer):
    """Runs GKD locally (every role in this process) or on Ray, the teacher colocated or served."""

    config: GKDConfig
    name = "gkd"
    progress_keys = ("loss", "jsd", "eval/jsd")
    plot_keys = ("loss", "eval/jsd", "jsd", "sft_loss", "grad_norm", "completions/mean_length")
    resume_fixed = (
        "model", "teacher_model", "teacher.model", "dataset", "seed", "per_device_train_batch_size",
        "gradient_accumulation_steps", "device_groups", "train.gpus", "train.cpus", "train.lora_rank",
        "max_prompt_length", "eval_size",
    )
    checkpointed = "train"
    check_on_run = False  # a run reports a bad model or dataset as it loads them, one line each
    required = ("model",)

    def __init__(self, config: GKDConfig, plugins: Any, *, use_ray: bool = False):
        super().__init__(config, plugins, use_ray=use_ray)  # the resource plan is checked before any model is built
        cfg = self.config
        self.batch_rows = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.train_workers
        self.data = DistillData(cfg, self.batch_rows, self.student)
        self.heldout = self.data.heldout_batch()
        self.heldout_teacher: Any = None  # a served teacher's top-k of the held-out rows (it never changes)
        self.stale = False  # the rollout engine lacks the last train step's weights
        self.on_policy_steps = 0
        self.start_jsd: float | None = None

    # -- the roles ------------------------------------------------------------------------------------

    @classmethod
    def roles(cls, cfg: GKDConfig) -> list[str]:
        return ["train"] + (["rollout"] if cfg.lmbda > 0 else []) + (["teacher"] if cfg.served_teacher else [])

    @classmethod
    def problems(cls, config: GKDConfig, plugins: Any, run: bool = False) -> list[tuple[str, str]]:
        """The dataset, the student's tokenizer, a teacher that is there; builds nothing (`models`: their files)."""
        teacher = config.teacher.model or config.teacher_model
        problems = problems_of([
            ("dataset", lambda: DistillData.rows_of(config)),
            ("model", lambda: PromptEncoder(config.model, config.use_chat_template)),
        ])
        missing = model_problem(teacher) if teacher else None
        if missing:
            problems.append(("teacher.model" if config.teacher.model else "teacher_model", missing))
        if config.multi_turn and config.lmbda == 0:
            problems.append(("lmbda", "is 0, so no step samples the student and the multi-turn keys have no effect; set "
                             "lmbda > 0 (on-policy steps run episodes) or drop multi_turn_scheduler / tools"))
        return problems + config.multi_turn_problems(plugins)

    @classmethod
    def models(cls, cfg: GKDConfig) -> list[ModelUse]:
        """Student and teacher hold a prompt and its completion (their engines check their own context keys); the prompts are
        conversations, through the student's chat template; the teacher reads the student's token ids."""
        both = (("max_prompt_length", "max_completion_length"), (cfg.max_prompt_length, cfg.max_completion_length))
        uses = [ModelUse("model", cfg.model, (both,), roles=("rollout",),
                         conversations=lambda: "dataset" if cfg.dataset else None)]
        teacher = cfg.teacher.model or cfg.teacher_model
        if teacher:
            uses.append(ModelUse("teacher.model" if cfg.teacher.model else "teacher_model", teacher,
                                 (both,), tokenizer_of="model", roles=("teacher",),
                                 same_vocabulary_size=cfg.gkd_logits_topk is None))
        return uses

    def prepare(self) -> None:
        cfg = self.config
        self.student, self.teacher_path = cfg.model, cfg.teacher.model or cfg.teacher_model

    @staticmethod
    def train_setup_options(cfg: GKDConfig, student: str, teacher_path: str | None) -> dict[str, Any]:
        """The student's train options; a colocated teacher (`teacher`) is a forward-only engine inside each train
        worker, with its parallelism."""
        train = train_options(cfg, student)
        if not cfg.served_teacher:
            teacher = {"model": teacher_path, "dtype": cfg.train.dtype, "seed": cfg.seed}
            teacher.update(cfg.train.engine_options(kind="forward"))  # the student's engine keys (megatron's sizes)
            if "device" in cfg.train.engine_kwargs:
                teacher["device"] = cfg.train.engine_kwargs["device"]
            if cfg.train.engine == "hf":  # the student's kernels and compilation, the teacher's too
                teacher.update({key: value for key, value in cfg.train.engine_kwargs.items() if key in TEACHER_KEYS})
            train["teacher"] = {"engine": cfg.train.engine, "options": teacher, "offload": cfg.offload_teacher_model}
        return train

    @classmethod
    def memory_use(cls, cfg: GKDConfig) -> dict[str, RoleUse]:
        """The student trains micro-batches of prompt + completion beside its teacher's forward (full vocabulary or
        top-k); the rollout generates the on-policy completions; a served teacher scores them."""
        if not cfg.model:
            return {}
        roles, length = cls.roles(cfg), cfg.max_prompt_length + cfg.max_completion_length
        teacher = cfg.teacher.model or cfg.teacher_model
        topk = {"logits": "topk", "topk": cfg.gkd_logits_topk} if cfg.gkd_logits_topk else {}
        knobs = {"micro_batch": "per_device_train_batch_size", "accumulation": "gradient_accumulation_steps",
                 "topk": "gkd_logits_topk"}
        uses = {"train": RoleUse(cfg.train.engine, "train", cls.train_setup_options(cfg, cfg.model, teacher), "training",
                                 cfg.model, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, length,
                                 sync="send" if "rollout" in roles else None, knobs=knobs, **topk)}
        if "rollout" in roles:
            uses["rollout"] = RoleUse(cfg.rollout.engine, "rollout", rollout_options(cfg.rollout, cfg.model, cfg.seed),
                                      "generation", cfg.model, seq_len=length,
                                      sequences=cfg.per_device_train_batch_size, sync="receive")
        if "teacher" in roles:
            uses["teacher"] = RoleUse(cfg.teacher.engine, "teacher", rollout_options(cfg.teacher, teacher, cfg.seed),
                                      "training", teacher, seq_len=length, sequences=cfg.per_device_train_batch_size)
        return uses

    def setups(self) -> dict[str, RoleSetup]:
        cfg, roles = self.config, self.roles(self.config)
        train = self.train_setup_options(cfg, self.student, self.teacher_path)
        setups = {"train": RoleSetup(DistillWorker, cfg.train.engine, train)}
        if "rollout" in roles:
            setups["rollout"] = RoleSetup(GenerateWorker, cfg.rollout.engine,
                                          rollout_options(cfg.rollout, self.student, cfg.seed))
        if "teacher" in roles:
            teacher = rollout_options(cfg.teacher, self.teacher_path, cfg.seed)
            if cfg.teacher.engine == "vllm":  # vLLM caps prompt log-probs at max_logprobs: raise it to k
                kwargs = dict(teacher.get("vllm_engine_kwargs") or {})
                kwargs["max_logprobs"] = max(int(kwargs.get("max_logprobs", 0)), cfg.gkd_logits_topk or 0)
                teacher["vllm_engine_kwargs"] = kwargs
            setups["teacher"] = RoleSetup(TeacherWorker, cfg.teacher.engine, teacher, kind="teacher")
        return setups

    def session_options(self) -> dict[str, Any]:
        return {"syncs": (("train", "rollout"),) if "rollout" in self.roles(self.config) else ()}

    def on_start(self) -> None:
        if "rollout" in self.session.roles:
            self.sync_weights()
        self.start_jsd = self.heldout_jsd()
        self.timer.pop()  # the first sync and measure are not a step's

    # -- one step ---------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        cfg, session = self.config, self.session
        rows = self.data.sampler.next_batch()
        prompts, completions = self.data.encode(rows)
        on_policy = random.Random(f"rlcore-gkd:{cfg.seed}:{self.step}").random() < cfg.lmbda
        metrics: dict[str, Any] = {"on_policy": float(on_policy)}
        if on_policy:
            if self.stale:
                metrics.update(self.sync_weights())
            masks = None
            with self.timer("generate"), session.active("rollout"):
                if cfg.multi_turn:  # episodes: the student's own turns are distilled, the environment's are context
                    setup = cfg.episode_setup(self.student, cfg.max_completion_length)
                    generations = session["rollout"].generate_episodes(rows, setup, self.sampling_params())
                    prompts, masks = [g.prompt_ids for g in generations], [g.loss_mask for g in generations]
                    metrics.update(episode_metrics(generations))
                else:
                    generations = session["rollout"].generate(prompts, self.sampling_params())
            completions = [g.token_ids for g in generations]
        else:
            masks = None
        batch = self.data.batch(prompts, completions, masks)
        if "teacher" in session.roles:
            with self.timer("teacher"):
                batch.update(self.teacher_topk(batch, prompts, completions))
        objective = DistillObjective(
            beta=cfg.beta, temperature=cfg.temperature, topk=cfg.gkd_logits_topk,
            sft_alpha=0.0 if on_policy else cfg.sft_alpha,
            num_items_in_batch=max(float(batch["completion_mask"].sum()), 1.0) / session.dp_size("train"),
        )
        with self.timer("train"):
            out = session["train"].distill_step(batch, objective, cfg.per_device_train_batch_size, cfg.temperature)
        self.stale = "rollout" in session.roles
        metrics.update(out)
        metrics.setdefault("sft_loss", float("nan"))  # null on on-policy steps and without sft_alpha
        metrics["completions/mean_length"] = sum(map(len, completions)) / len(completions)
        self.on_policy_steps += on_policy
        metrics["on_policy_fraction"] = self.on_policy_steps / (self.step + 1)
        if self.step == 0 and self.heldout is not None:
            metrics["eval/jsd_start"] = self.start_jsd
        if self.heldout is not None and ((self.step + 1) % cfg.eval_steps == 0 or self.step + 1 == cfg.max_steps):
            metrics["eval/jsd"] = self.heldout_jsd()
        return metrics

    def sampling_params(self) -> SamplingParams:
        cfg = self.config
        return SamplingParams(n=1, max_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                              top_k=cfg.top_k, stop_token_ids=self.data.stop_ids, seed=cfg.seed * 100003 + self.step,
                              logprobs=False)  # the loss reads the teacher's distribution, never the sampler's

    def teacher_topk(self, batch: Any, prompts: list[list[int]], completions: list[list[int]]) -> dict[str, Any]:
        """The served teacher's raw top-k of the exact sequences, aligned with the batch's columns."""
        with self.session.active("teacher"):
            top = self.session["teacher"].topk([p + c for p, c in zip(prompts, completions)], self.config.gkd_logits_topk)
        width = batch["input_ids"].shape[1]
        return {"teacher_ids": pad_width(top.ids, width), "teacher_logprobs": pad_width(top.logprobs, width)}

    def heldout_jsd(self) -> float | None:
        """The JSD to the teacher on the held-out rows (their dataset completions), at the loss's temperature."""
        if self.heldout is None:
            return None
        cfg, batch = self.config, self.heldout
        if "teacher" in self.session.roles:
            if self.heldout_teacher is None:
                with self.timer("teacher"):
                    lengths = batch["attention_mask"].sum(dim=1).tolist()
                    sequences = [row[:n] for row, n in zip(batch["input_ids"].tolist(), lengths)]
                    empty = [[]] * len(sequences)
                    self.heldout_teacher = self.teacher_topk(batch, sequences, empty)
            batch = type(batch)({**batch, **self.heldout_teacher})
        objective = DistillObjective(beta=cfg.beta, temperature=cfg.temperature, topk=cfg.gkd_logits_topk)
        with self.timer("eval"):
            return self.session["train"].heldout_jsd(batch, objective)

    def sync_weights(self) -> dict[str, float]:
        """The train engine's weights into the rollout engine, the first two syncs checked (`sync_probe`)."""
        stats = super().sync_weights("train", "rollout", self.sync_probe(self.data.probe_sequence))
        self.stale = False
        return stats

    # -- checkpoints: the model and optimizer, the data position ---------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.sampler.state_dict(), "on_policy_steps": self.on_policy_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.sampler.load_state_dict(state["data"])
        self.on_policy_steps = int(state.get("on_policy_steps", 0))

    def load_model(self, path: Path) -> None:
        super().load_model(path)
        self.stale = "rollout" in self.session.roles

