"""Weight sync train -> rollout, engine-agnostic: buckets, flat buffers and three transports.

A sync walks the train engine's `export_weights` buckets (Hugging Face names, default 512 MB each) and
hands each one to the rollout engine's `update_weights`, then calls `finish_weight_update` once:
- in process: the rollout engine lives in the train worker's process; tensors are handed over directly;
- CUDA IPC: colocated actors on one GPU; the sender packs a bucket into one of two flat buffers it keeps
  from sync to sync and passes the buffer's handle, which each receiver maps once and keeps;
- broadcast: a separate rollout group on other GPUs; the train group's rank 0 broadcasts each flat
  bucket over its own NCCL (or, on the CPU, gloo) process group, independent of torch.distributed's
  default group (vLLM and DDP each own one in the same processes). Bucket metadata travels through
  the group's TCP store.

A flat bucket is one contiguous uint8 buffer holding every tensor of the bucket at an aligned byte offset,
plus metadata (names, shapes, dtypes, offsets): one transfer per bucket, whatever its dtypes. Both ends
keep two such buffers (slots) from sync to sync, so packing bucket i+1 overlaps sending bucket i, and
nothing is allocated or mapped again after the first sync. This module imports torch; `import rlcore`
does not import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..batch import Batch
from ..errors import ConfigError, RlcoreError
from .rendezvous import tcp_store

# One bucket of weights: (Hugging Face name, tensor) pairs, as the engines export and load them. Engines are
# duck-typed here (`export_weights`, `update_weights`, ...): the engine interfaces sit above the runtime.
NamedTensors = list[tuple[str, torch.Tensor]]

DEFAULT_BUCKET_BYTES = 512 << 20
ALIGN = 256  # byte alignment of every tensor in a flat buffer (any dtype's view of it is aligned)
SLOTS = 2  # flat buffers per end: one being sent or loaded while the next is packed


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RlcoreError(f"weight sync: unknown dtype '{name}' in bucket metadata")
    return dtype


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in its bucket's flat buffer (`offset` and `nbytes` count bytes)."""

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

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype(self.dtype).itemsize


@dataclass
class FlatBucket:
    """A bucket as one contiguous uint8 buffer (`buffer`, at least `size` bytes; None: metadata only)."""

    metas: list[TensorMeta]
    size: int
    buffer: torch.Tensor | None = None

    def to_json(self, **extra: Any) -> str:
        """The metadata (no tensor data), for a side channel; `extra` keys are added."""
        return json.dumps({"tensors": [[m.name, list(m.shape), m.dtype, m.offset] for m in self.metas],
                           "size": self.size, **extra})

    @staticmethod
    def from_json(text: str, device: torch.device | str | None = "cpu") -> FlatBucket:
        """Metadata from `to_json` with a new buffer on `device` (None: no buffer)."""
        data = json.loads(text)
        metas = [TensorMeta(name, tuple(shape), dtype, offset) for name, shape, dtype, offset in data["tensors"]]
        size = int(data["size"])
        if device is None:
            return FlatBucket(metas, size)
        return FlatBucket(metas, size, torch.empty(size, dtype=torch.uint8, device=device))

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (`size` adds the alignment padding)."""
        return sum(m.nbytes for m in self.metas)


def bucket_layout(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """Each tensor's place in a flat buffer (offsets aligned to ALIGN bytes) and the buffer's size."""
    metas: list[TensorMeta] = []
    size = 0
    for name, tensor in named_tensors:
        metas.append(TensorMeta(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), size))
        size += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return metas, size


def unflatten_bucket(bucket: FlatBucket) -> NamedTensors:
    """The bucket's tensors, in the order they were flattened, as views into its buffer."""
    buf = bucket.buffer
    if buf is None:
        raise RlcoreError("weight sync: this bucket has metadata only, no buffer to read")
    return [(m.name, buf[m.offset : m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)) for m in bucket.metas]


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dsts[i].copy_(srcs[i]) for every i, as one batched copy where torch can (`_foreach_copy_`)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(dsts, srcs)
            return
        except (RuntimeError, TypeError):  # a torch whose fused copy refuses mixed dtypes or devices
            pass
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def flatten_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | str | None = None) -> FlatBucket:
    """Copy a bucket's tensors into a new flat buffer on `device` (default: the first tensor's), in one
    batched copy on the GPU; `SlotPacker` keeps buffers and views from sync to sync."""
    items = list(named_tensors)
    metas, size = bucket_layout(items)
    if device is None:
        device = items[0][1].device if items else "cpu"
    bucket = FlatBucket(metas, size, torch.empty(size, dtype=torch.uint8, device=device))
    copy_all([view for _, view in unflatten_bucket(bucket)], [tensor.detach() for _, tensor in items])
    return bucket


