"""The SFT and pre-training driver: every worker of the `default` role trains, the workers are one
data-parallel world, and one rlcore step is one optimizer step of the Hugging Face trainer in each worker.

Placement (either YAML form, or one process without Ray), the world, the config, metrics JSONL and hooks,
signals and checkpoints are rlcore's (`rlcore.RoleTrainer`); chat templates, packing, loss
masks, LoRA, gradient checkpointing, schedulers and mixed precision are the Hugging Face trainer's
(`build.py`); `worker.py` joins the two loops.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcore import ConfigError, ModelUse, RoleSetup, RoleTrainer, announce
from rlcore.data import has_conversations, model_problem
from rlcore.engines import installed_version
from rlcore.memory import RoleUse
from rlcore.paths import folder_problem
from rlcore.runtime import load_state

from .build import build_pt, build_sft, trainer_kwargs_problems
from .config import LMConfig, PretrainConfig, SFTConfig
from .data import cache_folder, check_files
from .worker import CHECKPOINT, LMWorker

ROLE = "default"
# config key -> the Hugging Face trainer's argument of the same meaning (most share the name)
PASSED = (
    "seed", "num_train_epochs", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "lr_scheduler_type", "warmup_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
    "gradient_checkpointing", "bf16", "fp16", "dataloader_num_workers",
)
SFT_PASSED = ("max_length", "packing", "completion_only_loss", "assistant_only_loss", "padding_free")


def trainer_optimizer(trainer_kwargs: dict[str, Any]) -> str:
    """The `optim` the Hugging Face trainer will use: `trainer_kwargs`' where given, else TrainingArguments' default
    for the installed torch (`adamw_torch_fused` from torch 2.8), read from torch's version: importing
    TrainingArguments to ask would cost `plan` and `validate` torch's import."""
    if "optim" in trainer_kwargs:
        return str(trainer_kwargs["optim"])
    return "adamw_torch_fused" if (installed_version("torch") or (0, 0)) >= (2, 8) else "adamw_torch"


