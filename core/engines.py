"""The engine interfaces: what an algorithm asks of a train engine and of a rollout engine.

Implementations live in plugins (`hf`, `vllm`, `megatron`) and are registered with `rlcore_engines`.
Engines import their heavy libraries (torch, vLLM, megatron) themselves; this module imports none.

Conventions shared by every engine:
- token sequences are lists of ints; a train batch is a `Batch` with `input_ids` and `attention_mask`
  ([B, T], right-padded) and, for losses, a `completion_mask` ([B, T], 1 on completion tokens);
- per-token log-probs are aligned with `input_ids`: column t holds log p(input_ids[t] | input_ids[:t])
  (column 0 is 0), so a mask over `input_ids` selects them directly;
- distributions are aligned the same way: row t of a [B, T, k] or [B, T, V] tensor is the distribution
  of token t given tokens :t; row 0 and rows past a sequence's end are 0 (`TopK`, `ModelOutputs`);
- weights travel in Hugging Face parameter names.

`rlcore.engines` is the sub-API an engine plugin imports: these interfaces, the checks every engine shares
(`rlcore.engine_checks`: model, dtype and device options, aligned rows) and `read_model` (a model's files, read
without loading). `rlcore.head` (it imports torch) gives `HeadModelOutputs`, hidden states and LM head in chunks.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, RlcoreError, did_you_mean

if TYPE_CHECKING:
    import torch

    from .batch import Batch

NamedTensors = list[tuple[str, "torch.Tensor"]]


SCHEDULERS = ("constant", "constant_with_warmup", "cosine", "linear")  # lr_scheduler_type, as transformers names them


@dataclass(frozen=True)
class OptimizerOptions:
    """What every train engine's optimizer and learning-rate schedule take (AdamW; TRL's names).

    One object, built from the run's keys (`from_config`) and handed to the engine as `optimizer=`, so an
    optimizer key added here and in `rlcore.sections.OptimizerKeys` reaches every engine and algorithm.
    `max_steps` is the schedule's length (0: none, for a constant schedule); `min_lr` the learning rate the cosine
    schedule decays to (Megatron's and ms-swift's name; 0: to zero).
    """

    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "constant"
    warmup_steps: int = 0
    max_steps: int = 0
    min_lr: float = 0.0

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_config(cls, config: Any) -> OptimizerOptions:
        """The options from a run config's keys of the same names (those it has)."""
        return cls(**{key: getattr(config, key) for key in cls.keys() if getattr(config, key, None) is not None})

    @classmethod
    def of(cls, optimizer: OptimizerOptions | dict[str, Any] | None = None, **keys: Any) -> OptimizerOptions:
        """`optimizer` (an object or a mapping) with flat `keys` (`learning_rate=1e-3`, e.g. from a role's
        `engine_kwargs`) winning; a key that is not an optimizer option is a ConfigError naming the known ones."""
        base = dict(optimizer) if isinstance(optimizer, dict) else {} if optimizer is None else asdict(optimizer)
        unknown = sorted((set(base) | set(keys)) - set(cls.keys()))
        if unknown:
            raise ConfigError(
                f"unknown engine option(s) {', '.join(unknown)}.{did_you_mean(unknown[0], cls.keys())} "
                f"Optimizer options: {', '.join(cls.keys())}", [(key, "is not an engine option") for key in unknown])
        return cls(**{**base, **keys})

    def problems(self) -> list[tuple[str, str]]:
        """(key, message) for every bad option, found before any weight is read."""
        problems: list[tuple[str, str]] = []

        def need(ok: bool, key: str, rule: str) -> None:
            if not ok:
                problems.append((key, f"{key}={getattr(self, key)!r} {rule}"))

        need(self.learning_rate >= 0, "learning_rate", "must be >= 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        need(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        need(self.adam_epsilon > 0, "adam_epsilon", "must be > 0")
        need(self.max_grad_norm is None or self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0: no clipping)")
        need(self.lr_scheduler_type in SCHEDULERS, "lr_scheduler_type", f"must be one of {', '.join(SCHEDULERS)}")
        need(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "warmup_steps", "must be an int >= 0")
        need(isinstance(self.max_steps, int) and self.max_steps >= 0, "max_steps", "must be an int >= 0")
        if self.lr_scheduler_type in ("cosine", "linear"):
            need(self.max_steps > 0, "max_steps", f"must be > 0 for lr_scheduler_type={self.lr_scheduler_type!r}")
        need(0 <= self.min_lr <= self.learning_rate, "min_lr", f"must be in [0, learning_rate={self.learning_rate!r}]")
        need(not self.min_lr or self.lr_scheduler_type == "cosine", "min_lr",
             f"is the floor of the cosine schedule, but lr_scheduler_type is {self.lr_scheduler_type!r}; set "
             "lr_scheduler_type cosine, or min_lr 0")
        return problems


@dataclass(frozen=True)
class TrainOptions:
    """What every train engine takes (hf, megatron, a third-party one), named as TRL names it: the model, where
    and how to run it, its optimizer (`OptimizerOptions`), LoRA and gradient checkpointing. An engine with keys
    of its own subclasses it (megatron's parallel sizes), so a key added here reaches every engine.

    `of(model, **keys)` builds one from flat keys (a role's options, `engine_kwargs`): the optimizer's
    (`learning_rate=`) are folded into `optimizer`. `forward_only` builds the engine without optimizer.
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    gradient_checkpointing: bool = False
    lora_rank: int = 0
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str | list[str] = "all-linear"
    logprob_micro_batch_size: int = 16
    seed: int = 42
    dist_timeout_s: float = 600.0
    forward_only: bool = False

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key `of` takes: the fields, and the optimizer's keys flat."""
        return tuple(f.name for f in fields(cls)) + OptimizerOptions.keys()

    @classmethod
    def of(cls, options: TrainOptions | str | None = None, **keys: Any) -> Any:
        """`options` (an object of this class, or the model) with `keys` winning; an unknown key is a
        ConfigError naming the closest known one."""
        if isinstance(options, TrainOptions):
            base = {f.name: getattr(options, f.name) for f in fields(options)}
        else:
            base = {} if options is None else {"model": options}
        base.update(keys)
        flat = {key: base.pop(key) for key in OptimizerOptions.keys() if key in base}
        own = {f.name for f in fields(cls)}
        unknown = sorted(set(base) - own)
        if unknown:
            raise ConfigError(
                f"unknown engine option(s) {', '.join(unknown)}.{did_you_mean(unknown[0], cls.keys())} "
                f"Options: {', '.join(cls.keys())}", [(key, "is not an engine option") for key in unknown])
        base["optimizer"] = OptimizerOptions.of(base.get("optimizer"), **flat)
        return cls(**base)

    def problems(self) -> list[tuple[str, str]]:
        """(key, message) for every bad option (the optimizer's first), found before any weight is read."""
        problems = self.optimizer.problems()

        def need(ok: bool, key: str, rule: str) -> None:
            if not ok:
                problems.append((key, f"{key}={getattr(self, key)!r} {rule}"))

        need(isinstance(self.lora_rank, int) and self.lora_rank >= 0, "lora_rank", "must be an int >= 0 (0: no LoRA)")
        need(self.lora_alpha > 0, "lora_alpha", "must be > 0")
        need(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        need(isinstance(self.logprob_micro_batch_size, int) and self.logprob_micro_batch_size >= 1,
             "logprob_micro_batch_size", "must be a positive int")
        need(self.dist_timeout_s > 0, "dist_timeout_s", "must be > 0")
        if self.forward_only:
            need(self.lora_rank == 0, "lora_rank", "must be 0 for a forward-only engine (nothing is trained)")
            need(not self.gradient_checkpointing, "gradient_checkpointing", "must be False for a forward-only engine")
        return problems


def unknown_options(name: str, options: dict[str, Any], known: tuple[str, ...]) -> list[tuple[str, str]]:
    """(key, message) for each option not in `known`, the message naming the closest known one; `name`
    ("hf train engine") starts it."""
    return [(key, f"{name} has no option '{key}'.{did_you_mean(key, known)}") for key in options if key not in known]


def options_check(cls: type, name: str) -> Callable[..., list[tuple[str, str]]]:
    """An `EngineSpec.check` for an engine whose options are the `TrainOptions` subclass `cls`: its unknown
    options (`unknown_options`, against `cls.keys()`), else `cls.problems()`."""

    def check(**options: Any) -> list[tuple[str, str]]:
        return unknown_options(name, options, cls.keys()) or cls.of(**options).problems()

    return check


def build_engine(cls: type, name: str, options: dict[str, Any], known: tuple[str, ...] = (),
                 hidden: tuple[str, ...] = (), **fixed: Any) -> Any:
    """`cls(**options, **fixed)` after checking `options` against what it takes (`known`, or its constructor's
    parameters but `hidden`, where `**optimizer_keys` stands for the `OptimizerOptions` keys): an unknown
    option is a ConfigError naming the closest known one. `name` ("hf train engine") starts the message."""
    import inspect

    if not known:
        params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self" and p.name not in hidden]
        known = tuple(p.name for p in params if p.kind is not p.VAR_KEYWORD)
        if any(p.kind is p.VAR_KEYWORD for p in params):
            known += OptimizerOptions.keys()
    unknown = unknown_options(name, options, known)
    if unknown:
        raise ConfigError("; ".join(message for _, message in unknown) + f" Options: {', '.join(known)}.",
                          [(key, "unknown option") for key, _ in unknown])
    return cls(**options, **fixed)


@dataclass
class SamplingParams:
    """How to sample completions; names as TRL and vLLM spell them."""

    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True  # each sampled token's log-prob (GRPO's importance sampling); best-of-N needs none


@dataclass
class Generation:
    """One completion of one prompt. `logprobs[i]` is the sampler's log-prob of `token_ids[i]`,
    after temperature (what importance sampling needs); empty where `SamplingParams.logprobs` was off and the
    engine skips them."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an EOS or stop token) or "length" (max_tokens reached)
    text: str = ""
    prompt_ids: list[int] = field(default_factory=list)  # the prompt's token ids, set by the caller that gave them


@dataclass
class TopK:
    """The k most likely tokens at every position of a batch of sequences: `ids` (long) and `logprobs`
    (float32), both [B, T, k], right-padded to the longest sequence, best first.

    Row t is the distribution of token t given tokens :t; row 0 and padding rows are 0 (ids and values).
    Every engine gives this layout: train engines from `forward_topk`, rollout engines (a served
    teacher) from `prompt_topk_logprobs`.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor


@dataclass
class Projection:
    """A causal LM's last hidden states and its output layer, for a loss that applies the layer in chunks of
    positions (so [B, T, V] logits never exist): `hidden` [B, T, H], row t the state that predicts token t
    (row 0 and padding 0, as `TopK`), `weight` [V, H] and `bias` [V] or None of the LM head. Logits are
    `hidden @ weight.T + bias`, before any temperature."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None


class ModelOutputs(abc.ABC):
    """One micro-batch's forward pass inside a train step, as the loss function sees it.

    The engine builds it from its forward pass at the step's temperature; the loss asks for what it needs
    and the engine computes that (a Megatron engine vocab-parallel), once. Results are aligned as the
    module docstring says (row 0 and padding are 0) and gradients flow through all of them.
    """

    @abc.abstractmethod
    def logprobs(self) -> torch.Tensor:
        """Per-token log-probs [B, T] of `input_ids`."""

    @abc.abstractmethod
    def logprobs_at(self, ids: torch.Tensor) -> torch.Tensor:
        """Log-probs at given token ids: `ids` [B, T, k] (a teacher's `TopK.ids`) -> [B, T, k], each
        normalised over the full vocabulary (renormalise over the k yourself where a loss wants that)."""

    @abc.abstractmethod
    def full_logprobs(self) -> torch.Tensor:
        """Log-probs over the whole vocabulary, [B, T, V]."""

    def logits_at(self, ids: torch.Tensor) -> torch.Tensor:
        """Scores at given token ids [B, T, k] equal to `logprobs_at(ids)` up to a constant per row (the
        logits at the temperature), for a loss that renormalises over the k itself (GKD's top-k): an engine
        that has the hidden states skips the normaliser over the vocabulary. By default `logprobs_at`."""
        return self.logprobs_at(ids)

    def projection(self) -> Projection | None:
        """The hidden states and LM head behind these outputs (differentiable), or None where the engine keeps
        only logits (a vocab-parallel engine); a full-vocabulary loss then reads `full_logprobs`."""
        return None


class RolloutEngine(abc.ABC):
    """Generates completions; can take new weights and release its memory between rollouts."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """`params.n` completions per prompt, prompt-major: result[i * n + j] is prompt i's j-th."""

    # Optional: `run_episodes(episodes, params)` runs multi-turn episodes (`rlcore.episodes.EpisodeRunner`) to their
    # ends, for an engine that can take requests while it generates (vLLM submits an episode's next turn as soon
    # as its previous one ends). Without it, `rlcore.episodes.run_episodes` generates every unfinished episode's
    # next turn in one `generate` call per turn (`run_turns`): the episodes build on the engines, not the reverse.

    @abc.abstractmethod
    def prompt_topk_logprobs(self, sequences: list[list[int]], k: int) -> TopK:
        """The k most likely tokens at every position of `sequences` (a distillation teacher), at temperature 1:
        [B, T, k] with B = len(sequences), T the longest, in the layout `TopK` describes."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (Hugging Face names); may be called once per bucket."""

    def finish_weight_update(self) -> None:
        """Called after the last bucket of a sync (vLLM resets its prefix cache here)."""

    def weight_receivers(self) -> int:
        """How many members this engine adds to a weight broadcast group (one per process holding weights)."""
        return 1

    def weight_receiver_gpus(self) -> list[str]:
        """The GPU (UUID) of each process holding this engine's weights, in the order `load_ipc_bucket` takes
        payloads; by default one: this process's current GPU."""
        from .runtime.weight_sync import gpu_uuid

        return [gpu_uuid()]

    def load_ipc_bucket(self, payloads: list[dict[str, Any]]) -> None:
        """Load one bucket packed by `rlcore.runtime.weight_sync.CudaIpcSender`s: payloads[i] from the sender on the GPU
        of receiver i (`weight_receiver_gpus`). By default one receiver, this process, through `update_weights`;
        an engine whose weights live in other processes loads each payload there."""
        from .runtime.weight_sync import IpcReceiver

        if len(payloads) != 1:
            raise RlcoreError(f"{type(self).__name__} holds its weights in one process but got {len(payloads)} IPC payloads")
        if getattr(self, "_ipc_receiver", None) is None:
            self._ipc_receiver = IpcReceiver()  # keeps the sender's buffers mapped from sync to sync
        self._ipc_receiver.load(payloads[0], self.update_weights)

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the broadcast group through which train rank 0 sends new weights (ranks rank.. rank+receivers-1),
        e.g. as an `rlcore.runtime.weight_sync.BroadcastGroup`. An engine that cannot leaves this as it is."""
        raise RlcoreError(
            f"{type(self).__name__} cannot receive weights over a broadcast group; colocate the rollout role "
            "with train (in-process or CUDA IPC sync) or implement join_weight_group and receive_weights"
        )

    def receive_weights(self) -> dict[str, float] | None:
        """Take one sync's buckets from the broadcast group, load them, then finish the update; returns the
        receiver's phase seconds where it measures them (`BroadcastGroup.receive_into`)."""
        raise RlcoreError(f"{type(self).__name__} cannot receive weights over a broadcast group")

    @abc.abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release memory: level 1 offloads weights and drops the cache, level 2 drops both."""

    @abc.abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take memory back: `tags` among "weights", "kv_cache"; None means everything."""


LossFn = Callable[[ModelOutputs, "Batch"], tuple["torch.Tensor", dict[str, float]]]


class TrainEngine(abc.ABC):
    """Holds a model and its optimizer on one worker; several workers of a group form one DDP/Megatron world.

    Registered under kind "train", and under kind "forward" built without optimizer or scheduler (a
    reference or a colocated teacher model): a forward engine answers forward passes and refuses `train_step`.
    """

    @abc.abstractmethod
    def forward_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs [B, T] of `batch.input_ids`, aligned as the module docstring says."""

    @abc.abstractmethod
    def forward_topk(
        self, batch: Batch, k: int | None, temperature: float = 1.0, *, on_device: bool = False
    ) -> TopK | torch.Tensor:
        """Top-k log-probs (a `TopK`, [B, T, k]), or full-vocabulary log-probs [B, T, V] when k is None; on
        CPU (to travel), or with `on_device` on the engine's device (a colocated teacher's, used in place)."""

    @abc.abstractmethod
    def train_step(
        self, batch: Batch, loss_fn: LossFn, micro_batch_size: int, temperature: float = 1.0
    ) -> dict[str, float]:
        """One optimizer step over `batch` in micro-batches.

        `loss_fn(outputs, micro_batch)` gets the micro-batch's `ModelOutputs` (at `temperature`) and returns
        (loss, metrics) where loss is the micro-batch's share of the batch loss: the engine sums gradients
        over micro-batches (and DDP averages over workers), clips, steps the optimizer and returns averaged
        metrics plus `grad_norm` and `lr`.
        """

    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[NamedTensors]:
        """The weights in Hugging Face names, in buckets of at most `bucket_bytes` (one tensor may exceed it)."""

    @abc.abstractmethod
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move the named state to CPU memory (or drop grads) to free the accelerator."""

    @abc.abstractmethod
    def reload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded state back to the accelerator."""

    @abc.abstractmethod
    def save(self, path: str) -> None:
        """Write model, optimizer and scheduler state under `path` (a directory)."""

    @abc.abstractmethod
    def load(self, path: str) -> None:
        """Read what `save` wrote."""

    def state(self) -> dict[str, Any]:
        """Small facts for metrics and checks (device, dtype, parameter count)."""
        return {}


# The checks and helpers every engine shares, re-exported here: an engine plugin's one import of core's engine API.
from .engine_checks import (  # noqa: E402  (below the interfaces, which engine_checks does not import)
    aligned_rows, check_ids, check_temperature, check_train_step, common_problems, installed_version, names_lm_head,
    raise_problems, resolve_dtype, tied_head_problems, torch_device,
)
from .conditional import CheckpointLayout, checkpoint_layout  # noqa: E402
from .model_checks import read_model  # noqa: E402


__all__ = [
    "SCHEDULERS", "CheckpointLayout", "Generation", "LossFn", "ModelOutputs", "NamedTensors", "OptimizerOptions",
    "Projection", "RolloutEngine", "SamplingParams", "TopK", "TrainEngine", "TrainOptions", "aligned_rows",
    "build_engine", "check_ids", "check_temperature", "check_train_step", "checkpoint_layout", "common_problems",
    "installed_version", "names_lm_head", "options_check",
    "raise_problems", "read_model", "resolve_dtype", "tied_head_problems", "torch_device", "unknown_options",
]
