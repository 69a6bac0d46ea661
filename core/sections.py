"""The config sections algorithms share: the run's optimizer, checkpoint and logging keys (`TrainingConfig`
holds them all), the role sections of a trained policy (`train:`, `rollout:`, and a served `teacher:` is a
rollout section too), and the engine options built from them.

A key every training algorithm has is written once, here: an optimizer key added to `OptimizerKeys` (and
`rlcore.OptimizerOptions`) reaches every algorithm's config and every train engine. An algorithm whose
default differs says so with `default_of` (`learning_rate: float = default_of(OptimizerKeys, "learning_rate",
2e-5)`); an algorithm with a role of its own subclasses the role sections (adding keys) and keeps the option
builders.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, Field, model_validator
from pydantic.fields import FieldInfo

from .bounds import MAX_COEF, MAX_RATE, MAX_STEPS, MAX_TIMEOUT_S, MAX_TOKENS, MAX_WORKERS
from .config import BaseConfig, ConfigProblems, RoleConfig, RunConfig
from .engines import OptimizerOptions
from .errors import RlcoreError, did_you_mean


DTYPE_HELP = ("auto (default): on a GPU the checkpoint's bfloat16/float16 (bfloat16 for a float32 checkpoint), on "
              "the CPU float32; or float32, bfloat16, float16")


def default_of(section: type[BaseModel], key: str, default: Any) -> Any:
    """`section`'s field `key` (its checks, aliases and description) with another default."""
    return FieldInfo.merge_field_infos(section.model_fields[key], default=default)


class OptimizerKeys(BaseConfig):
    """The optimizer and learning-rate schedule (AdamW; TRL's names), read into `OptimizerOptions`."""

    learning_rate: float = Field(
        1e-6, gt=0, le=MAX_RATE, validation_alias=AliasChoices("learning_rate", "lr"), description="AdamW learning rate (alias: lr)"
    )
    weight_decay: float = Field(0.0, ge=0, le=MAX_RATE, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    adam_epsilon: float = Field(1e-8, gt=0, le=1, description="AdamW epsilon")
    max_grad_norm: float = Field(1.0, ge=0, le=MAX_COEF, description="gradient clipping norm (0: off)")
    lr_scheduler_type: Literal["constant", "cosine", "linear"] = Field("constant", description="learning-rate schedule")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="linear warm-up steps")
    min_lr: float = Field(
        0.0, ge=0, le=MAX_RATE, description="the learning rate the cosine schedule decays to (Megatron's and ms-swift's min_lr); 0: to zero"
    )

    @model_validator(mode="after")
    def _min_lr_floors_the_cosine(self) -> OptimizerKeys:
        if not self.min_lr:
            return self
        problems = []
        if self.min_lr > self.learning_rate:
            problems.append(("min_lr", f"({self.min_lr}) is above learning_rate ({self.learning_rate}); the schedule "
                             "decays from learning_rate to min_lr"))
        if self.lr_scheduler_type not in ("cosine", "cosine_with_min_lr"):
            problems.append(("min_lr", f"({self.min_lr}) is the floor of the cosine schedule, but lr_scheduler_type is "
                             f"{self.lr_scheduler_type!r}; set lr_scheduler_type cosine, or min_lr 0"))
        if problems:
            raise ConfigProblems(problems)
        return self


class CheckpointKeys(BaseConfig):
    """When checkpoints are written and kept, and where a run continues from."""

    save_steps: int = Field(0, ge=0, le=MAX_STEPS, description="checkpoint every N steps; 0: only at the end")
    save_total_limit: int | None = Field(None, ge=1, le=MAX_STEPS, description="keep the newest N checkpoints")
    resume: Literal["no", "auto"] | str = Field("no", description="'auto': continue from the newest checkpoint; or a path")


class LoggingKeys(BaseConfig):
    """How often a step's metrics are printed (metrics.jsonl has every step), and how much rlcore says."""

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="stderr and output_dir/run.log (--log-level wins); debug also shows third-party progress bars"
    )
    logging_steps: int = Field(
        10, ge=1, le=MAX_STEPS, description="print a line of the step's metrics every N steps (TRL's default); metrics.jsonl has every step"
    )


