"""Weight sync train -> rollout, engine-agnostic: buckets, flat buffers and three transports.

A sync walks the train engine's `export_weights` buckets (Hugging Face names, default 512 MB each) and
hands each one to the rollout engine's `update_weights`, then calls `finish_weight_update` once:
- in process: the rollout engine lives in the train worker's process; tensors are handed over directly;
- CUDA IPC: colocated actors on one GPU; the sender flattens a bucket and passes handles, not bytes;
- broadcast: a separate rollout group on other GPUs; the train group's rank 0 broadcasts each flat
  bucket over its own NCCL (or, on the CPU, gloo) process group, independent of torch.distributed's
  default group (vLLM and DDP each own one in the same processes). Bucket metadata travels through
  the group's TCP store.

A flat bucket is one contiguous 1-D buffer per dtype plus metadata (names, shapes, dtypes, offsets):
one transfer per dtype instead of one per tensor. This module imports torch; `import rlcore` does not
import it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .cluster import tcp_store
from .errors import ConfigError, RlcoreError

if TYPE_CHECKING:
    from .engines import NamedTensors, RolloutEngine, TrainEngine

DEFAULT_BUCKET_BYTES = 512 << 20


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RlcoreError(f"weight sync: unknown dtype '{name}' in bucket metadata")
    return dtype


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in its dtype's flat buffer (`offset` and `numel` count elements)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class FlatBucket:
    """A bucket as one contiguous 1-D buffer per dtype (`buffers`, keyed by dtype name) and its metadata."""

    metas: list[TensorMeta]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_json(self) -> str:
        """The metadata (no tensor data), for a side channel."""
        sizes = {name: int(buf.numel()) for name, buf in self.buffers.items()}
        return json.dumps({"tensors": [[m.name, list(m.shape), m.dtype, m.offset] for m in self.metas], "sizes": sizes})

    @staticmethod
    def from_json(text: str, device: torch.device | str | None = "cpu") -> FlatBucket:
        """Metadata from `to_json`, with empty buffers of the right sizes on `device` (None: no buffers)."""
        data = json.loads(text)
        metas = [TensorMeta(name, tuple(shape), dtype, offset) for name, shape, dtype, offset in data["tensors"]]
        if device is None:
            return FlatBucket(metas)
        buffers = {name: torch.empty(n, dtype=_dtype(name), device=device) for name, n in data["sizes"].items()}
        return FlatBucket(metas, buffers)

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.buffers.values())


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[NamedTensors]:
    """Cut a stream of named tensors into buckets of at most `bucket_bytes` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be positive, got {bucket_bytes}; the default is {DEFAULT_BUCKET_BYTES} (512 MB)")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def flatten_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | str | None = None) -> FlatBucket:
    """Copy a bucket's tensors into one contiguous buffer per dtype, on `device` (default: the first tensor's)."""
    items = list(named_tensors)
    metas: list[TensorMeta] = []
    sizes: dict[str, int] = {}
    for name, tensor in items:
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        metas.append(TensorMeta(name, tuple(tensor.shape), dtype_name, sizes.get(dtype_name, 0)))
        sizes[dtype_name] = sizes.get(dtype_name, 0) + tensor.numel()
    target = device if device is not None else (items[0][1].device if items else "cpu")
    buffers = {name: torch.empty(n, dtype=_dtype(name), device=target) for name, n in sizes.items()}
    for meta, (_, tensor) in zip(metas, items):
        buffers[meta.dtype][meta.offset : meta.offset + meta.numel].copy_(tensor.detach().reshape(-1))
    return FlatBucket(metas, buffers)


def unflatten_bucket(bucket: FlatBucket) -> NamedTensors:
    """The bucket's tensors, in the order they were flattened, as views into its buffers."""
    out: NamedTensors = []
    for meta in bucket.metas:
        buf = bucket.buffers[meta.dtype]
        out.append((meta.name, buf[meta.offset : meta.offset + meta.numel].view(meta.shape)))
    return out


