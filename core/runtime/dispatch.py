"""Dispatchers split one call's arguments over a group's workers; collectors join their results.

The built-ins (registered by the `builtins` plugin) follow ms-swift's RayHelper:

- dispatch `all`: every worker gets the same arguments;
- dispatch `slice`: list-like arguments (lists, `Batch`, tensors and arrays along dim 0) are cut into
  contiguous near-equal shards, other arguments are passed to every worker; a worker whose shard is
  empty is not called;
- dispatch `dp`: one shard per data-parallel rank, replicated over the tensor/pipeline ranks of that
  shard (see `Mesh` for the rank order); only the ranks that hold a shard's output are collected;
- dispatch `first`: rank 0 alone, with the arguments whole; its result through collect `first`;
- collect `none` (a list, one item per called worker), `flatten` (lists concatenated; tuples
  element-wise), `first`, `mean` (numbers, or dicts of numbers per key), `concat` (tensors along dim 0,
  `Batch.concat`).

A dispatch mode is one descriptor (`DispatcherSpec`, as verl's `register(dispatch_mode=...)` pairs a
dispatch with its collect): its split, the collect it pairs with (used where `@function` names none) and the
ranks whose results count (`collect_ranks`). A user may also pass a callable: a dispatcher
`(n, i, *args, **kwargs) -> (args, kwargs)` (ms-swift's form; return None to skip worker i) or a collector
`(results) -> value`. Names are resolved through the plugins the caller hands over (`resolve`), so a plugin's
`rlcore_dispatchers` / `rlcore_collectors` work by name.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..batch import Batch
from ..errors import NotRegistered, RlcoreError
from ..specs import CollectorSpec, DispatcherSpec

if TYPE_CHECKING:
    from ..manager import Plugins

Shard = tuple[tuple, dict]
Split = Callable[[int, tuple, dict, "Mesh"], list]
Collect = Callable[[list[Any]], Any]


@dataclass(frozen=True)
class Mesh:
    """A group's parallel layout: `dp * tp * pp` workers.

    Ranks are ordered data-parallel outermost, then pipeline, then tensor (tensor ranks adjacent, as
    they share a node in practice): `rank = dp_rank * (tp * pp) + pp_rank * tp + tp_rank`.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise RlcoreError(f"Mesh.{name} must be a positive int, got {value!r}")

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """`(dp_rank, pp_rank, tp_rank)` of a group rank."""
        dp_rank, rest = divmod(rank, self.tp * self.pp)
        pp_rank, tp_rank = divmod(rest, self.tp)
        return dp_rank, pp_rank, tp_rank

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.pp)


# -------------------------------------------------------------------------
# dispatchers
# -------------------------------------------------------------------------


def _sliceable(value: Any) -> bool:
    if isinstance(value, (list, Batch)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.dim() > 0
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray) and value.ndim > 0


