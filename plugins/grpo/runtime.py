"""Where GRPO's roles live and how they hand over: workers, colocated sleep/wake, weight sync.

Weight sync transports: in process (no Ray: the engines share a process); CUDA IPC between colocated
actors on one GPU (each train rank hands its flat buckets to the rollout worker on its GPU as handles, no
copy through the host); Ray's object store (CPU runs, colocated tensor-parallel rollouts); and a broadcast
from train rank 0 to the rollout workers over a process group of their own (NCCL on GPUs, gloo to test it
on the CPU) for separate roles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .config import GRPOConfig
from .workers import OrmWorker, ReferenceWorker, RolloutWorker, TrainWorker


class RoleRuntime:
    """Builds the train, rollout (and reference) groups, in process or on Ray, and moves weights between them."""

    def __init__(self, config: GRPOConfig, use_ray: bool):
        self.config = config
        self.use_ray = use_ray
        self.roles = ["train", "rollout"] + (["reference"] if config.beta > 0 else [])
        self.roles += ["orm"] if "orm" in config.reward_funcs else []
        self.plan = None
        if use_ray:
            from rlcore.resources import plan_from_config

            self.plan = plan_from_config(config, roles=self.roles, policy=config.placement)
        self.colocated = config.colocated
        self.transport = self._transport()
        self.train_workers = self._workers("train") if use_ray else 1
        self.train = self.rollout = self.reference = self.orm = None
        self.awake: set[str] = {"weights", "kv_cache"}  # what of the rollout engine holds memory now
        self.ipc_sources: list[int] = []  # cuda_ipc: for each rollout worker, the train rank on its GPU

    def _transport(self) -> str:
        """How weights reach the rollout engines: in process, CUDA IPC, Ray's object store, or a broadcast."""
        cfg = self.config
        if not self.use_ray:
            return "in_process"
        if cfg.weight_sync_backend != "auto":
            return cfg.weight_sync_backend
        on_gpus = all(
            getattr(cfg, r).gpus > 0 and getattr(cfg, r).engine_kwargs.get("device", "cuda") != "cpu"
            for r in ("train", "rollout")
        )
        if not on_gpus:
            return "object_store"
        if not self.colocated:
            return "nccl"
        # a tensor-parallel vLLM keeps its workers in processes of their own, beyond one actor's handles
        single = cfg.rollout.engine != "vllm" or cfg.rollout.vllm_tensor_parallel_size == 1
        return "cuda_ipc" if single else "object_store"

    def _workers(self, role: str) -> int:
        section = getattr(self.config, role)
        return section.gpus or section.cpus

    def _options(self, role: str, model: str) -> dict[str, Any]:
        cfg = self.config
        section = getattr(cfg, role)
        opts: dict[str, Any] = {"model": model, "dtype": section.dtype, "seed": cfg.seed}
        if role == "train":
            opts.update(
                learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                lr_scheduler_type=cfg.lr_scheduler_type, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                gradient_checkpointing=section.gradient_checkpointing, lora_rank=section.lora_rank,
                lora_alpha=section.lora_alpha, lora_target_modules=section.lora_target_modules,
            )
        if role == "rollout" and section.engine == "vllm":
            opts.update(
                vllm_tensor_parallel_size=section.vllm_tensor_parallel_size,
                vllm_gpu_memory_utilization=section.vllm_gpu_memory_utilization,
                vllm_max_model_len=section.vllm_max_model_len,
                vllm_enforce_eager=section.vllm_enforce_eager,
                vllm_in_process=section.vllm_in_process,
                vllm_request_seeds=section.vllm_request_seeds,
                vllm_engine_kwargs=section.vllm_engine_kwargs,
            )
        if section.gpus and section.engine != "vllm":
            opts["device"] = "cuda"
        opts.update(section.engine_kwargs)
        return opts

    @contextlib.contextmanager
    def start(self, model: str) -> Iterator[RoleRuntime]:
        """Allocate devices (Ray) and build the workers; tear everything down on the way out."""
        with self._placement():
            cfg = self.config
            self.train = TrainWorker(cfg.train.engine, self._options("train", model))
            if cfg.beta > 0:
                self.reference = ReferenceWorker(cfg.reference.engine, self._options("reference", model))
            self.rollout = RolloutWorker(cfg.rollout.engine, self._options("rollout", model))
            if "orm" in self.roles:
                orm = cfg.orm
                device = "cuda" if orm.gpus else "cpu"
                self.orm = OrmWorker({"model_path": orm.model, "dtype": orm.dtype, "batch_size": orm.batch_size, "device": device})
            if self.transport in ("nccl", "gloo"):
                self._join_weight_group()
            if self.transport == "cuda_ipc":
                self.ipc_sources = self._pair_by_gpu()
            self._sleep()
            yield self

    @contextlib.contextmanager
    def _placement(self) -> Iterator[None]:
        if not self.use_ray:
            yield
            return
        from rlcore import cluster, workers
        from rlcore.placement import allocate, release

        cluster.init(self.config.ray_address)
        slots = allocate(self.plan, timeout_s=self.config.placement_timeout_s)
        try:
            with workers.runtime(slots, use_ray=True):
                yield
        finally:
            release(slots)

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Colocated: the train model steps aside while the rollout engine holds the devices."""
        cfg = self.config
        if not self.colocated:
            yield
            return
        self.train.offload(params=cfg.offload_model, grads=True, optimizer=cfg.offload_optimizer)
        self._wake(["weights", "kv_cache"])
        try:
            yield
        finally:
            self._sleep()
            self.train.reload(params=cfg.offload_model, grads=False, optimizer=cfg.offload_optimizer)

    def _join_weight_group(self) -> None:
        """A broadcast group of train rank 0 and every rollout worker; all members join at once."""
        from rlcore.workers import wait

        host, port = self.train.weight_group_address()
        world_size = 1 + sum(self.rollout.weight_receivers())
        wait([
            self.train.join_weight_group(host, port, world_size, self.transport),
            self.rollout.join_weight_group(host, port, world_size, self.transport),
        ], timeout=self.config.placement_timeout_s)

    def _pair_by_gpu(self) -> list[int]:
        """For each rollout worker, the train rank on the same GPU (CUDA IPC only maps memory within one GPU)."""
        from rlcore import ConfigError

        train, rollout = self.train.gpu_uuid(), self.rollout.gpu_uuid()
        missing = [r for r, uuid in enumerate(rollout) if uuid not in train]
        if missing:
            raise ConfigError(
                f"weight_sync_backend cuda_ipc: rollout workers {missing} share no GPU with a train worker "
                f"(train GPUs {train}, rollout GPUs {rollout}); colocate train and rollout, or use object_store"
            )
        return [train.index(uuid) for uuid in rollout]

    def _sync_ipc(self, bucket_bytes: int) -> int:
        """Bucket by bucket: every train rank packs CUDA IPC handles, the rollout workers load from their
        GPU's train rank; a bucket's memory is freed once they are done. Returns the bytes per rollout worker."""
        nbytes = 0
        self.train.start_ipc_export(bucket_bytes)
        while True:
            payloads = self.train.next_ipc_bucket()  # also drops the previous bucket, which every receiver has loaded
            if payloads[0] is None:
                break
            self.rollout.load_ipc_bucket([payloads[source] for source in self.ipc_sources])
            nbytes += payloads[0]["nbytes"]
        self.rollout.finish_weight_update()
        return nbytes

    def sync_weights(self, bucket_bytes: int) -> dict[str, float]:
        """Train rank 0's weights to every rollout worker, bucketed; colocated engines wake their weights first.
        Returns the bytes moved and the seconds it took."""
        import time

        start = time.perf_counter()
        if self.transport in ("nccl", "gloo"):  # the receive queues behind a generation still in flight
            from rlcore.workers import wait

            sent, _ = wait([self.train.send_weights(bucket_bytes), self.rollout.receive_weights()])
            nbytes = sent["weight_sync/bytes"]
        elif self.transport == "cuda_ipc":
            self._wake(["weights"])
            nbytes = self._sync_ipc(bucket_bytes)
        else:
            self._wake(["weights"])
            buckets = self.train.export_weights(bucket_bytes)
            self.rollout.update_weights(buckets)
            nbytes = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
        seconds = time.perf_counter() - start
        return {"weight_sync/seconds": seconds, "weight_sync/gb_per_s": nbytes / seconds / 1e9}

    def check_weight_sync(self, sequence: list[int]) -> float:
        """After a sync, the rollout engine must score `sequence` as the train engine does (top-k log-probs);
        a mismatch (a wrong name mapping, a lost bucket) stops the run with a clear error."""
        from rlcore.weight_sync import check_weight_sync

        self._wake(["kv_cache"])
        # the worker groups answer to the engines' method names, locally and on Ray
        return check_weight_sync(self.train, self.rollout, sequence)

    def _sleep(self) -> None:
        """Colocated: the rollout engine frees the devices (sleep_level 0 keeps it resident)."""
        if self.colocated and self.config.sleep_level:
            self.rollout.sleep(self.config.sleep_level)
            self.awake.clear()

    def _wake(self, tags: list[str]) -> None:
        """Wake what is asleep of `tags`; waking twice is never asked of an engine."""
        missing = [t for t in tags if t not in self.awake]
        if self.colocated and self.config.sleep_level and missing:
            self.rollout.wake_up(missing)
        self.awake.update(missing)
