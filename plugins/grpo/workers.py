"""The GRPO roles as worker classes: each is one in-process object locally and a group of actors on Ray."""

from __future__ import annotations

import os
import time
from typing import Any

from rlcore.workers import function, worker


def make_engine(kind: str, name: str, options: dict[str, Any]) -> Any:
    """Build a registered engine of `kind` in this process (a worker's)."""
    from rlcore.manager import plugins

    return plugins().engines.get(name, kind=kind).factory(**options)


def _gpu_uuid() -> str:
    """The physical GPU of this worker's current device (indices differ between processes; UUIDs do not)."""
    import torch

    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


@worker(group="train")
class TrainWorker:
    """The policy: a train engine per worker; the group is one data-parallel world."""

    def __init__(self, engine: str, options: dict[str, Any]):
        self.setup(engine, options)

    @function(group="train")
    def setup(self, engine: str, options: dict[str, Any]) -> None:
        """Build the engine where the worker runs (on Ray, the driver's own call is skipped)."""
        self.engine = make_engine("train", engine, options)

    @function(group="train", dispatch="slice", collect="concat")
    def forward_logprobs(self, batch, temperature: float = 1.0):
        return self.engine.forward_logprobs(batch, temperature)

    @function(group="train", execute="first", collect="first")
    def forward_topk(self, batch, k: int | None, temperature: float = 1.0):
        return self.engine.forward_topk(batch, k, temperature)

    @function(group="train", dispatch="slice", collect="mean")
    def train_step(self, batch, loss_fn, micro_batch_size: int, temperature: float = 1.0) -> dict[str, float]:
        """The engine's step, timed where it runs (`time/train` is the driver's view, dispatch included)."""
        start = time.perf_counter()
        out = self.engine.train_step(batch, loss_fn, micro_batch_size, temperature)
        return {**out, "time/train_worker": time.perf_counter() - start}

    @function(group="train", execute="first", collect="first")
    def export_weights(self, bucket_bytes: int) -> list:
        return list(self.engine.export_weights(bucket_bytes))

    @function(group="train", execute="first", collect="first")
    def weight_group_address(self) -> tuple[str, int]:
        """Where train rank 0 will host the broadcast group's store: its node's address and a free port."""
        from rlcore.cluster import find_free_port

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # rank 0 is its group's master: this node
        return host, find_free_port(host)

    @function(group="train", execute="first", collect="first", blocking=False)
    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        from rlcore.weight_sync import BroadcastGroup

        self.weight_group = BroadcastGroup(host, port, 0, world_size, backend)

    @function(group="train", execute="first", collect="first", blocking=False)
    def send_weights(self, bucket_bytes: int) -> dict[str, float]:
        return self.weight_group.send(self.engine.export_weights(bucket_bytes))

    @function(group="train")
    def gpu_uuid(self) -> str:
        return _gpu_uuid()

    @function(group="train")
    def start_ipc_export(self, bucket_bytes: int) -> None:
        """Begin a CUDA IPC sync: `next_ipc_bucket` then walks the engine's buckets one at a time."""
        from rlcore.weight_sync import CudaIpcSender

        self.ipc_sender = CudaIpcSender()
        self.ipc_buckets = iter(self.engine.export_weights(bucket_bytes))

    @function(group="train")
    def next_ipc_bucket(self) -> dict[str, Any] | None:
        """The next bucket as CUDA IPC handles (None after the last), freeing the one before."""
        self.ipc_sender.release()
        bucket = next(self.ipc_buckets, None)
        return None if bucket is None else self.ipc_sender.pack(bucket)

    @function(group="train")
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        self.engine.offload(params, grads, optimizer)

    @function(group="train")
    def reload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        self.engine.reload(params, grads, optimizer)

    @function(group="train", collect="first")
    def save(self, path: str) -> None:  # every rank takes part; rank 0 writes
        self.engine.save(path)

    @function(group="train")
    def load(self, path: str) -> None:
        self.engine.load(path)


@worker(group="reference")
class ReferenceWorker:
    """The frozen initial policy, for the KL penalty (created only when beta > 0)."""

    def __init__(self, engine: str, options: dict[str, Any]):
        self.setup(engine, options)

    @function(group="reference")
    def setup(self, engine: str, options: dict[str, Any]) -> None:
        """Build the engine where the worker runs (on Ray, the driver's own call is skipped)."""
        self.engine = make_engine("train", engine, options)

    @function(group="reference", dispatch="slice", collect="concat")
    def forward_logprobs(self, batch, temperature: float = 1.0):
        return self.engine.forward_logprobs(batch, temperature)


@worker(group="rollout")
class RolloutWorker:
    """Generates completions; takes new weights after every optimizer step."""

    def __init__(self, engine: str, options: dict[str, Any]):
        self.setup(engine, options)

    @function(group="rollout")
    def setup(self, engine: str, options: dict[str, Any]) -> None:
        """Build the engine where the worker runs (on Ray, the driver's own call is skipped)."""
        self.engine = make_engine("rollout", engine, options)

    @function(group="rollout", dispatch="slice", collect="flatten")
    def generate(self, prompts: list[list[int]], params) -> list:
        return self.engine.generate(prompts, params)

    @function(group="rollout", dispatch="slice", collect="flatten", blocking=False)
    def generate_async(self, prompts: list[list[int]], params) -> list:
        """`generate` that returns a handle at once, so the next round generates while this one trains."""
        return self.engine.generate(prompts, params)

    @function(group="rollout")
    def weight_receivers(self) -> int:
        return self.engine.weight_receivers()

    @function(group="rollout", blocking=False)
    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        receivers = self.engine.weight_receivers()
        rank = 1 + int(os.environ.get("RANK", "0")) * receivers  # train rank 0 is the group's rank 0
        self.engine.join_weight_group(host, port, rank, world_size, backend)

    @function(group="rollout", blocking=False)
    def receive_weights(self) -> None:
        self.engine.receive_weights()

    @function(group="rollout", execute="first", collect="first")
    def prompt_topk_logprobs(self, sequences: list[list[int]], k: int) -> list:
        return self.engine.prompt_topk_logprobs(sequences, k)

    @function(group="rollout")
    def gpu_uuid(self) -> str:
        return _gpu_uuid()

    @function(group="rollout", dispatch="slice")
    def load_ipc_bucket(self, payloads: list[dict[str, Any]]) -> None:
        """Load a bucket packed as CUDA IPC handles by the train rank on this worker's GPU."""
        from rlcore.weight_sync import receive_ipc

        for payload in payloads:
            self.engine.update_weights(receive_ipc(payload))

    @function(group="rollout")
    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    @function(group="rollout")
    def update_weights(self, buckets: list) -> None:
        for bucket in buckets:
            self.engine.update_weights(bucket)
        self.engine.finish_weight_update()

    @function(group="rollout")
    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    @function(group="rollout")
    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)


@worker(group="orm")
class OrmWorker:
    """An outcome reward model scoring (prompt, completion) pairs; a group of them shares the work."""

    def __init__(self, options: dict[str, Any]):
        self.setup(options)

    @function(group="orm")
    def setup(self, options: dict[str, Any]) -> None:
        from rlcore.plugins.rewards.orm import OrmScorer

        self.scorer = OrmScorer(**options)

    @function(group="orm", dispatch="slice", collect="flatten")
    def score(self, prompts: list, completions: list) -> list[float]:
        return self.scorer.score(prompts, completions)