class SlotPacker:
    """Packs buckets into SLOTS kept flat buffers, in turn (bucket i into slot i % SLOTS); a receiver takes
    its buffers from `slot` alone.

    A sync's buckets have the same layouts every time, so the packer keeps bucket i's layout: its metadata
    text and its views of the slot's buffer are made once, and a later sync's bucket costs one batched copy.
    A slot's buffer is replaced only by a larger bucket (`versions[slot]` then counts up).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * SLOTS
        self.versions = [0] * SLOTS
        self._layouts: dict[int, Any] = {}  # bucket index -> (signature, bucket, metadata texts, views)

    def pack(self, index: int, named_tensors: Iterable[tuple[str, torch.Tensor]], **extra: Any) -> tuple[FlatBucket, str]:
        """Copy bucket `index` of a sync into slot `index % SLOTS`; returns it (its buffer is the whole slot,
        `size` the bytes used) and its metadata text with `extra` keys."""
        items = list(named_tensors)
        slot = index % SLOTS
        signature = tuple((name, tuple(t.shape), t.dtype) for name, t in items)
        known = self._layouts.get(index)
        if known is None or known[0] != signature or known[1].buffer is not self.buffers[slot]:
            metas, size = bucket_layout(items)
            bucket = FlatBucket(metas, size, self.slot(index, size, items[0][1].device if items else "cpu"))
            known = self._layouts[index] = (signature, bucket, {}, [view for _, view in unflatten_bucket(bucket)])
        _, bucket, texts, views = known
        copy_all(views, [tensor.detach() for _, tensor in items])
        key = tuple(sorted(extra.items()))
        if key not in texts:
            texts[key] = bucket.to_json(**extra)
        return bucket, texts[key]

    def slot(self, index: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Slot `index % SLOTS`'s buffer, replaced by a new one (`versions` counts up) when it holds fewer
        than `size` bytes; on the packer's device, else `device`."""
        slot, buffer = index % SLOTS, self.buffers[index % SLOTS]
        if buffer is None or buffer.numel() < size:
            device = self.device if self.device is not None else device
            buffer = torch.empty(size, dtype=torch.uint8, device=device if device is not None else "cpu")
            self.buffers[slot], self.versions[slot] = buffer, self.versions[slot] + 1
        return buffer

    def close(self) -> None:
        self.buffers = [None] * SLOTS
        self._layouts.clear()


class ViewCache:
    """A receiver's views of a kept buffer for bucket i of a sync, made once and kept while the buffer and
    the metadata stay the same."""

    def __init__(self) -> None:
        self._views: dict[Any, tuple[Any, NamedTensors]] = {}

    def views(self, index: Any, buffer: torch.Tensor, text: str, layout: FlatBucket | None = None) -> NamedTensors:
        key = (buffer.data_ptr(), buffer.numel(), text)
        known = self._views.get(index)
        if known is None or known[0] != key:
            metas = layout if layout is not None else FlatBucket.from_json(text, device=None)
            known = self._views[index] = (key, unflatten_bucket(FlatBucket(metas.metas, metas.size, buffer)))
        return list(known[1])

    def forget(self, slot: Any) -> None:
        """Drop the views of a buffer that was replaced (keys `(slot, index)`), so they stop holding it."""
        self._views = {k: v for k, v in self._views.items() if not (isinstance(k, tuple) and k[0] == slot)}

    def clear(self) -> None:
        self._views.clear()


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


