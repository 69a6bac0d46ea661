"""The SFT and pre-training configuration. Keys are spelled as TRL's SFTConfig, transformers'
TrainingArguments and ms-swift spell them, so a config written for those carries over."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlcore import ConfigProblems, DeviceKeys
from rlcore.bounds import MAX_BATCH, MAX_STEPS, MAX_TOKENS, MAX_WORKERS
from rlcore.sections import DTYPE_HELP, OptimizerKeys, TrainingConfig, default_of


class DefaultRoleConfig(DeviceKeys):
    """The `default:` section (the per-role resource form): every worker of this role trains, one data-parallel
    worker per GPU (CPU workers talk over gloo)."""


class LMConfig(TrainingConfig):
    """Keys SFT and pre-training share."""

    # model and data
    model: str | None = Field(None, description="HF model directory or hub id (tiny: the tiny random model, built in output_dir)")
    dataset: str | list[str] | None = Field(
        None, description="local JSONL/JSON/Parquet file(s) (tiny:sft, tiny:pt: toy arithmetic conversations, sentences)"
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("auto", description=DTYPE_HELP)
    max_length: int | None = Field(1024, ge=1, le=MAX_TOKENS, description="tokens per sequence (or per packed block) at most")
    packing: bool = Field(False, description="pack several rows into one sequence of max_length")
    dataset_cache_dir: str | None = Field(
        None, description="where each node stores the rows and their tokenised form once (node-local disk); unset: "
        "$RLCORE_DATA_CACHE, else the system's temporary directory"
    )

    # schedule
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="optimizer steps; unset: num_train_epochs over the data")
    num_train_epochs: float = Field(3.0, gt=0, le=MAX_STEPS, description="passes over the data when max_steps is unset")
    learning_rate: float = default_of(OptimizerKeys, "learning_rate", 2e-5)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr"] = Field(
        "linear", description="learning-rate schedule (transformers' names)"
    )
    warmup_steps: float = Field(0.0, ge=0, le=MAX_STEPS, description="warm-up steps; a value below 1 is a fraction of max_steps")
    per_device_train_batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="rows (or packed sequences) per micro-batch per worker")
    gradient_accumulation_steps: int = Field(1, ge=1, le=MAX_BATCH, description="micro-batches per optimizer step")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    bf16: bool = Field(False, description="bfloat16 mixed precision (autocast)")
    fp16: bool = Field(False, description="float16 mixed precision (autocast with a loss scaler)")
    dataloader_num_workers: int = Field(0, ge=0, le=MAX_WORKERS, description="data-loading processes per worker")
    run_ahead: bool = Field(
        True, description="each worker starts its next optimizer step while the driver logs the last one (not before "
        "a checkpoint or the last step; a signal then stops after that step); false: every step waits for the driver"
    )

    # LoRA (ms-swift's names; through peft)
    lora_rank: int = Field(0, ge=0, le=MAX_WORKERS, description="LoRA rank; 0 trains all weights")
    lora_alpha: int = Field(32, ge=1, le=MAX_WORKERS, description="LoRA scaling numerator")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout")
    lora_target_modules: list[str] | str = Field("all-linear", description="modules LoRA adapts")

    # outputs
    trainer_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="further keys of the Hugging Face trainer's arguments (TRL's SFTConfig for sft, transformers' "
        "TrainingArguments for pt), checked against its fields before anything starts",
    )

    # the role
    default: DefaultRoleConfig = Field(default_factory=DefaultRoleConfig, description="the training workers")

    @property
    def datasets(self) -> list[str]:
        return [self.dataset] if isinstance(self.dataset, str) else list(self.dataset or [])

    @model_validator(mode="after")
    def _consistent(self) -> LMConfig:
        problems = []
        if getattr(self, "padding_free", False) and not self.packing and self.max_length is not None:
            problems.append(("padding_free", "without packing, TRL's SFTTrainer does not cut rows to max_length; set "
                             "max_length: null (rows as they are), or packing: true (padding-free already)"))
        if self.bf16 and self.fp16:
            problems.append(("fp16", "and bf16 are both set; choose one mixed precision"))
        if self.packing and self.max_length is None:
            problems.append(("max_length", "is unset, but packing needs a sequence length; set max_length"))
        for key in ("sleep_level", "offload_model", "offload_optimizer", "colocate_groups"):  # `config show` writes
            # their defaults, so only another value is a mistake
            if getattr(self, key) != type(self).model_fields[key].get_default(call_default_factory=True):
                problems.append((key, "has no effect here: every worker trains, no role shares its devices; remove it"))
        if problems:
            raise ConfigProblems(problems)
        return self


class SFTConfig(LMConfig):
    """Supervised fine-tuning on conversations (TRL's SFTTrainer in every worker)."""

    completion_only_loss: bool | None = Field(
        None, description="prompt/completion rows: loss on the completion only (unset: TRL's default, on)"
    )
    assistant_only_loss: bool = Field(
        False, description="messages rows: loss on assistant turns only (the chat template needs {% generation %})"
    )
    padding_free: bool = Field(False, description="no padding: a micro-batch is one flattened sequence, each row "
                               "with its own position ids (packing: true is padding-free already)")
    model_name: list[str] | None = Field(
        None, min_length=1, max_length=2, description="fills {{NAME}} in the rows (ms-swift's self-cognition data); "
        "two values: the first for rows tagged zh, the second for the others"
    )
    model_author: list[str] | None = Field(
        None, min_length=1, max_length=2, description="fills {{AUTHOR}} in the rows, as model_name"
    )


class PretrainConfig(LMConfig):
    """Pre-training (continued) on plain text (transformers' Trainer in every worker): rows with a `text`
    column, packed into blocks of max_length."""

    packing: bool = Field(True, description="concatenate the texts and cut them into blocks of max_length")


__all__ = ["DefaultRoleConfig", "LMConfig", "PretrainConfig", "SFTConfig"]
