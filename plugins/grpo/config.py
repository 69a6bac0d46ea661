"""The GRPO configuration. Keys are spelled as TRL's GRPOConfig and ms-swift spell them."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, model_validator

from rlcore import BaseConfig, ConfigProblems, RoleConfig
from rlcore.bounds import MAX_BATCH, MAX_COEF, MAX_GIB, MAX_RATE, MAX_STEPS, MAX_TIMEOUT_S, MAX_TOKENS
from rlcore.runtime import parse_ranks
from rlcore.sections import (
    DTYPE_HELP, MultiTurnKeys, NonfiniteKeys, PromptKeys, RolloutRoleConfig, TrainRoleConfig, TrainingConfig,
)


class ReferenceRoleConfig(RoleConfig):
    """The `reference:` section: the frozen initial policy, used only when beta > 0."""

    engine_kinds: ClassVar[tuple[str, ...]] = ("forward",)

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("auto", description=DTYPE_HELP)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="further options for the engine")


class TeacherRoleConfig(RoleConfig):
    """The `teacher:` section (GRPO with a teacher's KL, ms-swift's OPD-RL): by default a forward-only model inside
    the train workers; with `gpus` (or a device group listing `teacher`) a group of its own, as the reference."""

    engine_kinds: ClassVar[tuple[str, ...]] = ("forward",)

    model: str | None = Field(None, description="the teacher: an HF model directory or hub id (ms-swift: teacher_model)")
    dtype: str = Field("auto", description=DTYPE_HELP)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="further options for a separate group's engine")


class OrmRoleConfig(RoleConfig):
    """The `orm:` section: an outcome reward model (sequence classification, one label), used when
    `reward_funcs` names `orm`."""

    engine_kinds: ClassVar[tuple[str, ...]] = ("reward",)

    model: str | None = Field(None, description="the reward model: a directory or hub id")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("auto", description=DTYPE_HELP)
    batch_size: int = Field(16, ge=1, le=MAX_BATCH, description="pairs scored per forward pass")


class GRPOConfig(MultiTurnKeys, NonfiniteKeys, PromptKeys, TrainingConfig):
    """Group Relative Policy Optimization (DeepSeekMath; TRL's GRPOTrainer)."""

    # model and data
    model: str | None = Field(
        None, description="HF model directory or hub id (tiny: the tiny random model, built in output_dir)"
    )
    dataset: str | list[str] = Field(
        "tiny:toy", description="JSONL/JSON/Parquet file(s) with a prompt or messages column; tiny:toy: the toy task"
    )

    # schedule
    max_steps: int = Field(30, ge=1, le=MAX_STEPS, description="optimizer steps to run")
    per_device_train_batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="completions per micro-batch per train worker")
    gradient_accumulation_steps: int = Field(1, ge=1, le=MAX_BATCH, description="micro-batches per optimizer step")
    steps_per_generation: int | None = Field(
        None, ge=1, le=MAX_BATCH, description="micro-steps one generation feeds (TRL's meaning); unset: gradient_accumulation_steps"
    )
    num_iterations: int = Field(1, ge=1, le=MAX_BATCH, description="passes over each generation batch (TRL's mu)")

    # sampling
    num_generations: int = Field(
        8, ge=1, le=MAX_BATCH, description="completions per prompt (the group size); 1 only with a teacher (its KL is the signal)"
    )
    max_completion_length: int = Field(256, ge=1, le=MAX_TOKENS, description="new tokens per completion at most")
    temperature: float = Field(1.0, gt=0, le=MAX_COEF, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(0, ge=0, le=MAX_TOKENS, description="top-k sampling; 0 is off")

    # loss
    beta: float = Field(0.0, ge=0, le=MAX_COEF, description="KL coefficient (k3); > 0 creates the reference role")
    epsilon: float = Field(0.2, ge=0, le=MAX_RATE, description="lower clipping range of the ratio")
    epsilon_high: float | None = Field(None, ge=0, le=MAX_RATE, description="upper clipping range (DAPO); unset: epsilon")
    delta: float | None = Field(None, gt=1, le=MAX_COEF, description="two-sided clipping of the ratio at delta (TRL)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "grpo",
        description="loss aggregation: grpo (mean of per-sequence token means), bnpo (token sum / the optimizer step's "
        "tokens over all workers; unlike TRL, whose bnpo averages each micro-batch's token mean over micro-batches and "
        "processes), dr_grpo (token sum / (sequences * max_completion_length)), dapo (token sum / the generation "
        "batch's tokens per optimizer step, as TRL)",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field("token", description="token (GRPO) or sequence (GSPO) ratios")
    use_bias_correction_kl: bool = Field(
        True, description="multiply the k3 KL term by the policy ratio (TRL's default: the unbiased KL gradient of DeepSeek-V3.2)"
    )

    # sampler/trainer mismatch: TRL's keys; despite the vllm_ prefix, for any rollout engine
    vllm_importance_sampling_correction: bool = Field(
        True,
        description="weight the loss by exp(trainer's old log-probs - rollout engine's log-probs), as TRL; computes old "
        "log-probs every round; not applied with async_generate (there the rollout's log-probs are the old ones)",
    )
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "sequence_mask",
        description="a ratio per token or per sequence (exp of the summed difference); *_truncate clamps it to "
        "[clip_min, clip_max], *_mask sets it to 0 outside",
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        3.0, gt=0, le=MAX_COEF,
        validation_alias=AliasChoices("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"),
        description="upper bound of the correction ratio; unset: none (alias: vllm_importance_sampling_cap, TRL's older name)",
    )
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0, le=MAX_COEF, description="lower bound of the correction ratio; unset: none")

    # a teacher's KL (ms-swift's OPD-RL)
    teacher_model: str | None = Field(
        None, description="ms-swift's spelling of teacher.model: the teacher whose log-probs of the sampled tokens "
        "add teacher_kl_coef * (teacher - old policy log-prob) to each token's advantage"
    )
    teacher_kl_coef: float = Field(
        1.0, ge=0, le=MAX_COEF, description="with a teacher: the coefficient of its per-token log-ratio in the advantage (ms-swift's)"
    )
    offload_teacher_model: bool = Field(
        False, description="a teacher in the train workers: keep it in CPU memory, brought to the device for its forward"
    )

    # advantages
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="divide advantages by this std")
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = Field("grpo", description="baseline")

    # filtering
    mask_truncated_completions: bool = Field(False, description="exclude completions cut at max_completion_length from the loss")
    dynamic_sample: bool = Field(False, description="DAPO: resample groups whose rewards are all equal")
    max_resample_times: int = Field(3, ge=0, le=MAX_BATCH, description="dynamic_sample: extra generations per step at most")

    # rewards
    reward_funcs: list[str] = Field(
        default_factory=lambda: ["toy"], description="registered names or module:function strings"
    )
    reward_weights: list[float] | None = Field(None, description="one weight per reward function; unset: all 1")
    reward_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict, description="options per reward function")
    strict_rewards: bool = Field(False, description="a raising reward function stops the run")
    reward_timeout_s: float = Field(
        600.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="one call of a reward function running longer than this "
        "counts as a reward error for each completion it was scoring"
    )

    # outputs
    weight_sync_bucket_mb: int = Field(512, ge=1, le=MAX_GIB, description="bucket size of train -> rollout weight sync")
    weight_sync_backend: Literal["auto", "object_store", "nccl", "gloo", "cuda_ipc"] = Field(
        "auto",
        description="on Ray: nccl/gloo broadcast from train rank 0 (separate roles), cuda_ipc (colocated on GPUs) or "
        "the object store; auto: nccl for separate GPU roles, cuda_ipc for colocated ones (rollout TP 1), else the object store",
    )
    async_generate: bool = Field(
        False, description="separate roles: generate the next round while this one trains (one step off-policy)"
    )
    check_weight_sync: bool = Field(
        True, description="after the first sync and the first after a step, compare rollout and train log-probs"
    )

    # roles
    train: TrainRoleConfig = Field(default_factory=TrainRoleConfig, description="the policy's train engine")
    rollout: RolloutRoleConfig = Field(default_factory=RolloutRoleConfig, description="the rollout engine")
    reference: ReferenceRoleConfig = Field(default_factory=ReferenceRoleConfig, description="used when beta > 0")
    orm: OrmRoleConfig = Field(default_factory=OrmRoleConfig, description="used when reward_funcs names orm")
    teacher: TeacherRoleConfig = Field(default_factory=TeacherRoleConfig, description="used when a teacher is set")

    @model_validator(mode="after")
    def _consistent(self) -> GRPOConfig:
        problems = []
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            problems.append(
                ("reward_weights", f"has {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs; give one per function")
            )
        if not self.reward_funcs:
            problems.append(("reward_funcs", "is empty; name at least one reward function"))
        if "orm" in self.reward_funcs and not self.orm.model:
            problems.append(("orm.model", "is unset, but reward_funcs names orm; set it to a reward model (num_labels=1)"))
        if self.async_generate and self.colocated:
            problems.append(
                ("async_generate", "needs train and rollout on separate devices; drop it or the [train, rollout] colocate group")
            )
        problems.extend(self._teacher_problems())
        accumulation = self.gradient_accumulation_steps
        micro = self.steps_per_generation or accumulation
        if micro % accumulation:
            problems.append(
                ("steps_per_generation", f"({micro}) must be a multiple of gradient_accumulation_steps ({accumulation})")
            )
        # an auto train.gpus not resolved yet: the batch is checked once it is (rlcore.runtime.devices)
        pending = not self.device_groups and self.train.gpus == "auto"
        workers = None if pending else self._train_group_size() if self.device_groups else self.train_workers
        per_device, generations = self.per_device_train_batch_size, self.num_generations
        if workers is not None and (per_device * workers * micro) % generations:
            problems.append(
                (
                    "num_generations",
                    f"({generations}) must divide the generation batch: per_device_train_batch_size "
                    f"({per_device}) x train workers ({workers}) x steps_per_generation ({micro}) "
                    f"= {per_device * workers * micro}",
                )
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            problems.append(
                ("vllm_importance_sampling_clip_min", f"({low}) must be less than vllm_importance_sampling_clip_max ({high})")
            )
        on_gpus = isinstance(self.device_groups, dict) or bool(self.train.gpus and self.rollout.gpus)  # auto: pending
        if self.weight_sync_backend == "cuda_ipc" and not (self.colocated and on_gpus):
            problems.append(
                ("weight_sync_backend", "cuda_ipc hands GPU memory between processes on one GPU; it needs train and rollout "
                 "colocated on GPUs (colocate_groups [[train, rollout]], gpus > 0); use auto")
            )
        if problems:  # a ValueError, so that pydantic reports it beside every other problem
            raise ConfigProblems(problems)
        return self

    def _teacher_problems(self) -> list[tuple[str, str]]:
        problems = []
        if self.teacher_model and self.teacher.model and self.teacher_model != self.teacher.model:
            problems.append(("teacher_model", f"('{self.teacher_model}') and teacher.model ('{self.teacher.model}') differ; "
                             "give the teacher once, as teacher.model"))
        if self.num_generations == 1 and not self.teacher_path:
            problems.append(("num_generations", "is 1, so every advantage is 0 and nothing is learnt; use 2 or more, or "
                             "set teacher.model (its KL is then the signal)"))
        if self.separate_teacher and not self.teacher_path:
            problems.append(("teacher.model", "is unset, but the teacher is a group of its own; name its model"))
        if self.separate_teacher and self.offload_teacher_model:
            problems.append(("offload_teacher_model", "applies to a teacher inside the train workers, but the teacher is a "
                             "group of its own; drop it"))
        return problems

    @property
    def teacher_path(self) -> str | None:
        """The teacher's model, where GRPO has one (teacher.model, or ms-swift's teacher_model)."""
        return self.teacher.model or self.teacher_model

    @property
    def separate_teacher(self) -> bool:
        """The teacher is a group of its own (teacher.gpus, or a device group listing it), not inside the train workers."""
        groups = [g.get("workers") for g in (self.device_groups or {}).values() if isinstance(g, dict)]
        listed = any(w == "teacher" or (isinstance(w, list) and "teacher" in w) for w in groups)
        return bool(self.teacher.gpu_count or listed)

    @property
    def colocated(self) -> bool:
        """Train and rollout share devices: one colocate group holds both, or, in the device_groups form,
        one GPU group's workers."""
        if isinstance(self.device_groups, dict):
            return any(
                isinstance(g, dict) and str(g.get("device", "GPU")).upper() == "GPU"
                and {"train", "rollout"} <= set([g["workers"]] if isinstance(g.get("workers"), str) else g.get("workers") or [])
                for g in self.device_groups.values()
            )
        return any({"train", "rollout"} <= set(group) for group in self.colocate_groups)

    @property
    def micro_steps_per_generation(self) -> int:
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def train_workers(self) -> int:
        """The train workers the config declares: the size of the device group whose workers list train, else
        train.gpus or train.cpus. The generation batch is per_device_train_batch_size x this x
        steps_per_generation, also when one process runs every role (no Ray)."""
        if self.device_groups:
            return self._train_group_size() or 1  # None: a bad group, which the resource plan reports
        return self.train.gpu_count or self.train.cpus

    def _train_group_size(self) -> int | None:
        """The size of the device group holding train; None when no group does or its ranks do not parse."""
        for spec in (self.device_groups or {}).values():
            if not isinstance(spec, dict):
                continue
            workers = spec.get("workers")
            if "train" not in ([workers] if isinstance(workers, str) else workers or ()):
                continue
            try:
                ranks = parse_ranks(spec.get("ranks"))
            except ValueError:
                return None
            return ranks if isinstance(ranks, int) else len(ranks)
        return None


__all__ = ["BaseConfig", "GRPOConfig", "OrmRoleConfig", "ReferenceRoleConfig", "RolloutRoleConfig", "TeacherRoleConfig",
           "TrainRoleConfig"]