class NonfiniteKeys(BaseConfig):
    """What a step whose loss or gradient norm is not finite does, for algorithms whose engines can skip an
    update (`rlcore.Trainer` reads it)."""

    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a step whose loss or grad_norm is NaN or infinite: stop the run (its checkpoints stay the "
        "last good ones), or skip it (its update is dropped) and go on",
    )


class PromptKeys(BaseConfig):
    """How a dataset row's prompt becomes the tokens a policy answers (GRPO's and GKD's prompts alike)."""

    use_chat_template: bool = Field(True, description="wrap prompts with the tokenizer's chat template")
    system: str | None = Field(
        None, description="a system message opening every prompt that has none of its own (the row's wins, as in ms-swift)"
    )
    max_prompt_length: int = Field(512, ge=1, le=MAX_TOKENS, description="tokens of a prompt at most (truncation_strategy says how)")
    truncation_strategy: Literal["left", "right", "delete"] = Field(
        "left", description="a prompt longer than max_prompt_length: left keeps its last tokens, right its first, "
        "delete leaves its row out of the run (ms-swift's names)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="options the chat template reads, e.g. {enable_thinking: false} (TRL's "
        "name; ms-swift's enable_thinking sets it)")


class MultiTurnKeys(BaseConfig):
    """Multi-turn rollouts (`rlcore.episodes`): an environment answers each model turn, in ms-swift's spelling
    (`multi_turn_scheduler`, `max_turns`) or TRL's (`tools`, `environment_factory`). Unset: one turn."""

    multi_turn_scheduler: str | None = Field(
        None, description="the environment between turns: a registered name (math_tip_trick, tool_call, or a plugin's), "
        "module:Class or file.py:Class; a fresh one per episode")
    environment_kwargs: dict[str, Any] = Field(default_factory=dict, description="options of multi_turn_scheduler's factory")
    tools: list[str] = Field(default_factory=list, description="TRL's tools: module:function (or file.py:function) "
                             "names whose signatures and docstrings are the chat template's tool schemas")
    environment_factory: str | None = Field(
        None, description="TRL's environment_factory: module:Class with reset(); its public documented methods are the "
        "tools, its get_reward() (if any) the episode's environment reward")
    max_turns: int | None = Field(None, ge=1, le=MAX_STEPS, description="model turns per episode at most; unset: until the "
                                  "environment ends it or max_completion_length is reached")
    max_turn_length: int | None = Field(None, ge=1, le=MAX_TOKENS, description="new tokens per turn at most; unset: max_completion_length")
    environment_timeout: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S, description="seconds an environment's reset or step may take; "
                                       "longer, or raising, ends that episode with a recorded error")

    @property
    def multi_turn(self) -> bool:
        return bool(self.multi_turn_scheduler or self.tools or self.environment_factory)

    def multi_turn_problems(self, plugins: Any) -> list[tuple[str, str]]:
        """(key, message) for an unregistered scheduler name or a tool/class spelled without `module:`."""
        problems: list[tuple[str, str]] = []
        name = self.multi_turn_scheduler
        if name and ":" not in name and name not in plugins.environments:
            known = ", ".join(plugins.environments.names()) or "(none)"
            problems.append(("multi_turn_scheduler", f"environment '{name}' is not registered; known: {known}"
                             f"{did_you_mean(name, plugins.environments.names())}, or give module:Class"))
        for i, tool in enumerate(self.tools):
            if ":" not in tool:
                problems.append((f"tools.{i}", f"'{tool}' must be module:function or file.py:function"))
        if self.environment_factory and ":" not in self.environment_factory:
            problems.append(("environment_factory", f"'{self.environment_factory}' must be module:Class or file.py:Class"))
        if self.environment_factory and self.multi_turn_scheduler:
            problems.append(("environment_factory", "and multi_turn_scheduler both name the environment; give one"))
        return problems

    def episode_setup(self, model: str, max_completion_length: int) -> Any:
        """What a rollout worker runs episodes with (`rlcore.episodes.EpisodeSetup`)."""
        from .episodes import EpisodeSetup

        return EpisodeSetup(
            model=model, environment=self.multi_turn_scheduler, environment_kwargs=dict(self.environment_kwargs),
            tools=tuple(self.tools), environment_factory=self.environment_factory,
            max_turns=self.max_turns or max_completion_length, max_turn_tokens=self.max_turn_length or max_completion_length,
            max_total_tokens=max_completion_length, environment_timeout=self.environment_timeout,
            use_chat_template=getattr(self, "use_chat_template", True), max_prompt_length=getattr(self, "max_prompt_length", None),
            system=getattr(self, "system", None), truncation=getattr(self, "truncation_strategy", "left"),
            template_kwargs=tuple(sorted(getattr(self, "chat_template_kwargs", {}).items())),
        )


