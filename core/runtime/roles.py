"""The role workers every algorithm shares: one class per kind of job, bound to a role name when its
group is made (`rlcore.runtime.workers.bind`), so one class serves any role.

- `TrainWorker`: a train engine per worker, the group one data-parallel world: `train`, `default`
  (SFT), and forward-only roles (`reference`, a colocated `teacher`) built with `kind="forward"`.
- `GenerateWorker`: a rollout engine per worker: `rollout`, `sampler`, a served `teacher`.
- `ScoreWorker`: a scorer per worker (`orm`, `prm`): a reward model that scores (prompt, completion) pairs.

Each is one in-process object without Ray and a group of actors with it (`rlcore.runtime.session.RoleSession`
builds them from the resource plan). The methods are the engines' own, so the driver calls
`session["train"].train_step(...)` as it would call the engine.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from ..errors import RlcoreError
from .rendezvous import find_free_port
from .workers import function, worker, worker_plugins, worker_rank


def make_engine(kind: str, engine: Any, options: dict[str, Any]) -> Any:
    """Build the engine `engine` (a factory, or a name registered for `kind` in the plugins the worker
    runtime gives: `rlcore.worker_plugins()`) in this process."""
    if callable(engine):
        return engine(**options)
    return worker_plugins().engines.get(engine, kind=kind).factory(**options)


@worker(group="train")
class TrainWorker:
    """A train engine per worker; the group is one data-parallel world. `kind="forward"` builds a
    forward-only engine (no optimizer) for reference and teacher models."""

    holds_state = True  # a train engine's weights and optimizer are the run's: a restart would lose them

    def __init__(self, engine: Any, options: dict[str, Any], kind: str = "train"):
        self.setup(engine, options, kind)

    @function()
    def setup(self, engine: Any, options: dict[str, Any], kind: str) -> None:
        """Build the engine where the worker runs (on Ray, the driver's own call is skipped)."""
        self.engine = make_engine(kind, engine, options)

    def _takes_part(self) -> bool:
        """Whether this worker runs a rank-0 call (forward_topk, export_weights): rank 0 does; the others do
        only when the engine's passes are collectives over the group (`engine.collective`: megatron with
        tensor or pipeline parallelism), and then rank 0's result is the one collected."""
        return worker_rank() == 0 or bool(getattr(self.engine, "collective", False))

    @function(dispatch="dp", collect="concat")
    def forward_logprobs(self, batch, temperature: float = 1.0):
        return self.engine.forward_logprobs(batch, temperature)

    @function(collect="first")
    def forward_topk(self, batch, k: int | None, temperature: float = 1.0):
        if not self._takes_part():
            return None
        out = self.engine.forward_topk(batch, k, temperature)
        return out if worker_rank() == 0 else None

    @function(dispatch="dp", collect="mean")
    def train_step(self, batch, loss_fn, micro_batch_size: int, temperature: float = 1.0) -> dict[str, float]:
        """The engine's step, timed where it runs (the driver's `time/train` includes the dispatch)."""
        start = time.perf_counter()
        out = self.engine.train_step(batch, loss_fn, micro_batch_size, temperature)
        return {**out, "time/train_worker": time.perf_counter() - start}

    @function(collect="first")
    def export_weights(self, bucket_bytes: int) -> list:
        if not self._takes_part():
            return []
        buckets = list(self.engine.export_weights(bucket_bytes))
        return buckets if worker_rank() == 0 else []

    @function(dispatch="first")
    def weight_group_address(self) -> tuple[str, int]:
        """Where rank 0 hosts a broadcast group's store: its node's address and a free port."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # rank 0 is its group's master: this node
        return host, find_free_port(host)

    @function(dispatch="first", blocking=False)
    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        from .weight_sync import BroadcastGroup

        self.weight_group = BroadcastGroup(host, port, 0, world_size, backend)

    @function(collect="first", blocking=False)
    def send_weights(self, bucket_bytes: int) -> dict[str, float] | None:
        """Rank 0 broadcasts; with a collective engine the other ranks take part in the export."""
        if worker_rank() == 0:
            return self.weight_group.send(self.engine.export_weights(bucket_bytes))
        if self._takes_part():
            for _ in self.engine.export_weights(bucket_bytes):
                pass
        return None

    @function(collect="first")
    def export_adapter(self, path: str) -> int:
        """The LoRA adapter alone, as a PEFT folder `path` (every rank takes part where the engine gathers, rank 0
        writes); returns its bytes, for an adapter-only sync (`rollout.vllm_enable_lora`)."""
        export = getattr(self.engine, "export_adapter", None)
        if export is None or not self.engine.state().get("lora"):
            raise RlcoreError(f"{type(self.engine).__name__} has no LoRA adapter to export; an adapter-only sync "
                              "(rollout.vllm_enable_lora) needs train.lora_rank > 0 on an engine with export_adapter")
        export(path)
        if worker_rank() != 0:
            return 0
        return sum(f.stat().st_size for f in os.scandir(path) if f.is_file())

    @function()
    def gpu_uuid(self) -> str:
        """The physical GPU of this worker's current device (indices differ between processes; UUIDs do not)."""
        from .weight_sync import gpu_uuid

        return gpu_uuid()

    @function(blocking=False)
    def next_ipc_bucket(self, bucket_bytes: int | None = None) -> dict[str, Any] | None:
        """The next bucket of a CUDA IPC sync as a handle payload (None after the last); `bucket_bytes` starts
        a sync. The bucket goes into the buffer of the bucket two before it, which the caller has seen loaded."""
        if bucket_bytes is not None:
            from .weight_sync import CudaIpcSender

            if getattr(self, "ipc_sender", None) is None:
                self.ipc_sender = CudaIpcSender()  # its two buffers are kept for every later sync
            self.ipc_sender.start()
            self.ipc_buckets = iter(self.engine.export_weights(bucket_bytes))
        start = time.perf_counter()
        bucket = next(self.ipc_buckets, None)
        if bucket is None:
            return None
        return {**self.ipc_sender.pack(bucket), "pack_s": time.perf_counter() - start}  # the export's share too

    @function()
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        self.engine.offload(params, grads, optimizer)

    @function()
    def reload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        self.engine.reload(params, grads, optimizer)

    @function(collect="first")
    def save(self, path: str) -> None:  # every rank takes part; rank 0 writes
        self.engine.save(path)

    @function()
    def load(self, path: str) -> None:
        self.engine.load(path)

    @function(collect="first")
    def save_hf(self, path: str) -> None:  # every rank takes part (megatron's export gathers); rank 0 writes
        from ..export import write_hf_model

        source = getattr(self.engine, "model_name", None)  # whose config and tokenizer the exported model takes
        if not source:
            raise RlcoreError(f"{type(self.engine).__name__} has no model_name (the model it was built from), so its "
                              "trained model cannot be written in Hugging Face format")
        write_hf_model(path, self.engine.export_weights(), source, write=worker_rank() == 0)
        export_adapter = getattr(self.engine, "export_adapter", None)
        if export_adapter is not None and self.engine.state().get("lora"):  # LoRA: the PEFT adapter in adapter/
            export_adapter(os.path.join(path, "adapter"))


@worker(group="train")
class TeacherTrainWorker(TrainWorker):
    """A train engine (a student's, a policy's); with `options["teacher"]` ({engine, options, offload}) also a
    forward-only teacher in the same process, on the same device (or in CPU memory with offload, brought in per
    forward). GKD's worker adds its distillation step to it; GRPO's teacher KL reads `teacher_logprobs`."""

    @function()
    def setup(self, engine: Any, options: dict[str, Any], kind: str) -> None:
        options = dict(options)
        teacher = options.pop("teacher", None)
        self.engine = make_engine(kind, engine, options)
        self.teacher, self.offload_teacher, self.teacher_seconds = None, False, 0.0
        if teacher:
            device = options.get("device", "cpu")
            self.teacher = make_engine("forward", teacher["engine"], {**teacher["options"], "device": device})
            self.offload_teacher = bool(teacher.get("offload"))
            if self.offload_teacher:
                self.teacher.offload(params=True, grads=False, optimizer=False)

    @contextlib.contextmanager
    def _teacher_loaded(self) -> Iterator[None]:
        if self.offload_teacher:
            self.teacher.reload(params=True, grads=False, optimizer=False)
        try:
            yield
        finally:
            if self.offload_teacher:
                self.teacher.offload(params=True, grads=False, optimizer=False)

    @function(dispatch="dp", collect="concat")
    def teacher_logprobs(self, batch: Any, temperature: float = 1.0) -> Any:
        """The colocated teacher's log-probs [B, T] of `batch`'s own tokens (GRPO's teacher KL), on the CPU."""
        with self._teacher_loaded():
            return self.teacher.forward_logprobs(batch, temperature)

    @function()
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        self.engine.offload(params, grads, optimizer)
        if self.teacher is not None and params and not self.offload_teacher:
            self.teacher.offload(params=True, grads=False, optimizer=False)

    @function()
    def reload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        self.engine.reload(params, grads, optimizer)
        if self.teacher is not None and params and not self.offload_teacher:
            self.teacher.reload(params=True, grads=False, optimizer=False)


@worker(group="rollout")
class GenerateWorker:
    """A rollout engine per worker: generates completions, serves top-k log-probs, takes new weights,
    sleeps while colocated roles hold the devices."""

    holds_state = False  # its weights come from the model and the train side: a lost worker is rebuilt and synced

    def __init__(self, engine: Any, options: dict[str, Any], kind: str = "rollout"):
        self.setup(engine, options, kind)

    @function()
    def setup(self, engine: Any, options: dict[str, Any], kind: str) -> None:
        """Build the engine where the worker runs (on Ray, the driver's own call is skipped)."""
        self.engine = make_engine(kind, engine, options)

    @function(dispatch="slice", collect="flatten")
    def generate(self, prompts: list[list[int]], params) -> list:
        return self.engine.generate(prompts, params)

    @function(dispatch="slice", collect="flatten", blocking=False)
    def generate_async(self, prompts: list[list[int]], params) -> list:
        """`generate` that returns a handle at once, so the next round generates while this one trains."""
        return self.engine.generate(prompts, params)

    @function(dispatch="slice", collect="flatten")
    def generate_episodes(self, rows: list[dict[str, Any]], setup: Any, params) -> list:
        """One multi-turn episode per row (`rlcore.episodes`), its environment made here, where it runs."""
        from ..episodes import run_episodes

        return run_episodes(self.engine, rows, setup, params, worker_plugins())

    @function(dispatch="slice", collect="flatten", blocking=False)
    def generate_episodes_async(self, rows: list[dict[str, Any]], setup: Any, params) -> list:
        """`generate_episodes` that returns a handle at once (async_generate)."""
        from ..episodes import run_episodes

        return run_episodes(self.engine, rows, setup, params, worker_plugins())

    @function(dispatch="first")
    def prompt_topk_logprobs(self, sequences: list[list[int]], k: int) -> Any:
        return self.engine.prompt_topk_logprobs(sequences, k)

    @function()
    def weight_receivers(self) -> int:
        return self.engine.weight_receivers()

    @function(blocking=False)
    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        receivers = self.engine.weight_receivers()
        rank = 1 + worker_rank() * receivers  # the sender is the group's rank 0
        self.engine.join_weight_group(host, port, rank, world_size, backend)

    @function(blocking=False)
    def receive_weights(self) -> dict[str, float] | None:
        return self.engine.receive_weights()

    @function()
    def weight_receiver_gpus(self) -> list[str]:
        """The GPU of each process that holds this worker's weights (a tensor-parallel vLLM has several)."""
        return self.engine.weight_receiver_gpus()

    @function(dispatch="slice", blocking=False)
    def load_ipc_bucket(self, payloads: list[list[dict[str, Any]]]) -> float:
        """Load a bucket packed as CUDA IPC handles: per worker, one payload per weight receiver, each from
        the sender on that receiver's GPU; returns the seconds it took."""
        start = time.perf_counter()
        for own in payloads:
            self.engine.load_ipc_bucket(own)
        return time.perf_counter() - start

    @function()
    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    @function()
    def load_adapter(self, path: str) -> None:
        """Serve the PEFT adapter in folder `path` on top of the base weights from now on (vLLM's LoRA)."""
        load = getattr(self.engine, "load_adapter", None)
        if load is None:
            raise RlcoreError(f"{type(self.engine).__name__} loads no LoRA adapter; an adapter-only sync "
                              "(rollout.vllm_enable_lora) needs rollout.engine vllm")
        load(path)

    @function()
    def update_weights(self, buckets: list) -> None:
        for bucket in buckets:
            self.engine.update_weights(bucket)
        self.engine.finish_weight_update()

    @function()
    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    @function()
    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)


@worker(group="orm")
class ScoreWorker:
    """A scorer per worker (a reward model): `score(prompts, completions)` -> one float per pair; a group
    shares the pairs."""

    holds_state = False  # a fixed model: a lost worker is rebuilt from its options

    def __init__(self, engine: Any, options: dict[str, Any], kind: str = "reward"):
        self.setup(engine, options, kind)

    @function()
    def setup(self, engine: Any, options: dict[str, Any], kind: str) -> None:
        self.scorer = make_engine(kind, engine, options)

    @function(dispatch="slice", collect="flatten")
    def score(self, prompts: list, completions: list) -> list[float]:
        return self.scorer.score(prompts, completions)
