"""Replay a rollout engine's weight loader: trace its copies once per bucket layout, then copy directly.

vLLM loads a bucket of Hugging Face-named tensors through per-tensor Python weight loaders: names are
mapped, q/k/v and gate/up are fused into one parameter through `param.data.narrow(...).copy_(w)`,
tensor-parallel shards are `w.narrow(...)` views. That Python costs more than the copies themselves
(about 20 ms per sync for a 0.5B model), and a sync's buckets have the same layout (names, shapes,
strides, dtypes) every time. `ReplayLoader` runs the loader once per layout under a
`TorchFunctionMode` that records every `Tensor.copy_` (destination: a view of a parameter; source: a
view of one incoming tensor, as size, stride and offset relative to it) and every constant `fill_` /
`zero_` of a parameter (vLLM zeroes the embedding's vocabulary padding). Later buckets of that layout
replay the record: each source is rebuilt with `as_strided` on the new incoming tensor and all copies
run in one `torch._foreach_copy_`.

The one assumption: the loader writes the targets (the model's parameters and buffers) only through
Python-level `Tensor.copy_` from views of the incoming tensors, and constant fills; vLLM's dense-model
loaders do. Anything else seen while tracing (a copy from a tensor the loader computed, e.g. with
`.to()`, `.clone()` or `torch.cat`; a copy into a tensor that is not a target; `param[...] = w`,
`param.data = w` or another in-place op on a target or an incoming tensor; reading an incoming
tensor's values with `.item()`) marks the layout not replayable: its buckets always go through the
loader, and `why_not[layout]` says why.

The record holds views of the targets, so a target re-allocated after tracing would take the replayed
writes to its old memory: an engine that replaces its parameters must call `clear()` (with the new
targets). vLLM's sleep and wake (CuMemAllocator) keep the parameters' addresses and need no clear.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rlcore.runtime import copy_all

NamedTensors = list[tuple[str, torch.Tensor]]
# per tensor: name, shape, stride, dtype, device type
Layout = tuple[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype, str], ...]
StorageKey = tuple[torch.device, int]

# In-place ops (by name) that write no tensor data.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "record_stream"})
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})
# Ops that read a tensor's values into Python, which can steer the loader or become a constant.
_READS = frozenset({"item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__"})


def layout(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Layout:
    """A bucket's layout: what a replay depends on, per tensor (name, shape, stride, dtype, device type)."""
    return tuple((name, tuple(t.shape), t.stride(), t.dtype, t.device.type) for name, t in named_tensors)


def _storage(t: torch.Tensor) -> StorageKey:
    return t.device, t.untyped_storage().data_ptr()


def _storages(targets: Iterable[torch.Tensor]) -> frozenset[StorageKey]:
    return frozenset(_storage(t) for t in targets if t.untyped_storage().nbytes())


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes from `t`'s first element to just past its last one."""
    elements = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + elements * t.element_size()


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} tensor on {t.device}"


@dataclass(frozen=True)
class _Copy:
    """dst.copy_(incoming[index].as_strided(size, stride, incoming[index].storage_offset() + offset))."""

    dst: torch.Tensor
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Fill:
    dst: torch.Tensor
    value: int | float | bool


def _batches(steps: list[_Copy | _Fill]) -> list[list[_Copy] | _Fill]:
    """Runs of copies with disjoint destinations, one `_foreach_copy_` each, and the fills between them, in order."""
    out: list[list[_Copy] | _Fill] = []
    written: dict[StorageKey, list[tuple[int, int]]] = {}  # the current run's destinations
    for step in steps:
        if isinstance(step, _Fill):
            out.append(step)
            written = {}
            continue
        start, end = _byte_range(step.dst)
        overlaps = any(s < end and start < e for s, e in written.get(_storage(step.dst), ()))
        if not out or isinstance(out[-1], _Fill) or overlaps:
            out.append([])
            written = {}
        out[-1].append(step)
        written.setdefault(_storage(step.dst), []).append((start, end))
    return out


