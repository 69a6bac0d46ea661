"""The sample and distill configurations. Keys are spelled as ms-swift's `swift sample` spells them."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from rlcore import ConfigProblems, GenerateRoleConfig, LoggingKeys, RoleConfig, RunConfig
from rlcore.bounds import MAX_BATCH, MAX_COEF, MAX_SCORE, MAX_TIMEOUT_S, MAX_TOKENS
from rlcore.sections import DTYPE_HELP

from .select import AGGREGATIONS


class SamplerRoleConfig(GenerateRoleConfig):
    """The `sampler:` section: the engine that generates candidates (a local teacher, for distill)."""

    engine_defaults: ClassVar[dict[str, dict[str, Any]]] = {"vllm": {"vllm_gpu_memory_utilization": 0.9}}  # a GPU of its own


class ScorerRoleConfig(RoleConfig):
    """The `orm:` and `prm:` sections: where a reward model runs and how. `engine: hf` is rlcore's reward-model
    scorer (a sequence-classification ORM, a token-classification PRM); another name is a registered engine of
    kind `reward`."""

    engine_kinds: ClassVar[tuple[str, ...]] = ("reward",)

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("auto", description=DTYPE_HELP)
    batch_size: int = Field(16, ge=1, le=MAX_BATCH, description="candidates scored per forward pass")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="further options for the scorer")


class SampleConfig(LoggingKeys, RunConfig):
    """Best-of-N sampling: N candidates per prompt, scored by an ORM and/or a PRM, the best kept with a rejected
    partner, written as resumable JSONL."""

    model: str | None = Field(
        None, description="the sampler's model (a directory or hub id; tiny: the tiny random model, built in output_dir)"
    )
    dataset: str | list[str] = Field(
        "tiny:toy", description="JSONL/JSON/Parquet file(s) with a messages or prompt column; tiny:toy: the toy task"
    )
    data_range: list[int] | None = Field(
        None, description="[i, n]: sample shard i of n (contiguous; the first shards take one row more, none is dropped)"
    )
    use_chat_template: bool = Field(True, description="wrap text prompts with the tokenizer's chat template")
    max_prompt_length: int = Field(2048, ge=1, le=MAX_TOKENS, description="prompts are cut to their last max_prompt_length tokens")
    system: str | None = Field(None, description="a system message put before every prompt (replacing the row's own)")

    # sampling
    num_return_sequences: int = Field(8, ge=1, le=MAX_BATCH, description="candidates generated per prompt")
    max_new_tokens: int = Field(512, ge=1, le=MAX_TOKENS, description="new tokens per candidate at most")
    temperature: float = Field(1.0, ge=0, le=MAX_COEF, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(0, ge=0, le=MAX_TOKENS, description="top-k sampling; 0 is off")
    seed_per_prompt: bool = Field(
        True, description="draw each prompt's candidates with a seed of its own (from seed and the row's id): the "
        "output does not depend on the number of sampler workers or the batch; false batches prompts in one engine "
        "call (faster with vLLM, but the samples then depend on the split)"
    )
    batch_size: int = Field(64, ge=1, le=MAX_BATCH, description="prompts per batch; the output is committed after every batch")

    # scoring and selection
    orm_model: str | None = Field(
        None, description="outcome scorer: a registered reward function (accuracy, ...) or module:function, or a reward "
        "model (a directory or hub id; sequence classification, one label)"
    )
    orm_kwargs: dict[str, Any] = Field(default_factory=dict, description="options of an orm_model reward function")
    prm_model: str | None = Field(None, description="process reward model: a directory or hub id (token classification)")
    prm_step_separator: str = Field("\n\n", description="where a candidate's steps end, for the PRM")
    prm_step_token: str | None = Field(
        None, description="a token the PRM scores at, put after every step (Qwen2.5-Math-PRM: <extra_0>); unset: the "
        "step's last token"
    )
    prm_aggregation: Literal["min", "last", "prod"] = Field("min", description="step scores -> one score (as ms-swift: min)")
    orm_threshold: float = Field(0.0, ge=-MAX_SCORE, le=MAX_SCORE, description="a candidate passes when its ORM score is above this")
    prm_threshold: float = Field(0.0, ge=-MAX_SCORE, le=MAX_SCORE, description="a candidate passes when its aggregated PRM score is above this")
    easy_query_threshold: float | None = Field(
        None, ge=0, le=1, description="drop a prompt when at least this fraction of its candidates pass the ORM"
    )
    n_best_to_keep: int = Field(1, ge=1, le=MAX_BATCH, description="best candidates kept per prompt, each with a rejected partner")
    strict_rewards: bool = Field(False, description="a reward function failing on a candidate stops the run")
    reward_timeout_s: float = Field(
        600.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="one call of a reward function running longer than this "
        "counts as a reward error for each candidate it was scoring"
    )

    # output
    output_file: str = Field("samples.jsonl", description="the output's name in output_dir")
    output_format: Literal["messages", "dpo"] = Field(
        "messages", description="messages: each row with its last assistant message the chosen response, "
        "rejected_response and id (ms-swift's layout); dpo: {prompt, chosen, rejected, chosen_reward, rejected_reward}"
    )
    resume: Literal["no", "auto"] = Field("no", description="'auto' (--resume): continue after the last complete batch")

    # roles
    sampler: SamplerRoleConfig = Field(default_factory=SamplerRoleConfig, description="the candidates' engine")
    orm: ScorerRoleConfig = Field(default_factory=ScorerRoleConfig, description="used when orm_model is set")
    prm: ScorerRoleConfig = Field(default_factory=ScorerRoleConfig, description="used when prm_model is set")

    @model_validator(mode="before")
    @classmethod
    def _sampler_engine(cls, data: Any) -> Any:
        """ms-swift's `sampler_engine: vllm` is `sampler.engine`."""
        if isinstance(data, dict) and "sampler_engine" in data:
            data = dict(data)
            engine = data.pop("sampler_engine")
            section = dict(data.get("sampler") or {})
            if "engine" in section and section["engine"] != engine:
                raise ConfigProblems([("sampler_engine", f"is {engine!r} but sampler.engine is {section['engine']!r}; give one")])
            section["engine"] = engine
            data["sampler"] = section
        return data

    @property
    def uses_local_sampler(self) -> bool:
        """Candidates come from a sampler role (not an API)."""
        return True

    @property
    def scored(self) -> bool:
        return bool(self.orm_model or self.prm_model)

    @model_validator(mode="after")
    def _consistent(self) -> SampleConfig:
        problems = []
        if self.data_range is not None:
            if len(self.data_range) != 2 or not 0 <= self.data_range[0] < self.data_range[1]:
                problems.append(("data_range", f"must be [i, n] with 0 <= i < n; got {self.data_range}"))
        if self.output_format == "dpo" and not self.scored:
            problems.append(("output_format", "dpo pairs a chosen with a rejected candidate, which needs scores; set "
                             "orm_model or prm_model"))
        if self.scored and self.n_best_to_keep >= self.num_return_sequences:
            problems.append(("n_best_to_keep", f"({self.n_best_to_keep}) must be below num_return_sequences "
                             f"({self.num_return_sequences}): each kept candidate needs a rejected partner"))
        if self.orm_kwargs and not self.orm_model:
            problems.append(("orm_kwargs", "is set but orm_model is not"))
        if not self.output_file or "/" in self.output_file or self.output_file.startswith("."):
            problems.append(("output_file", f"must be a plain file name inside output_dir; got {self.output_file!r}"))
        assert self.prm_aggregation in AGGREGATIONS
        if problems:
            raise ConfigProblems(problems)
        return self