def _shards(value: Any, n: int) -> list[Any]:
    """`n` contiguous near-equal shards (the first ones one row longer), as `Batch.split` cuts."""
    if isinstance(value, Batch):
        return value.split(n)
    size, extra = divmod(len(value), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        out.append(value[start:stop])
        start = stop
    return out


def _shard_arguments(n: int, args: tuple, kwargs: dict, dispatch: str) -> list[Shard | None]:
    """Cut every list-like argument into `n` shards; None for a shard index where all are empty."""
    lengths = {f"argument {i}": len(a) for i, a in enumerate(args) if _sliceable(a)}
    lengths.update({f"argument '{k}'": len(v) for k, v in kwargs.items() if _sliceable(v)})
    if not lengths:
        return [(args, kwargs)] * n
    if len(set(lengths.values())) > 1:
        found = ", ".join(f"{name} has {length}" for name, length in lengths.items())
        raise RlcoreError(
            f"dispatch '{dispatch}' cuts every list-like argument into shards, so they must have the same "
            f"length; {found}. Pass a constant list inside a tuple or dict to send it whole."
        )
    length = next(iter(lengths.values()))
    cut_args = [_shards(a, n) if _sliceable(a) else [a] * n for a in args]
    cut_kwargs = {k: _shards(v, n) if _sliceable(v) else [v] * n for k, v in kwargs.items()}
    size, extra = divmod(length, n)
    return [
        (tuple(c[i] for c in cut_args), {k: c[i] for k, c in cut_kwargs.items()})
        if size + (1 if i < extra else 0)
        else None
        for i in range(n)
    ]


def dispatch_all(n: int, args: tuple, kwargs: dict, mesh: Mesh | None = None) -> list[Shard | None]:
    """Every worker gets the same arguments."""
    return [(args, kwargs)] * n


def dispatch_slice(n: int, args: tuple, kwargs: dict, mesh: Mesh | None = None) -> list[Shard | None]:
    """List-like arguments in contiguous near-equal shards; a worker with an empty shard is skipped."""
    return _shard_arguments(n, args, kwargs, "slice")


def dispatch_dp(n: int, args: tuple, kwargs: dict, mesh: Mesh | None = None) -> list[Shard | None]:
    """One shard per data-parallel rank, the same shard for every tensor/pipeline rank of it.

    Only one result per shard is collected (the `dp` mode's `collect_ranks`), so results match a run without Ray.
    """
    mesh = mesh or Mesh(dp=n)
    if mesh.size != n:
        raise RlcoreError(
            f"dispatch 'dp' got a group of {n} workers but a mesh of {mesh.size} "
            f"(dp={mesh.dp}, tp={mesh.tp}, pp={mesh.pp}); give the runtime a Mesh whose dp*tp*pp is {n}"
        )
    per_dp = _shard_arguments(mesh.dp, args, kwargs, "dp")
    return [per_dp[mesh.dp_rank(rank)] for rank in range(n)]


def dp_output_ranks(n: int, mesh: Mesh | None) -> list[int]:
    """Tensor rank 0 of the last pipeline stage of each data-parallel rank: the ranks that hold outputs."""
    mesh = mesh or Mesh(dp=n)
    return [r for r in range(n) if mesh.coords(r)[1:] == (mesh.pp - 1, 0)]


def dispatch_first(n: int, args: tuple, kwargs: dict, mesh: Mesh | None = None) -> list[Shard | None]:
    """Rank 0 alone, with the arguments whole (a group's master: its address, its broadcast)."""
    return [(args, kwargs)] + [None] * (n - 1)


def from_callable(fn: Callable[..., Any]) -> Split:
    """Adapt ms-swift's per-worker form `fn(n, i, *args, **kwargs) -> (args, kwargs)` to a split."""
    name = getattr(fn, "__qualname__", repr(fn))

    def split(n: int, args: tuple, kwargs: dict, mesh: Mesh | None = None) -> list[Shard | None]:
        out: list[Shard | None] = []
        for i in range(n):
            result = fn(n, i, *args, **kwargs)
            if result is not None and not (
                isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)
            ):
                raise RlcoreError(
                    f"dispatch function {name} returned {type(result).__name__} for worker {i}; it must "
                    f"return (args, kwargs), e.g. ((shard,), {{}}), or None to skip the worker"
                )
            out.append(None if result is None else (tuple(result[0]), result[1]))
        return out

    return split


# -------------------------------------------------------------------------
# collectors
# -------------------------------------------------------------------------


def collect_none(results: list[Any]) -> list[Any]:
    """The results as they are: one item per called worker."""
    return list(results)


def collect_first(results: list[Any]) -> Any:
    """The first called worker's result (None when no worker was called)."""
    return results[0] if results else None


def collect_flatten(results: list[Any]) -> Any:
    """Concatenate the workers' lists; tuples (several return values) are flattened element-wise."""
    if results and all(isinstance(r, tuple) for r in results):
        width = {len(r) for r in results}
        if len(width) > 1:
            raise RlcoreError(f"collect 'flatten' got tuples of different lengths {sorted(width)}")
        return tuple(collect_flatten([r[j] for r in results]) for j in range(width.pop()))
    out: list[Any] = []
    for rank, result in enumerate(results):
        if isinstance(result, (str, bytes, Mapping)) or not hasattr(result, "__iter__"):
            raise RlcoreError(
                f"collect 'flatten' joins lists, but result {rank} is a {type(result).__name__}; "
                f"return a list, or use collect='none'"
            )
        out.extend(result)
    return out


def _mean(values: list[Any], what: str) -> float:
    for v in values:
        if not isinstance(v, numbers.Number) and not (hasattr(v, "item") and getattr(v, "ndim", 1) == 0):
            raise RlcoreError(f"collect 'mean' averages numbers, but {what} is a {type(v).__name__}")
    return sum(float(v) for v in values) / len(values)


def collect_mean(results: list[Any]) -> Any:
    """The average of numbers, or per key of dicts of numbers (a key counts where it is present)."""
    if not results:
        raise RlcoreError("collect 'mean' got no results: no worker was called")
    if all(isinstance(r, Mapping) for r in results):
        keys = list(dict.fromkeys(k for r in results for k in r))
        return {k: _mean([r[k] for r in results if k in r], f"key '{k}'") for k in keys}
    return _mean(results, "a result")