def sync_in_process(train_engine: Any, rollout_engine: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
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


def gpu_uuid(device: torch.device | int | None = None) -> str:
    """The physical GPU of `device` (default: this process's current one); indices differ between
    processes, UUIDs do not."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).uuid)


def _device_index(gpu: str) -> int:
    """This process's index of the GPU whose UUID is `gpu`."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == gpu:
            return index
    raise RlcoreError(
        f"CUDA IPC weight sync: the sender's GPU {gpu} is not visible in this process (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); colocate sender and receiver on the same GPUs"
    )


class CudaIpcSender:
    """Packs buckets into two flat CUDA buffers it keeps (used in turn) and hands out their IPC handles.

    A receiver maps a buffer once and keeps the mapping (`IpcReceiver`), so from the second sync on a
    bucket costs one batched copy on each side. Packing bucket i+2 reuses bucket i's buffer: the caller
    must have seen bucket i loaded before it packs bucket i+2. The buffers (2 x the largest bucket) stay
    on the GPU until `close()`.
    """

    def __init__(self) -> None:
        self._id = uuid.uuid4().hex
        self._packer = SlotPacker()
        self._handles: dict[int, Any] = {}  # slot -> (version, IPC handle, GPU): sharing a buffer costs an event
        self._next = 0

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """A picklable payload for `IpcReceiver.receive`: the bucket's metadata and its buffer's handle."""
        from torch.multiprocessing.reductions import reduce_tensor

        items = list(named_tensors)
        for name, tensor in items:
            if tensor.device.type != "cuda":
                raise RlcoreError(f"CUDA IPC weight sync needs CUDA tensors; {name} is on {tensor.device}")
        index, slot = self._next, self._next % SLOTS
        self._next += 1
        bucket, meta = self._packer.pack(index, items)
        version = self._packer.versions[slot]
        if self._handles.get(slot, (None,))[0] != version:
            self._handles[slot] = (version, reduce_tensor(bucket.buffer), gpu_uuid(bucket.buffer.device))
        torch.cuda.current_stream().synchronize()  # the copies are done before another process reads them
        _, handle, gpu = self._handles[slot]
        return {"meta": meta, "key": f"{self._id}/{slot}/{version}", "slot": f"{self._id}/{slot}", "index": index,
                "gpu": gpu, "handle": handle, "nbytes": bucket.nbytes}

    def start(self) -> None:
        """Begin a sync at the first slot (each sync then packs into the same buffers in the same order)."""
        self._next = 0

    def close(self) -> None:
        """Free the buffers (receivers must have dropped their mappings first: `IpcReceiver.close`)."""
        self._packer.close()
        self._handles.clear()


class IpcReceiver:
    """Maps the buffers of a `CudaIpcSender` on the same GPU, once each, and reads buckets out of them."""

    def __init__(self) -> None:
        self._mapped: dict[str, tuple[str, torch.Tensor]] = {}  # sender slot -> (key, mapped buffer)
        self._views = ViewCache()

    def receive(self, payload: dict[str, Any]) -> NamedTensors:
        """The bucket's tensors, as views of the sender's buffer (valid until the sender packs that slot again).

        The handle's device index is the sender's; it is replaced with this process's index of the same
        physical GPU (found by UUID). That is the current device when both share a GPU (a Ray session pairs
        them so); another visible GPU is mapped over peer access (a tensor-parallel vLLM worker on the next
        GPU of a one-process run), and the load then copies across the link.
        """
        slot, key = payload["slot"], payload["key"]
        known = self._mapped.get(slot)
        if known is None or known[0] != key:
            rebuild, args = payload["handle"]
            args = list(args)
            args[_IPC_DEVICE_ARG] = _device_index(payload["gpu"])
            self._views.forget(slot)  # views of the sender's old buffer would keep it mapped
            self._mapped[slot] = (key, rebuild(*args))
        return self._views.views((payload["slot"], payload["index"]), self._mapped[slot][1], payload["meta"])

    def load(self, payload: dict[str, Any], load: Callable[[NamedTensors], Any]) -> None:
        """Hand the bucket to `load` (an engine's loader) and return once the copies are done: the sender
        may refill its buffer after that."""
        load(self.receive(payload))
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self._mapped.clear()
        self._views.clear()


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

    Both ends keep two flat buffers and pipeline: the sender packs bucket i+1 while bucket i is on the
    wire, a receiver has bucket i+1 on the wire while it loads bucket i. On NCCL nothing blocks the host
    but the wait for a sync's last bucket (bounded by `timeout_s`); the buffers' reuse is ordered on the
    GPU streams.
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
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
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
        self._buffers = SlotPacker(self.device)  # the sender packs into them, a receiver receives into them
        self._layouts: dict[str, tuple[FlatBucket, bool]] = {}  # a receiver's parsed metadata, by its text
        self._views = ViewCache()

    def _key(self, sync: int, index: int) -> str:
        return f"rlcore/weight_sync/meta/{sync}/{index}"

    def _broadcast(self, buf: torch.Tensor) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self._pg.broadcast([buf], opts)

    def _finish(self, work: Any) -> None:
        """Wait for a sync's last transfer (the ones before it are done then: one stream, in order)."""
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise RlcoreError(
                f"weight sync: rank {self.rank}'s broadcast did not finish within {self.timeout.total_seconds():.0f}s "
                f"(sync {self._sync}); a member of the group stopped taking part: {e}"
            ) from e

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
        works: list[Any] = [None] * SLOTS
        while current is not None:
            with _timed(phases, "export"):
                following = next(it, None)
            with _timed(phases, "pack"):
                if works[count % SLOTS] is not None:  # the slot's last broadcast is done before it is refilled
                    works[count % SLOTS].wait()
                bucket, meta = self._buffers.pack(count, current, last=following is None)
            with _timed(phases, "send"):
                self._store.set(self._key(self._sync, count), meta)
                works[count % SLOTS] = self._broadcast(bucket.buffer[: bucket.size])
            count, nbytes, current = count + 1, nbytes + bucket.nbytes, following
        with _timed(phases, "send"):
            self._finish(works[(count - 1) % SLOTS])
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
        with _timed(phases, "load"):
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        return {f"weight_sync/{phase}_s": seconds for phase, seconds in phases.items()}

    def _layout(self, index: int) -> tuple[FlatBucket, bool, str]:
        """Bucket `index` of this sync's metadata (waiting for rank 0 to post it) and whether it is the last."""
        key = self._key(self._sync, index)
        try:
            text = self._store.get(key).decode()
        except RuntimeError as e:  # the store's timeout (DistStoreError is a RuntimeError)
            raise RlcoreError(
                f"weight sync: rank {self.rank} waited {self.timeout.total_seconds():.0f}s for bucket {index} of sync "
                f"{self._sync} from rank 0, which did not send it: {e}"
            ) from e
        known = self._layouts.get(text)
        if known is None:  # parsed once: the layouts repeat from sync to sync
            known = self._layouts[text] = (FlatBucket.from_json(text, device=None), bool(json.loads(text)["last"]))
        return known + (text,)

    def receive(self) -> Iterator[NamedTensors]:
        """Yield the buckets of one sync as views on this member's device (ranks 1.. only).

        A bucket's tensors are views of a buffer that the bucket after the next one reuses: load or copy
        them before asking for the next bucket.
        """
        if self.rank == 0:
            raise RlcoreError("weight sync: rank 0 sends; receive is for ranks 1..world_size-1")
        index = 0
        layout, last, text = self._layout(0)
        buf = self._buffers.slot(0, layout.size)[: layout.size]
        work = self._broadcast(buf)
        while True:
            if not last:  # the next bucket goes on the wire while this one is loaded
                next_layout, next_last, next_text = self._layout(index + 1)
                next_buf = self._buffers.slot(index + 1, next_layout.size)[: next_layout.size]
                next_work = self._broadcast(next_buf)
            if last:
                self._finish(work)
            else:
                work.wait()  # NCCL: the loads queue behind the transfer on the GPU; gloo: the data is here
            yield self._views.views(index, buf, text, layout)
            if last:
                break
            index, layout, last, text, buf, work = index + 1, next_layout, next_last, next_text, next_buf, next_work
        self._sync += 1


# -------------------------------------------------------------------------
# the check after a sync
# -------------------------------------------------------------------------


def check_weight_sync(
    train_engine: Any, rollout_engine: Any, sequence: list[int], atol: float = 0.5, k: int = 4
) -> float:
    """Assert that both engines give the same top-k log-probs for `sequence`; return the largest difference.

    A cheap check a trainer runs after its first sync: a wrong weight name mapping, a missed tied
    embedding or a bucket that never arrived shows up as differences of whole units, far above bf16's (a few hundredths to tenths).
    Values are compared sorted, so near-ties that swap order in bf16 do not count as mismatches.
    """
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
