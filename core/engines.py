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
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import RlcoreError

if TYPE_CHECKING:
    import torch

    from .batch import Batch

NamedTensors = list[tuple[str, "torch.Tensor"]]


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


@dataclass
class Generation:
    """One completion of one prompt. `logprobs[i]` is the sampler's log-prob of `token_ids[i]`,
    after temperature (what importance sampling needs)."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an EOS or stop token) or "length" (max_tokens reached)
    text: str = ""


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


class RolloutEngine(abc.ABC):
    """Generates completions; can take new weights and release its memory between rollouts."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """`params.n` completions per prompt, prompt-major: result[i * n + j] is prompt i's j-th."""

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
        from .weight_sync import gpu_uuid

        return [gpu_uuid()]

    def load_ipc_bucket(self, payloads: list[dict[str, Any]]) -> None:
        """Load one bucket packed by `rlcore.weight_sync.CudaIpcSender`s: payloads[i] from the sender on the GPU
        of receiver i (`weight_receiver_gpus`). By default one receiver, this process, through `update_weights`;
        an engine whose weights live in other processes loads each payload there."""
        from .weight_sync import IpcReceiver

        if len(payloads) != 1:
            raise RlcoreError(f"{type(self).__name__} holds its weights in one process but got {len(payloads)} IPC payloads")
        if getattr(self, "_ipc_receiver", None) is None:
            self._ipc_receiver = IpcReceiver()  # keeps the sender's buffers mapped from sync to sync
        self._ipc_receiver.load(payloads[0], self.update_weights)

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the broadcast group through which train rank 0 sends new weights (ranks rank.. rank+receivers-1),
        e.g. as an `rlcore.weight_sync.BroadcastGroup`. An engine that cannot leaves this as it is."""
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