class TrainingConfig(LoggingKeys, CheckpointKeys, OptimizerKeys, RunConfig):
    """A `RunConfig` for an algorithm that trains: the run's keys plus the optimizer, checkpoint and logging
    keys `rlcore.Trainer` and the train engines read."""

    def optimizer_options(self) -> OptimizerOptions:
        """The train engines' optimizer options from this config's keys (with `max_steps`, if it has one)."""
        return OptimizerOptions.from_config(self)


class TrainRoleConfig(RoleConfig):
    """The `train:` section: the policy's train engine (its engine's own keys, megatron's parallel sizes, come
    with the engine's plugin)."""

    engine_kinds: ClassVar[tuple[str, ...]] = ("train",)

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("auto", description=DTYPE_HELP)
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    lora_rank: int = Field(0, ge=0, le=MAX_WORKERS, description="LoRA rank; 0 trains all weights")
    lora_alpha: int = Field(32, ge=1, le=MAX_WORKERS, description="LoRA scaling numerator")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (with lora_rank > 0)")
    lora_target_modules: list[str] | str = Field("all-linear", description="modules LoRA adapts")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="further options for the engine")


class GenerateRoleConfig(RoleConfig):
    """The section of a role a rollout engine serves: `rollout:`, a sampler, a served teacher (its engine's own
    keys, vLLM's `vllm_*`, come with the engine's plugin)."""

    engine_kinds: ClassVar[tuple[str, ...]] = ("rollout",)

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("auto", description=DTYPE_HELP)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="further options for the engine")


class RolloutRoleConfig(GenerateRoleConfig):
    """The `rollout:` section: the engine that generates completions."""


def train_options(config: Any, model: str) -> dict[str, Any]:
    """The train engine's options: the model, `config.train`'s keys and the run's optimizer keys as one
    `OptimizerOptions` (`optimizer`)."""
    train: TrainRoleConfig = config.train
    return {
        "model": model, "dtype": train.dtype, "seed": config.seed, "optimizer": OptimizerOptions.from_config(config),
        "gradient_checkpointing": train.gradient_checkpointing,
        "lora_rank": train.lora_rank, "lora_alpha": train.lora_alpha, "lora_target_modules": train.lora_target_modules,
        **({"lora_dropout": train.lora_dropout} if train.lora_rank else {}),  # engines without LoRA take no dropout
        **train.engine_options(), **train.engine_kwargs,
    }


def train_engine_problems(config: Any, plugins: Any) -> list[tuple[str, str]]:
    """The train engine's own check (`EngineSpec.check`) of the options `train_options` gives it, each key as
    the config spells it (`train.engine_kwargs.torch_compile_mode`, `train.lora_rank`); none where the config
    has no `train:` section, its engine is not registered (the resource plan names that) or has no check."""
    train = getattr(config, "train", None)
    if not isinstance(train, TrainRoleConfig):
        return []
    try:
        check = plugins.engines.get(train.engine, kind="train").check
    except RlcoreError:
        return []
    if check is None:
        return []

    def path(key: str) -> str:
        if key in train.engine_kwargs:
            return f"train.engine_kwargs.{key}"
        return f"train.{key}" if key in type(train).model_fields else key

    model = getattr(config, "model", None) or ""
    problems = check(**train_options(config, model))
    if not model:  # no model yet (a demo builds its tiny one when it runs): nothing to say about it
        problems = [(key, message) for key, message in problems if key != "model"]
    return [(path(key), message) for key, message in problems]