class _Recorder(TorchFunctionMode):
    """Records a loader's copies into the targets, or the first reason they cannot be replayed."""

    def __init__(self, incoming: list[torch.Tensor], targets: frozenset[StorageKey]):
        super().__init__()
        self.incoming = incoming
        self.targets = targets
        self.steps: list[_Copy | _Fill] = []
        self.problem: str | None = None
        spans: dict[StorageKey, list[tuple[int, int, int]]] = {}
        for i, t in enumerate(incoming):
            if t.numel():
                spans.setdefault(_storage(t), []).append((*_byte_range(t), i))
        self.spans = {key: sorted(ranges) for key, ranges in spans.items()}
        self.starts = {key: [start for start, _, _ in ranges] for key, ranges in self.spans.items()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.problem is None:
            name = getattr(func, "__name__", "")
            if name == "__set__":  # an attribute's setter, named for its attribute: `t.data = x` is 'data ='
                name = f"{getattr(getattr(func, '__self__', None), '__name__', '')} ="
            try:
                self._inspect(name, args, kwargs)
            except Exception as e:  # e.g. a tensor without a storage: the layout is not replayable, the load goes on
                self.problem = f"could not follow {name} ({type(e).__name__}: {e})"
        return func(*args, **kwargs)

    def _inspect(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None:
            pass
        elif name == "copy_":
            self._copy(first, args[1] if len(args) > 1 else kwargs["src"])
        elif name in ("fill_", "zero_") and _storage(first) in self.targets:
            value = (args[1] if len(args) > 1 else kwargs["value"]) if name == "fill_" else 0
            if isinstance(value, torch.Tensor):
                self.problem = f"fill_ of a target {_describe(first)} with a tensor value"
            elif first.numel():
                self.steps.append(_Fill(first, value))
        elif name in _READS and self._source_of(first) is not None:
            self.problem = f"the loader read the values of an incoming {_describe(first)} with Tensor.{name}"
        elif name == "data =":
            self._check_write(first, "Tensor.data =")
        elif (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))) and name not in _NOT_WRITES:
            self._check_write(first, f"Tensor.{name}")
        out = kwargs.get("out")
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._check_write(t, f"out= of {name}")

    def _check_write(self, t: torch.Tensor, how: str) -> None:
        if not t.numel():
            return
        if _storage(t) in self.targets:
            self.problem = f"{how} wrote a target {_describe(t)}; only copy_ from an incoming tensor is replayed"
        elif self._source_of(t) is not None:
            self.problem = f"{how} wrote an incoming {_describe(t)}"

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not dst.numel():
            return
        if _storage(dst) not in self.targets:
            self.problem = f"copy_ into a {_describe(dst)} that is not a target (not among the parameters and buffers given)"
            return
        index = self._source_of(src) if isinstance(src, torch.Tensor) else None
        if index is None:
            self.problem = (
                f"copy_ from a {_describe(src) if isinstance(src, torch.Tensor) else type(src).__name__} that is not "
                "a view of an incoming tensor (the loader computed it, e.g. with .to(), .clone() or torch.cat)"
            )
            return
        base = self.incoming[index]
        if src.dtype != base.dtype:
            self.problem = f"copy_ from a {_describe(src)} that reinterprets an incoming {_describe(base)} with .view(dtype)"
            return
        offset = src.storage_offset() - base.storage_offset()
        self.steps.append(_Copy(dst, index, tuple(src.shape), src.stride(), offset))

    def _source_of(self, t: torch.Tensor) -> int | None:
        """The index of the incoming tensor whose bytes hold all of `t`'s, if any."""
        key = _storage(t)
        if key not in self.spans:
            return None
        start, end = _byte_range(t)
        ranges = self.spans[key]
        for j in range(bisect.bisect_right(self.starts[key], start) - 1, -1, -1):
            first, last, index = ranges[j]
            if end <= last:
                return index
        return None


class ReplayLoader:
    """`load(named_tensors)` for a rollout engine, replayed as one `_foreach_copy_` per bucket layout once traced.

    `load` is the engine's loader (e.g. vLLM's `model.load_weights`), `targets` the tensors it may write
    (the model's parameters and buffers). `replay=False` always calls `load`. Counters: `traced`,
    `replayed` and `fallback` (calls that ran `load` plainly); `why_not` maps each layout that cannot be
    replayed to the reason.
    """

    def __init__(self, load: Callable[[NamedTensors], Any], targets: Iterable[torch.Tensor], replay: bool = True):
        self.load = load
        self.replay = replay
        self.traced = self.replayed = self.fallback = 0
        self.why_not: dict[Layout, str] = {}
        self._plans: dict[Layout, list[list[_Copy] | _Fill]] = {}
        self._targets = _storages(targets)

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named_tensors)
        key = layout(named) if self.replay else None
        if key is None or key in self.why_not:
            self.fallback += 1
            self.load(named)
        elif key in self._plans:
            self._replay(self._plans[key], [t for _, t in named])
            self.replayed += 1
        else:
            self._trace(key, named)
            self.traced += 1

    def clear(self, targets: Iterable[torch.Tensor] | None = None) -> None:
        """Forget every trace (and, given `targets`, use those from now on): call it when the parameters are replaced."""
        self._plans.clear()
        self.why_not.clear()
        if targets is not None:
            self._targets = _storages(targets)

    def stats(self) -> dict[str, int]:
        """The counters, and how many layouts replay (`layouts`) or do not (`not_replayable`)."""
        return {
            "traced": self.traced, "replayed": self.replayed, "fallback": self.fallback,
            "layouts": len(self._plans), "not_replayable": len(self.why_not),
        }

    def _trace(self, key: Layout, named: NamedTensors) -> None:
        recorder = _Recorder([t for _, t in named], self._targets)
        with recorder:
            self.load(named)
        if recorder.problem is None:
            self._plans[key] = _batches(recorder.steps)
        else:
            first = f" from '{named[0][0]}'" if named else ""
            self.why_not[key] = f"bucket of {len(named)} tensors{first}: {recorder.problem}"

    @staticmethod
    def _replay(plan: list[list[_Copy] | _Fill], incoming: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for batch in plan:
                if isinstance(batch, _Fill):
                    batch.dst.fill_(batch.value)
                    continue
                srcs = [
                    incoming[c.index].as_strided(c.size, c.stride, incoming[c.index].storage_offset() + c.offset) for c in batch
                ]
                copy_all([c.dst for c in batch], srcs)