def collect_concat(results: list[Any]) -> Any:
    """Tensors joined along dim 0, or Batches joined with `Batch.concat`."""
    if not results:
        raise RlcoreError("collect 'concat' got no results: no worker was called")
    if all(isinstance(r, Batch) for r in results):
        return Batch.concat(results)
    torch = sys.modules.get("torch")
    if torch is not None and all(isinstance(r, torch.Tensor) for r in results):
        return torch.cat(results, dim=0)
    kinds = sorted({type(r).__name__ for r in results})
    raise RlcoreError(
        f"collect 'concat' joins torch tensors or Batches, got {', '.join(kinds)}; "
        f"use collect='flatten' for lists"
    )


DISPATCHERS = (
    DispatcherSpec("all", dispatch_all, "the same arguments to every worker"),
    DispatcherSpec("slice", dispatch_slice, "list-like arguments cut into contiguous near-equal shards"),
    DispatcherSpec("dp", dispatch_dp, "one shard per data-parallel rank, replicated over TP/PP ranks; the results "
                   "of the ranks holding outputs", collect_ranks=dp_output_ranks),
    DispatcherSpec("first", dispatch_first, "rank 0 alone, the arguments whole; its result", collect="first"),
)
COLLECTORS = (
    CollectorSpec("none", collect_none, "a list, one result per called worker"),
    CollectorSpec("flatten", collect_flatten, "lists concatenated; tuples element-wise"),
    CollectorSpec("first", collect_first, "the first called worker's result"),
    CollectorSpec("mean", collect_mean, "the mean of numbers, or of dicts of numbers per key"),
    CollectorSpec("concat", collect_concat, "tensors along dim 0, Batches with Batch.concat"),
)


# -------------------------------------------------------------------------
# resolution through the plugin registries
# -------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One `@function`'s dispatch mode, resolved: how its arguments split, how its results are collected, and
    which ranks' results count (None: every called rank)."""

    dispatch: str  # the dispatcher's name, for messages
    split: Split
    collect: Collect
    collect_ranks: Callable[[int, Mesh], list[int]] | None = None

    def kept(self, n: int, mesh: Mesh) -> set[int] | None:
        """The ranks of a group of `n` whose results are collected; None for all."""
        return None if self.collect_ranks is None else set(self.collect_ranks(n, mesh))


def resolve(dispatch: str | Callable[..., Any] | DispatcherSpec, collect: str | Collect | CollectorSpec | None,
            plugins: Plugins) -> Mode:
    """The mode of a call: `dispatch` (a registered name, a DispatcherSpec or an ms-swift style callable) and
    `collect` (one of the same kinds; None: the collect the dispatcher pairs with, else `none`), names looked
    up in `plugins`."""
    spec = resolve_dispatcher(dispatch, plugins)
    paired = collect if collect is not None else spec.collect if spec.collect is not None else "none"
    return Mode(spec.name, spec.split, resolve_collector(paired, plugins), spec.collect_ranks)


def resolve_dispatcher(dispatch: str | Callable[..., Any] | DispatcherSpec, plugins: Plugins) -> DispatcherSpec:
    """The descriptor of a registered name, a DispatcherSpec as it is, or one for an ms-swift style callable."""
    if isinstance(dispatch, DispatcherSpec):
        return dispatch
    if isinstance(dispatch, str):
        return plugins.dispatchers.get(dispatch)
    if callable(dispatch):
        return DispatcherSpec(getattr(dispatch, "__qualname__", repr(dispatch)), from_callable(dispatch))
    raise RlcoreError(f"dispatch must be a registered name or a callable, got {dispatch!r}")


def resolve_collector(collect: str | Collect | CollectorSpec, plugins: Plugins) -> Collect:
    """A collect function for a registered name, a CollectorSpec or a callable over the results."""
    if isinstance(collect, CollectorSpec):
        return collect.collect
    if isinstance(collect, str):
        return plugins.collectors.get(collect).collect
    if callable(collect):
        return collect
    raise RlcoreError(f"collect must be a registered name or a callable, got {collect!r}")


@dataclass(frozen=True)
class FunctionSpec:
    """What `@function` recorded about one method: its group, its dispatch mode and collect (names resolve
    with the plugins of the runtime the worker runs in, when its group is made), and whether it blocks."""

    name: str
    group: str | None
    dispatch: Any
    collect: Any  # None: the collect the dispatch mode pairs with
    blocking: bool

    def mode(self, plugins: Plugins, owner: str = "") -> Mode:
        """The resolved dispatch mode; an unknown name is an error naming `owner.function()` and the known names."""
        try:
            return resolve(self.dispatch, self.collect, plugins)
        except NotRegistered as exc:
            raise NotRegistered(f"{owner}.{self.name}(): {exc}" if owner else str(exc)) from None
