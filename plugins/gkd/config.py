"""The GKD configuration. Keys are spelled as TRL's GKDConfig and ms-swift spell them."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rlcore import BaseConfig, ConfigProblems, GenerateRoleConfig
from rlcore.bounds import MAX_BATCH, MAX_COEF, MAX_GIB, MAX_STEPS, MAX_TOKENS
from rlcore.runtime import parse_ranks
from rlcore.sections import (
    MultiTurnKeys, NonfiniteKeys, OptimizerKeys, PromptKeys, RolloutRoleConfig, TrainRoleConfig, TrainingConfig,
    default_of,
)


class TeacherRoleConfig(GenerateRoleConfig):
    """The `teacher:` section. With `gpus` (or `model`, or a device group listing `teacher`) the teacher is a
    group of its own, served by a rollout engine (vllm on GPUs, hf on the CPU) that returns top-k log-probs;
    without, the teacher is `teacher_model`, colocated in the train workers."""

    model: str | None = Field(None, description="the served teacher's model (a separate group); unset: teacher_model")
    engine_kinds: ClassVar[tuple[str, ...]] = ("teacher",)
    engine_defaults: ClassVar[dict[str, dict[str, Any]]] = {"vllm": {"vllm_gpu_memory_utilization": 0.9}}  # a GPU of its own


class GKDConfig(MultiTurnKeys, NonfiniteKeys, PromptKeys, TrainingConfig):
    """Generalized Knowledge Distillation (Agarwal et al., 2024; TRL's GKDTrainer): on-policy distillation."""

    # models and data
    model: str | None = Field(
        None, description="the student: an HF model directory or hub id (tiny: the tiny random model, built in output_dir)"
    )
    teacher_model: str | None = Field(
        None, description="the teacher, colocated in the train workers (full vocabulary or top-k); for a separate "
        "teacher group set teacher.model and teacher.gpus instead (tiny:teacher: a tiny one with peaked distributions)"
    )
    offload_teacher_model: bool = Field(
        False, description="colocated teacher: keep it in CPU memory, brought to the device only for its forward"
    )
    dataset: str | list[str] = Field(
        "tiny:chat", description="JSONL/JSON/Parquet file(s) with messages (ending in the assistant's turn) or prompt + "
        "completion; tiny:chat: short pairs whose last eval_size rows use words the others never do"
    )
    max_completion_length: int = Field(128, ge=1, le=MAX_TOKENS, description="tokens of a completion at most, generated or from the data")

    # schedule
    max_steps: int = Field(100, ge=1, le=MAX_STEPS, description="optimizer steps to run")
    learning_rate: float = default_of(OptimizerKeys, "learning_rate", 5e-7)
    per_device_train_batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="sequences per micro-batch per train worker")
    gradient_accumulation_steps: int = Field(1, ge=1, le=MAX_BATCH, description="micro-batches per optimizer step")

    # distillation
    beta: float = Field(0.5, ge=0, le=1, description="generalized JSD mix: 0 forward KL(teacher || student), 1 reverse KL")
    lmbda: float = Field(0.5, ge=0, le=1, description="fraction of steps whose completions the student generates (on-policy)")
    temperature: float = Field(0.9, gt=0, le=MAX_COEF, description="sampling temperature, and the temperature of both distributions in the loss")
    sft_alpha: float = Field(0.0, ge=0, le=MAX_COEF, description="weight of the cross-entropy on dataset completions (off-policy steps)")
    gkd_logits_topk: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="distil over the teacher's top-k tokens only; unset: the full vocabulary (colocated teacher only)"
    )
    seq_kd: bool = Field(False, description="not supported (ms-swift deprecated it); must stay false")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of on-policy completions")
    top_k: int = Field(0, ge=0, le=MAX_TOKENS, description="top-k sampling of on-policy completions; 0 is off")

    # held-out measure
    eval_size: int = Field(0, ge=0, le=MAX_STEPS, description="the dataset's last eval_size rows are held out; their JSD is logged as eval/jsd")
    eval_steps: int = Field(10, ge=1, le=MAX_STEPS, description="eval/jsd every eval_steps steps (and after the last one)")

    # outputs
    weight_sync_bucket_mb: int = Field(512, ge=1, le=MAX_GIB, description="bucket size of train -> rollout weight sync")
    weight_sync_backend: Literal["auto", "object_store", "nccl", "gloo", "cuda_ipc"] = Field(
        "auto", description="how train weights reach the rollout role on Ray (see GRPO's key of the same name)"
    )
    check_weight_sync: bool = Field(
        True, description="after the first sync and the first after a step, compare rollout and train log-probs"
    )

    # roles
    train: TrainRoleConfig = Field(default_factory=TrainRoleConfig, description="the student's train engine")
    rollout: RolloutRoleConfig = Field(default_factory=RolloutRoleConfig, description="generates on-policy completions (lmbda > 0)")
    teacher: TeacherRoleConfig = Field(default_factory=TeacherRoleConfig, description="a separate teacher group (top-k only)")

    @property
    def served_teacher(self) -> bool:
        """The teacher is a group of its own (served top-k), not a model inside the train workers."""
        return bool(self.teacher.gpu_count or self.teacher.model or "teacher" in self._device_group_roles())

    def _device_group_roles(self) -> set[str]:
        roles: set[str] = set()
        for spec in (self.device_groups or {}).values():
            if isinstance(spec, dict):
                workers = spec.get("workers")
                roles.update([workers] if isinstance(workers, str) else workers or ())
        return roles

    @property
    def train_workers(self) -> int:
        """The train workers the config declares (the device group holding train, else train.gpus or train.cpus)."""
        for spec in (self.device_groups or {}).values():
            if isinstance(spec, dict) and "train" in ([spec.get("workers")] if isinstance(spec.get("workers"), str) else spec.get("workers") or ()):
                try:
                    ranks = parse_ranks(spec.get("ranks"))
                except ValueError:
                    return 1
                return ranks if isinstance(ranks, int) else len(ranks)
        return self.train.gpu_count or self.train.cpus

    @model_validator(mode="after")
    def _consistent(self) -> GKDConfig:
        problems = []
        if self.seq_kd:
            problems.append(("seq_kd", "is not supported: ms-swift deprecated sequence-level KD. Drop it; for on-policy "
                             "distillation raise lmbda, or train on a dataset of the teacher's own completions"))
        if self.served_teacher:
            if self.gkd_logits_topk is None:
                problems.append(("gkd_logits_topk", "is unset (full vocabulary), but the teacher is a separate group "
                                 "(teacher: gpus/model), which serves top-k log-probs only. Either set gkd_logits_topk "
                                 "(e.g. 64), or colocate the teacher in the train workers: set teacher_model and drop "
                                 "the teacher section's gpus and model"))
            if self.teacher_model and self.teacher.model and self.teacher_model != self.teacher.model:
                problems.append(("teacher_model", f"('{self.teacher_model}') and teacher.model ('{self.teacher.model}') "
                                 "differ; give the served teacher once, as teacher.model"))
            if not (self.teacher_model or self.teacher.model):
                problems.append(("teacher.model", "is unset; name the model the separate teacher group serves"))
            if self.offload_teacher_model:
                problems.append(("offload_teacher_model", "applies to a teacher colocated in the train workers, but the "
                                 "teacher is a separate group; drop it (its engine sleeps when it shares GPUs)"))
        elif self.model and not self.teacher_model:  # no model: `model is unset` says what to set first
            problems.append(("teacher_model", "is unset; set teacher_model (colocated in the train workers), or "
                             "teacher.model with teacher.gpus (a separate group serving top-k)"))
        if problems:
            raise ConfigProblems(problems)
        return self


__all__ = ["BaseConfig", "GKDConfig", "RolloutRoleConfig", "TeacherRoleConfig", "TrainRoleConfig"]