class LMTrainer(RoleTrainer):
    """The `default` role trains with a Hugging Face trainer per worker; `kind` picks which (sft, pt)."""

    config: LMConfig
    kind = "sft"
    build = staticmethod(build_sft)
    progress_keys = ("loss", "grad_norm")
    plot_keys = ("loss", "mean_token_accuracy", "grad_norm", "learning_rate", "num_tokens")
    resume_fixed = (  # what the data order, the batches and the model's shapes depend on
        "model", "dataset", "seed", "per_device_train_batch_size", "gradient_accumulation_steps", "max_length",
        "packing", "padding_free", "device_groups", "default.gpus", "default.cpus", "lora_rank", "lora_target_modules",
    )

    required = ("model", "dataset")

    def __init__(self, config: LMConfig, plugins: Any, *, use_ray: bool = False):
        super().__init__(config, plugins, use_ray=use_ray)
        self.shape: dict[str, Any] = {}
        self.begun = False

    @classmethod
    def roles(cls, config: LMConfig) -> list[str]:
        return [ROLE]

    @classmethod
    def problems(cls, config: LMConfig, plugins: Any, run: bool = False) -> list[tuple[str, str]]:
        """The trainer's extra arguments and the data files, before anything is allocated."""
        problems = trainer_kwargs_problems(cls.kind, config.trainer_kwargs, set(type(config).model_fields))
        unloadable = model_problem(config.model)
        if unloadable:  # before the workers' hub client retries for a minute
            problems.append(("model", unloadable))
        problems.extend(check_files(config.datasets, cls.kind))
        root, named = cache_folder(config.dataset_cache_dir)
        unusable = folder_problem(root)
        if unusable:  # as each worker's node_dataset would refuse it; the message names the variable that gave it
            problems.append(("dataset_cache_dir", f"{named} {root}: {unusable}; give a writable folder"))
        return problems

    @classmethod
    def models(cls, config: LMConfig) -> list[ModelUse]:
        """The model holds a sequence (or a packed block) of max_length tokens; sft's conversations go through its
        chat template (TRL's SFTTrainer), unless trainer_kwargs.chat_template_path gives one."""
        lengths = ((("max_length",), (config.max_length,)),) if config.max_length else ()
        chats = cls.kind == "sft" and "chat_template_path" not in config.trainer_kwargs
        return [ModelUse("model", config.model, lengths, conversations=(
            lambda: "dataset" if has_conversations(config.datasets) else None) if chats else None)]

    @classmethod
    def memory_use(cls, config: LMConfig) -> dict[str, RoleUse]:
        """Each worker trains a transformers model with torch's AdamW, as the hf train engine does (its memory
        terms; the Trainer's default AdamW, fused from torch 2.8), on micro-batches of `max_length` tokens, the
        model's own loss over the full [B, T, V] logits."""
        if not config.model:
            return {}
        options = {"model": config.model, "dtype": config.dtype, "gradient_checkpointing": config.gradient_checkpointing,
                   "lora_rank": config.lora_rank, "chunked_lm_head": False, "model_loss": True,
                   "optim": trainer_optimizer(config.trainer_kwargs)}
        return {ROLE: RoleUse("hf", "train", options, "training", config.model, config.per_device_train_batch_size,
                              config.gradient_accumulation_steps, config.max_length or 1024,
                              knobs={"micro_batch": "per_device_train_batch_size",
                                     "accumulation": "gradient_accumulation_steps"})}

    def setups(self) -> dict[str, RoleSetup]:
        return {ROLE: RoleSetup(LMWorker, type(self).build, self.options())}

    def options(self) -> dict[str, Any]:
        """What each worker builds its trainer from (paths absolute: a worker's directory is not the driver's)."""
        cfg = self.config
        model = cfg.model
        if os.path.exists(os.path.expanduser(model)):
            model = str(Path(model).expanduser().resolve())
        data = [str(Path(p).expanduser().resolve()) for p in cfg.datasets]
        args = {k: getattr(cfg, k) for k in PASSED}
        args["max_steps"] = cfg.max_steps or -1
        if cfg.min_lr:  # the cosine schedule's floor: transformers' cosine_with_min_lr
            args.update(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": cfg.min_lr})
        if self.kind == "sft":
            args.update({k: getattr(cfg, k) for k in SFT_PASSED})
        args.update(cfg.trainer_kwargs)
        lora = None
        if cfg.lora_rank:
            lora = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                    "target_modules": cfg.lora_target_modules}
        cache = str(Path(cfg.dataset_cache_dir).expanduser().resolve()) if cfg.dataset_cache_dir else None
        names = {key.upper().removeprefix("MODEL_"): getattr(cfg, key) for key in ("model_name", "model_author")
                 if getattr(cfg, key, None)}  # sft's self-cognition placeholders: NAME, AUTHOR
        return {"model": model, "data": data, "dataset_cache_dir": cache, "dtype": cfg.dtype, "args": args, "lora": lora,
                "self_cognition": names or None,
                "output_dir": str(Path(cfg.output_dir).expanduser().resolve()),
                "max_length": cfg.max_length, "packing": cfg.packing}

    @property
    def max_steps(self) -> int:
        return int(self.config.max_steps or self.shape["max_steps"])

    # -- the loop's context: the role runs, its trainer's loop begins where the checkpoint says ----------

    @contextlib.contextmanager
    def start(self) -> Iterator[None]:
        with super().start():
            self.shape = self.session[ROLE].plan()
            announce([f"{self.kind}: {self.shape['world_size']} data-parallel rank(s), global batch "
                      f"{self.shape['global_batch']}, {self.shape['train_rows']} training rows, "
                      f"{self.max_steps} optimizer steps"])
            try:
                yield
            except BaseException:  # a signal, a failed worker: unwind the trainers' loops, if they still answer
                with contextlib.suppress(Exception):
                    self._close()
                raise
            self._close()

    def _close(self) -> None:
        """The trainers' loops end: finished ones run their end of training, early ones unwind."""
        if self.begun:
            self.begun = False
            self.session[ROLE].close()

    def on_start(self) -> None:
        if not self.begun:  # a fresh run (a resumed one began in load_model)
            self._begin(None, 0)

    def _begin(self, resume: str | None, step: int) -> None:
        self.begun = True
        at = self.session[ROLE].begin(resume)
        if at != step:
            raise ConfigError(f"resume: the trainer's checkpoint is at step {at}, rlcore's at step {step}")

    def train_step(self) -> dict[str, Any]:
        with self.timer("train"):
            logs = self.session[ROLE].step(self._ahead(self.step + 1))
        return dict(logs)

    def _ahead(self, step: int) -> bool:
        """Whether the workers may begin the step after `step` before the driver asks: the loop will ask for it
        unless a signal comes (see steps_begun_ahead), for it is neither past the last step nor after a save."""
        save = self.save_steps and step % self.save_steps == 0
        return bool(self.config.run_ahead) and step < self.max_steps and not save

    def steps_begun_ahead(self) -> list[dict[str, Any]]:
        return [dict(logs) for logs in self.session[ROLE].ahead_logs()]

    # -- checkpoints: the trainer's own (model, optimizer, scheduler, RNG, step) and rlcore's state ------

    def save_model(self, path: Path) -> None:
        self.session[ROLE].save(str(Path(path).resolve()))

    exports_model = True

    def export_model(self, path: Path) -> None:
        self.session[ROLE].save_hf(str(Path(path).resolve()))

    def load_model(self, path: Path) -> None:
        folder = Path(path).resolve() / CHECKPOINT
        if not (folder / "trainer_state.json").is_file():
            raise ConfigError(f"resume: {path} holds no trainer checkpoint ({folder} is missing or incomplete)")
        self._begin(str(folder), load_state(path)["step"])


class SFTTrainer(LMTrainer):
    """Supervised fine-tuning: TRL's SFTTrainer in every worker."""

    config: SFTConfig
    name = kind = "sft"
    build = staticmethod(build_sft)


class PretrainTrainer(LMTrainer):
    """Pre-training on plain text: transformers' Trainer in every worker."""

    config: PretrainConfig
    name = kind = "pt"
    build = staticmethod(build_pt)