def generate_engine_problems(config: Any, plugins: Any, role: str, model: str) -> list[tuple[str, str]]:
    """The engine's own check (`EngineSpec.check`, of kind rollout or teacher) of the options `rollout_options` gives
    the generate role `role` serving `model`, each key under the role's section (`rollout.vllm_max_model_len`);
    none where the role has no such section, or its engine is not registered (the plan names that) or has no check."""
    section = getattr(config, role, None)
    if not isinstance(section, GenerateRoleConfig):
        return []
    for kind in ("rollout", "teacher"):
        try:
            check = plugins.engines.get(section.engine, kind=kind).check
        except RlcoreError:
            continue
        if check is not None:
            options = rollout_options(section, model, getattr(config, "seed", 0))
            return [(f"{role}.{key}", message) for key, message in check(**options) if model or key != "model"]
    return []


def other_engine_key_problems(config: Any, roles: Any) -> list[tuple[str, str]]:
    """A key of another engine that asks for something only that engine does (marked `engine_only` in its field's
    `json_schema_extra`: `rollout.vllm_enable_lora`, `train.tensor_model_parallel_size`) given a value other than its
    default in a role's section whose engine would not see it. Other engines' tuning keys are let be, so that a
    YAML written for one engine runs on another (ms-swift's `vllm_*` with `use_vllm false`)."""
    problems = []
    for role in roles:
        section = getattr(config, role, None)
        if not isinstance(section, RoleConfig) or not section.engine_keys:
            continue
        own = {key for kind in section.engine_kinds for key in section.engine_keys.get((section.engine, kind), ())}
        fields = type(section).model_fields
        for key in sorted(section.model_fields_set - own):
            owners = sorted({engine for (engine, kind), keys in section.engine_keys.items()
                             if key in keys and kind in section.engine_kinds})
            info = fields.get(key)
            marked = isinstance(getattr(info, "json_schema_extra", None), dict) and info.json_schema_extra.get("engine_only")
            if not owners or not marked or getattr(section, key) == info.get_default(call_default_factory=True):
                continue
            problems.append((f"{role}.{key}", f"is a key of engine {' or '.join(repr(o) for o in owners)}, but "
                             f"{role}.engine is '{section.engine}', which does not take it; set {role}.engine "
                             f"{owners[0]}, or drop {key}"))
    return problems


def engine_config_problems(config: Any, plugins: Any, roles: Any) -> list[tuple[str, str]]:
    """What the engines of `roles` find in the whole config (`EngineSpec.config_check(config, role)`: keys of other
    sections beside their own, such as a rollout engine's adapter sync against `train.lora_rank`)."""
    problems: list[tuple[str, str]] = []
    for role in roles:
        section = getattr(config, role, None)
        if not isinstance(section, RoleConfig):
            continue
        for kind in section.engine_kinds:
            try:
                spec = plugins.engines.get(section.engine, kind=kind)
            except RlcoreError:
                continue
            if spec.config_check is not None:
                problems += spec.config_check(config, role)
            break
    return problems


def rollout_options(section: RoleConfig, model: str, seed: int) -> dict[str, Any]:
    """A role's engine options from its section (a `RolloutRoleConfig`, or one like it with `dtype` and
    `engine_kwargs`: a served teacher's, GRPO's reference): the model, dtype and seed, the section's keys of its
    engine (`RoleConfig.engine_options`: vLLM's `vllm_*`), then its `engine_kwargs`."""
    options: dict[str, Any] = {"model": model, "dtype": section.dtype, "seed": seed}
    return {**options, **section.engine_options(), **section.engine_kwargs}


__all__ = [
    "DTYPE_HELP", "CheckpointKeys", "GenerateRoleConfig", "LoggingKeys", "MultiTurnKeys", "NonfiniteKeys", "OptimizerKeys", "PromptKeys",
    "RolloutRoleConfig", "TrainRoleConfig", "TrainingConfig",
    "default_of", "engine_config_problems", "generate_engine_problems", "other_engine_key_problems", "rollout_options", "train_engine_problems", "train_options",
]