def sync_in_process(train_engine: TrainEngine, rollout_engine: RolloutEngine, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Hand the train engine's weights to a rollout engine of the same process, bucket by bucket."""
    start, buckets, nbytes = time.perf_counter(), 0, 0
    for bucket in train_engine.export_weights(bucket_bytes):
        rollout_engine.update_weights(bucket)
        buckets += 1
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    rollout_engine.finish_weight_update()
    return {"weight_sync/buckets": buckets, "weight_sync/bytes": nbytes, "weight_sync/seconds": time.perf_counter() - start}


# -------------------------------------------------------------------------
# CUDA IPC: colocated actors sharing one GPU
# -------------------------------------------------------------------------

_IPC_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments


class CudaIpcSender:
    """Turns buckets into CUDA IPC handles; keeps the flat buffers alive until `release()`.

    The receiver maps the sender's memory, so the sender must not free a bucket before the receiver has
    loaded it: call `release()` once the receiver returned (or before packing the next sync).
    """

    def __init__(self) -> None:
        self._alive: list[FlatBucket] = []

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """A picklable payload for `receive_ipc`: the bucket's metadata and one handle per dtype buffer."""
        from torch.multiprocessing.reductions import reduce_tensor

        bucket = flatten_bucket(named_tensors)
        for name, buf in bucket.buffers.items():
            if buf.device.type != "cuda":
                raise RlcoreError(f"CUDA IPC weight sync needs CUDA tensors; the {name} buffer is on {buf.device}")
        torch.cuda.current_stream().synchronize()  # the copies into the buffers are done before anyone maps them
        self._alive.append(bucket)
        handles = {name: reduce_tensor(buf) for name, buf in bucket.buffers.items()}
        return {"meta": bucket.to_json(), "handles": handles, "nbytes": bucket.nbytes}

    def release(self) -> None:
        """Drop the buffers of every packed bucket (the receivers are done with them)."""
        self._alive.clear()


def receive_ipc(payload: dict[str, Any]) -> NamedTensors:
    """Rebuild a bucket packed by `CudaIpcSender.pack` in another process on the same GPU.

    The handle's device index is the sender's; it is replaced with this process's current device, which
    is the same physical GPU when both actors share one bundle.
    """
    device = torch.cuda.current_device()
    bucket = FlatBucket.from_json(payload["meta"], device=None)
    for name, (rebuild, args) in payload["handles"].items():
        args = list(args)
        args[_IPC_DEVICE_ARG] = device
        bucket.buffers[name] = rebuild(*args)
    return unflatten_bucket(bucket)


# -------------------------------------------------------------------------
# broadcast: train rank 0 -> a separate rollout group (NCCL; gloo on the CPU)
# -------------------------------------------------------------------------


@contextlib.contextmanager
def _timed(phases: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[phase] += time.perf_counter() - start


class BroadcastGroup:
    """A process group of its own between the sender (rank 0) and the receivers (ranks 1..world_size-1).

    Every member constructs it at about the same time (rank 0 hosts the TCP store at `host:port`); with
    Ray, start all members' constructors before waiting on any. Rank 0 calls `send`, the others
    `receive`, once per sync.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "nccl",
        device: torch.device | str | None = None,
        timeout_s: float = 600.0,
    ):
        if backend not in ("nccl", "gloo"):
            raise ConfigError(f"weight sync backend must be 'nccl' or 'gloo', got '{backend}'")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ConfigError(f"weight sync group: rank {rank} of world_size {world_size}; need world_size >= 2 and 0 <= rank < world_size")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device if device is not None else ("cuda" if backend == "nccl" else "cpu"))
        self.timeout = timedelta(seconds=timeout_s)
        try:
            self._store = tcp_store(host, port, world_size, rank == 0, self.timeout)
        except (RuntimeError, OSError) as e:
            raise RlcoreError(f"weight sync group: rank {rank} could not reach the store at {host}:{port} within {timeout_s:.0f}s: {e}") from e
        pg_store = dist.PrefixStore("rlcore/weight_sync/pg", self._store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(pg_store, rank, world_size, self.timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._pg = dist.ProcessGroupNCCL(pg_store, rank, world_size, options)
        self._sync = 0
        self._sent_buckets: dict[int, int] = {}  # sync number -> bucket count, until its keys are deleted

    def _key(self, sync: int, index: int) -> str:
        return f"rlcore/weight_sync/meta/{sync}/{index}"

    def _broadcast(self, buf: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._pg.broadcast([buf.view(torch.uint8)], opts).wait(self.timeout)

    def send(self, buckets: Iterable[NamedTensors]) -> dict[str, float]:
        """Broadcast every bucket to the receivers (rank 0 only); returns counts and seconds."""
        if self.rank != 0:
            raise RlcoreError(f"weight sync: send is rank 0's; this is rank {self.rank} (call receive)")
        start, count, nbytes = time.perf_counter(), 0, 0
        phases = dict.fromkeys(("export", "pack", "send"), 0.0)  # seconds in the engine's export, flattening, sending
        # Every receiver has read sync n-2's metadata before it joined sync n-1's last broadcast.
        for index in range(self._sent_buckets.pop(self._sync - 2, 0)):
            self._store.delete_key(self._key(self._sync - 2, index))
        it = iter(buckets)
        with _timed(phases, "export"):
            current = next(it, None)
        if current is None:
            raise RlcoreError("weight sync: the train engine exported no weights")
        while current is not None:
            with _timed(phases, "export"):
                following = next(it, None)
            with _timed(phases, "pack"):
                bucket = flatten_bucket(current, device=self.device)
            with _timed(phases, "send"):
                meta = json.loads(bucket.to_json())
                meta["last"] = following is None
                self._store.set(self._key(self._sync, count), json.dumps(meta))
                for buf in bucket.buffers.values():
                    self._broadcast(buf)
            count, nbytes, current = count + 1, nbytes + bucket.nbytes, following
        with _timed(phases, "send"):
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        self._sent_buckets[self._sync] = count
        self._sync += 1
        return {"weight_sync/buckets": count, "weight_sync/bytes": nbytes, "weight_sync/seconds": time.perf_counter() - start,
                **{f"weight_sync/{phase}_s": seconds for phase, seconds in phases.items()}}

    def receive_into(self, load: Callable[[NamedTensors], None]) -> dict[str, float]:
        """Receive one sync, handing each bucket to `load` (an engine's `update_weights`); returns the
        receiver's seconds waiting for and receiving buckets (`recv_s`) and loading them (`load_s`)."""
        phases = dict.fromkeys(("recv", "load"), 0.0)
        buckets = self.receive()
        while True:
            with _timed(phases, "recv"):
                bucket = next(buckets, None)
            if bucket is None:
                break
            with _timed(phases, "load"):
                load(bucket)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
        return {f"weight_sync/{phase}_s": seconds for phase, seconds in phases.items()}

    def receive(self) -> Iterator[NamedTensors]:
        """Yield the buckets of one sync as tensors on this member's device (ranks 1.. only)."""
        if self.rank == 0:
            raise RlcoreError("weight sync: rank 0 sends; receive is for ranks 1..world_size-1")
        index = 0
        while True:
            key = self._key(self._sync, index)
            try:
                text = self._store.get(key).decode()
            except RuntimeError as e:  # the store's timeout (DistStoreError is a RuntimeError)
                raise RlcoreError(
                    f"weight sync: rank {self.rank} waited {self.timeout.total_seconds():.0f}s for bucket {index} of sync "
                    f"{self._sync} from rank 0, which did not send it: {e}"
                ) from e
            meta = json.loads(text)
            bucket = FlatBucket.from_json(text, device=self.device)
            for buf in bucket.buffers.values():
                self._broadcast(buf)
            yield unflatten_bucket(bucket)
            index += 1
            if meta["last"]:
                break
        self._sync += 1


# -------------------------------------------------------------------------
# the check after a sync
# -------------------------------------------------------------------------


def check_weight_sync(
    train_engine: TrainEngine, rollout_engine: RolloutEngine, sequence: list[int], atol: float = 0.5, k: int = 4
) -> float:
    """Assert that both engines give the same top-k log-probs for `sequence`; return the largest difference.

    A cheap check a trainer runs after its first sync: a wrong weight name mapping, a missed tied
    embedding or a bucket that never arrived shows up as differences of whole units, far above bf16's (a few hundredths to tenths).
    Values are compared sorted, so near-ties that swap order in bf16 do not count as mismatches.
    """
    from .batch import Batch

    if len(sequence) < 2:
        raise ConfigError(f"check_weight_sync needs a sequence of at least 2 tokens, got {len(sequence)}")
    ids = torch.tensor([sequence], dtype=torch.long)
    ref = train_engine.forward_topk(Batch(input_ids=ids, attention_mask=torch.ones_like(ids)), k)
    want = ref.logprobs[0, 1 : len(sequence)].float().cpu().sort(dim=-1, descending=True).values
    got = rollout_engine.prompt_topk_logprobs([sequence], k).logprobs[0, 1 : len(sequence)]
    got = got.float().cpu().sort(dim=-1, descending=True).values
    if got.shape != want.shape:
        raise RlcoreError(f"check_weight_sync: rollout top-k has shape {tuple(got.shape)}, train top-k {tuple(want.shape)}")
    diff = float((got - want).abs().max())
    if diff > atol:
        raise RlcoreError(
            f"weight sync check failed: rollout and train top-{k} log-probs differ by up to {diff:.4f} (atol {atol}) "
            f"on a {len(sequence)}-token sequence; the rollout engine did not receive the trained weights "
            "(check the weight names the train engine exports and that every bucket arrived)"
        )
    return diff