class DistillConfig(SampleConfig):
    """Distillation: a teacher writes the responses, through an OpenAI-compatible endpoint (api_base) or a local
    engine (the sampler role with model); scoring and selection as sample's."""

    model: str | None = Field(
        None, description="the teacher: the model name the endpoint serves (with api_base), or a local model directory"
    )
    api_base: str | None = Field(None, description="an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    api_key: SecretStr | None = Field(
        None, description="the endpoint's key; better unset, taking the environment's OPENAI_API_KEY (or 'EMPTY' for "
        "a local server). A key given here is used, and never written or printed (shown as '**********')"
    )
    num_return_sequences: int = Field(1, ge=1, le=MAX_BATCH, description="responses asked per prompt")
    max_concurrency: int = Field(16, ge=1, le=MAX_BATCH, description="requests in flight at once")
    max_retries: int = Field(5, ge=0, le=MAX_BATCH, description="retries of a request failing with 429, 5xx or a timeout")
    retry_backoff_s: float = Field(1.0, ge=0, le=MAX_TIMEOUT_S, description="first retry's wait; doubled every retry (with jitter)")
    request_timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S, description="seconds one request may take")

    @property
    def uses_local_sampler(self) -> bool:
        return not self.api_base

    @field_validator("api_key")
    @classmethod
    def _not_the_placeholder(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and value.get_secret_value() == str(value):
            raise ValueError("is the placeholder `config show` prints for a key; give the key, or better set "
                             "OPENAI_API_KEY in the environment")
        return value

    @model_validator(mode="after")
    def _teacher(self) -> DistillConfig:
        if self.api_base and not self.model:
            raise ConfigProblems([("model", "is unset; with api_base it names the model the endpoint serves")])
        if self.api_base and not self.api_base.startswith(("http://", "https://")):
            raise ConfigProblems([("api_base", f"must be an http(s) URL, e.g. http://127.0.0.1:8000/v1; got {self.api_base!r}")])
        return self


__all__ = ["DistillConfig", "SampleConfig", "SamplerRoleConfig", "ScorerRoleConfig"]
