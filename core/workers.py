"""Roles as decorated classes: `@worker(group=...)` and `@function(group, dispatch, execute, collect)`.

The semantics are ms-swift's RayHelper. The same class runs three ways:

- no runtime, or `runtime(use_ray=False)`: each group is one in-process worker. The class is built
  normally and a `@function` call still goes through dispatch, execute and collect with one worker, so
  results keep their Ray shapes (`collect="none"` gives a list of one).
- `runtime(slots, use_ray=True)` on the driver: building the class starts, for each of its groups, one
  actor per `Slot` of that role, each holding a real instance built with the same arguments. The driver
  object still runs `__init__` (so plain attributes such as a dataset exist there), but the `@function`
  calls made while it does are skipped: the actors ran them while building their own instances. After
  that, a `@function` call dispatches to its group's actors; methods without `@function` run on the
  driver.
- inside an actor: a `@function` of the actor's own group runs locally and returns its plain result;
  one of another group is an error naming both groups, except while the actor's `__init__` runs, where
  it is skipped. So a class whose `__init__` prepares the models of two groups builds each model only
  in that group's actors.

Each actor sees RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT of its
group before `__init__` runs, so `torch.distributed.init_process_group()` forms one world per group.

Tensors travel as numpy buffers, which Ray reads without copying; an argument every worker receives
(`dispatch="all"`, or a `dp` shard shared by tensor ranks) goes into the object store once. A worker
must treat a tensor argument as read-only (`.clone()` it before writing in place): the workers of a node
share its memory.
"""

from __future__ import annotations

import collections
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .cluster import decode, encode
from .dispatch import Collect, Mesh, Split, resolve_collector, resolve_dispatcher
from .errors import ConfigError, ResourceError, RlcoreError, RoleFailed
from .specs import Slot

# Wrappers read the mode through the module (`_here._actor`), never as their own globals: cloudpickle
# copies a wrapper of a class defined in __main__ by value, globals included, into every actor.
_here = sys.modules[__name__]
_REMOTE = "_rlcore_remote"  # instance attribute on the driver: {group: _RemoteGroup}
_CONSTRUCTING = "_rlcore_constructing"  # instance attribute: True while __init__ runs
EXECUTE = ("all", "first")


# -------------------------------------------------------------------------
# decorators
# -------------------------------------------------------------------------


@dataclass
class FunctionSpec:
    """What `@function` recorded about one method; the named dispatcher/collector resolve on first use."""

    name: str
    group: str
    dispatch: Any
    execute: str
    collect: Any
    blocking: bool
    _split: Split | None = field(default=None, repr=False)
    _collect: Collect | None = field(default=None, repr=False)

    def resolve(self) -> None:
        if self._split is None:
            self._split = resolve_dispatcher(self.dispatch)
            self._collect = resolve_collector(self.collect)


def function(
    group: str,
    dispatch: str | Callable[..., Any] = "all",
    execute: str = "all",
    collect: str | Callable[[list[Any]], Any] = "none",
    blocking: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method as served by `group`'s workers; see the module docstring for the three modes.

    `execute="first"` calls rank 0 only, with the arguments unsplit. `blocking=False` returns a
    `Handle`; its `.get()` waits for the collected result.
    """
    if not isinstance(group, str) or not group:
        raise ConfigError(f"@function(group=...) must be a non-empty string, got {group!r}")
    if execute not in EXECUTE:
        raise ConfigError(f"@function(execute={execute!r}) is not supported; use 'all' or 'first'")
    for key, value in (("dispatch", dispatch), ("collect", collect)):
        if not (isinstance(value, str) or callable(value)):
            raise ConfigError(f"@function({key}=...) must be a registered name or a callable, got {value!r}")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        spec = FunctionSpec(func.__name__, group, dispatch, execute, collect, bool(blocking))

        @functools.wraps(func)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            state = self.__dict__
            remote = state.get(_REMOTE)
            if remote is not None:  # the driver, with Ray
                if state.get(_CONSTRUCTING):
                    return None
                return remote[group].call(spec, args, kwargs)
            actor = _here._actor
            if actor is not None:  # inside an actor
                if group == actor.group:
                    return func(self, *args, **kwargs)
                if state.get(_CONSTRUCTING):
                    return None
                raise RlcoreError(
                    f"{type(self).__name__}.{spec.name}() belongs to group '{group}' but was called inside "
                    f"a worker of group '{actor.group}' (rank {actor.rank}); call it from the driver"
                )
            return _call_local(self, func, spec, args, kwargs)

        wrapper.__rlcore_function__ = spec  # type: ignore[attr-defined]
        return wrapper

    return decorate


def worker(group: str | list[str]) -> Callable[[type], type]:
    """Mark a class as the workers of one or more groups (roles); its `@function`s name one of them."""
    groups = [group] if isinstance(group, str) else list(group)
    if not groups or not all(isinstance(g, str) and g for g in groups):
        raise ConfigError(f"@worker(group=...) must be a group name or a list of them, got {group!r}")

    def decorate(cls: type) -> type:
        specs = [getattr(v, "__rlcore_function__") for v in vars(cls).values() if hasattr(v, "__rlcore_function__")]
        for spec in specs:
            if spec.group not in groups:
                raise ConfigError(
                    f"{cls.__name__}.{spec.name}() is a @function of group '{spec.group}', but @worker "
                    f"declares {groups}; add '{spec.group}' to @worker(group=...)"
                )
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            state = self.__dict__
            outer = not state.get(_CONSTRUCTING)
            if outer and _here._actor is None:
                for spec in specs:
                    spec.resolve()
                rt = _here._runtime
                if rt is not None and rt.use_ray and _REMOTE not in state:
                    state[_REMOTE] = rt.launch(type(self), groups, args, kwargs)
            state[_CONSTRUCTING] = True
            try:
                init(self, *args, **kwargs)
            finally:
                if outer:
                    state[_CONSTRUCTING] = False

        cls.__init__ = __init__
        cls.__rlcore_groups__ = tuple(groups)
        return cls

    return decorate


def _call_local(instance: Any, func: Callable[..., Any], spec: FunctionSpec, args: tuple, kwargs: dict) -> Any:
    """One in-process worker: the same dispatch/execute/collect path as under Ray, with n=1."""
    spec.resolve()
    shards = [(args, kwargs)] if spec.execute == "first" else spec._split(1, args, kwargs, Mesh())
    try:
        value, error = spec._collect([func(instance, *s[0], **s[1]) for s in shards if s is not None]), None
    except Exception as exc:  # raised by get(), as under Ray
        if spec.blocking:
            raise
        value, error = None, exc
    return value if spec.blocking else Handle(value=value, error=error)


def group_size(instance: Any, group: str) -> int:
    """How many workers serve `group` for a @worker instance (1 without Ray)."""
    remote = instance.__dict__.get(_REMOTE)
    return len(remote[group].actors) if remote is not None else 1


# -------------------------------------------------------------------------
# the runtime: which mode @worker classes start in
# -------------------------------------------------------------------------

_runtime: Runtime | None = None


class Runtime:
    """The slots @worker classes are placed on, and whether they run as Ray actors.

    `slots` maps a role (group) to one Slot per worker, ranks 0..n-1 (what `rlcore.placement.allocate`
    returns). `meshes` gives a group's parallel layout for `dispatch="dp"` (default: all data-parallel).
    Use it as a context manager, or call `stop()`: the actors it started are killed.
    """

    def __init__(
        self,
        slots: dict[str, list[Slot]] | None = None,
        use_ray: bool | None = None,
        meshes: dict[str, Mesh] | None = None,
        start_timeout: float = 120.0,
    ):
        self.use_ray = bool(slots) if use_ray is None else bool(use_ray)
        self.slots = dict(slots or {})
        self.meshes = dict(meshes or {})
        self.start_timeout = start_timeout
        self._groups: list[_RemoteGroup] = []
        self._validate()

    def _validate(self) -> None:
        if self.use_ray and not self.slots:
            raise ConfigError("runtime(use_ray=True) needs slots: {role: [Slot, ...]} from placement.allocate()")
        if not self.use_ray and self.slots:
            raise ConfigError("runtime(slots=...) places Ray actors; pass use_ray=True, or drop the slots")
        problems = []
        for role, slots in self.slots.items():
            if not isinstance(slots, list) or not slots or not all(isinstance(s, Slot) for s in slots):
                problems.append((f"slots.{role}", "must be a non-empty list of rlcore.Slot"))
                continue
            n = len(slots)
            for i, slot in enumerate(slots):
                if slot.role != role or slot.rank != i or slot.world_size != n:
                    problems.append((f"slots.{role}[{i}]", f"expected role '{role}', rank {i}, world_size {n}; "
                                     f"got role '{slot.role}', rank {slot.rank}, world_size {slot.world_size}"))
        for role, mesh in self.meshes.items():
            n = len(self.slots.get(role) or [None])
            if not isinstance(mesh, Mesh) or mesh.size != n:
                problems.append((f"meshes.{role}", f"must be a Mesh with dp*tp*pp == {n} (the group's workers)"))
        if problems:
            raise ConfigError(
                "invalid worker runtime: " + "; ".join(f"{k}: {m}" for k, m in problems), problems
            )
        if self.use_ray:
            from . import cluster

            if not cluster.is_initialized():
                raise RlcoreError("runtime(use_ray=True) needs a running Ray; call rlcore.cluster.init() first")

    def launch(self, cls: type, groups: list[str], args: tuple, kwargs: dict) -> dict[str, _RemoteGroup]:
        """Start one actor per slot of each group and build the class in all of them."""
        missing = [g for g in groups if g not in self.slots]
        if missing:
            raise ConfigError(
                f"{cls.__name__} serves group(s) {missing} but the runtime has slots only for "
                f"{sorted(self.slots)}; add them to the resource plan"
            )
        started: dict[str, _RemoteGroup] = {}
        try:
            for g in groups:
                mesh = self.meshes.get(g) or Mesh(dp=len(self.slots[g]))
                started[g] = _RemoteGroup.start(cls, g, self.slots[g], mesh, self.start_timeout)
            shared_args, shared_kwargs = encode(args, True), encode(kwargs, True)
            pending = [(g, g.setup(cls, shared_args, shared_kwargs)) for g in started.values()]
            for g, refs in pending:
                g.wait(refs, "__init__")
        except BaseException:
            for g in started.values():
                g.stop("its class failed to start")
            raise
        self._groups.extend(started.values())
        return started

    def stop(self) -> None:
        """Kill the actors this runtime started; later calls on their proxies raise RoleFailed."""
        global _runtime
        for g in self._groups:
            g.stop("the runtime was stopped")
        self._groups.clear()
        if _runtime is self:
            _runtime = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def runtime(
    slots: dict[str, list[Slot]] | None = None,
    use_ray: bool | None = None,
    meshes: dict[str, Mesh] | None = None,
    start_timeout: float = 120.0,
) -> Runtime:
    """Start the process's worker runtime; `with runtime(slots, use_ray=True): ...` stops it on exit."""
    global _runtime
    if _runtime is not None:
        raise RlcoreError("a worker runtime is already running; stop it (runtime.stop()) before starting another")
    _runtime = Runtime(slots, use_ray, meshes, start_timeout)
    return _runtime


def current_runtime() -> Runtime | None:
    return _runtime


def stop_runtime() -> None:
    """Stop the running worker runtime, if any."""
    if _runtime is not None:
        _runtime.stop()


# -------------------------------------------------------------------------
# results that come later
# -------------------------------------------------------------------------

_PENDING = object()


class Handle:
    """The result of a `blocking=False` call: `.get(timeout)` waits for it and collects it."""

    def __init__(self, group: _RemoteGroup | None = None, spec: FunctionSpec | None = None,
                 ranks: list[int] | None = None, refs: list[Any] | None = None, kept: set[int] | None = None,
                 value: Any = _PENDING, error: BaseException | None = None):
        self._group, self._spec, self._ranks, self._refs = group, spec, ranks or [], refs or []
        self._kept, self._value, self._error = kept, value, error

    def get(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        if self._value is _PENDING:
            self._value = self._group.collect(self._spec, self._ranks, self._refs, timeout, self._kept)
        return self._value


def wait(handles: Iterable[Handle], timeout: float | None = None) -> list[Any]:
    """Wait for several handles (one shared deadline); their results in order."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return [h.get(None if deadline is None else max(0.0, deadline - time.monotonic())) for h in handles]


# -------------------------------------------------------------------------
# Ray: the actor that hosts one instance, and the driver's view of a group of them
# -------------------------------------------------------------------------


@dataclass(frozen=True)
class _ActorContext:
    group: str
    rank: int


_actor: _ActorContext | None = None  # set inside a worker actor


class WorkerActor:
    """The Ray actor behind one worker: it hosts one instance of a @worker class.

    `_actor_class` adds one method per @function, named like it, so a call costs what a plain Ray
    actor call costs; the actor's own methods carry an `_rlcore_` prefix to stay out of their way.
    """

    def __init__(self) -> None:
        self.instance: Any = None

    def _rlcore_info(self) -> dict[str, Any]:
        import ray

        ip = ray._private.worker.global_worker.node_ip_address  # the Ray node's address, as it was started
        return {"pid": os.getpid(), "ip": ip, "node_id": ray.get_runtime_context().get_node_id()}

    def _rlcore_free_port(self, ip: str) -> int:
        with socket.socket() as s:
            s.bind((ip, 0))
            return s.getsockname()[1]

    def _rlcore_setup(self, cls: type, group: str, rank: int, env: dict[str, str], args: tuple, kwargs: dict) -> None:
        global _actor
        os.environ.update(env)
        _actor = _ActorContext(group, rank)
        self.instance = cls(*decode(args), **decode(kwargs))


def _forward(name: str) -> Callable[..., Any]:
    def method(self: WorkerActor, *args: Any, **kwargs: Any) -> Any:
        return encode(getattr(self.instance, name)(*decode(args), **decode(kwargs)), False)

    method.__name__ = method.__qualname__ = name
    return method


@functools.lru_cache(maxsize=None)
def _actor_class(cls: type) -> Any:
    """A Ray actor class for `cls`: WorkerActor plus a forwarding method per @function."""
    import ray

    names = [n for n in dir(cls) if hasattr(getattr(cls, n, None), "__rlcore_function__")]
    body = {n: _forward(n) for n in names}
    actor = type(f"{cls.__name__}Worker", (WorkerActor,), body)
    return ray.remote(max_restarts=0, max_task_retries=0)(actor)


class _RemoteGroup:
    """The driver's side of one group: its actors, and how a call is spread over them."""

    def __init__(self, role: str, actors: list[Any], infos: list[dict[str, Any]], mesh: Mesh):
        self.role, self.actors, self.infos, self.mesh = role, actors, infos, mesh
        self._calls: dict[str, list[Any]] = {}  # method name -> each actor's bound remote method
        self.failure: RoleFailed | None = None

    @classmethod
    def start(cls, worker_cls: type, role: str, slots: list[Slot], mesh: Mesh, timeout: float) -> _RemoteGroup:
        """One actor per slot, scheduled on the slot's bundle; waits until all are up."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from . import cluster

        actors = []
        for slot in slots:
            options: dict[str, Any] = {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus}
            if slot.placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    slot.placement_group, -1 if slot.bundle_index is None else slot.bundle_index
                )
            actors.append(_actor_class(worker_cls).options(**options).remote())
        try:
            infos = ray.get([a._rlcore_info.remote() for a in actors], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            cluster.kill(actors)
            raise ResourceError(
                f"role '{role}': {len(slots)} workers asking {slots[0].num_cpus} CPU and {slots[0].num_gpus} "
                f"GPU each were not scheduled within {timeout:.0f}s; the cluster has "
                f"{ray.available_resources()} free. Ask for less, or raise start_timeout."
            ) from None
        except ray.exceptions.RayError as exc:
            cluster.kill(actors)
            raise cluster.role_error(exc, role=role, rank=None, node="", pid=None, method="start") from exc
        return cls(role, actors, infos, mesh)

    def setup(self, cls: type, args: tuple, kwargs: dict) -> list[Any]:
        """Give every actor its group environment and build the instance (returns the pending refs)."""
        import ray

        master = self.infos[0]["ip"]
        port = ray.get(self.actors[0]._rlcore_free_port.remote(master))
        per_node = collections.Counter(info["node_id"] for info in self.infos)
        seen: collections.Counter = collections.Counter()
        refs = []
        for rank, (actor, info) in enumerate(zip(self.actors, self.infos)):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(len(self.actors)),
                "LOCAL_RANK": str(seen[info["node_id"]]), "LOCAL_WORLD_SIZE": str(per_node[info["node_id"]]),
                "MASTER_ADDR": master, "MASTER_PORT": str(port),
            }
            seen[info["node_id"]] += 1
            refs.append(actor._rlcore_setup.remote(cls, self.role, rank, env, args, kwargs))
        return refs

    def call(self, spec: FunctionSpec, args: tuple, kwargs: dict) -> Any:
        if self.failure is not None:
            raise self.failure
        calls = self._calls.get(spec.name)
        if calls is None:
            calls = self._calls[spec.name] = [getattr(a, spec.name) for a in self.actors]
        n = len(calls)
        if spec.execute == "first":
            shards: list[Any] = [(args, kwargs)]
        else:
            shards = spec._split(n, args, kwargs, self.mesh)
            if len(shards) != n:
                raise RlcoreError(f"dispatch {spec.dispatch!r} returned {len(shards)} shards for {n} workers")
        ranks = [r for r, s in enumerate(shards) if s is not None]
        uses = collections.Counter(id(shards[r]) for r in ranks)
        encoded: dict[int, tuple] = {}
        refs = []
        for r in ranks:
            key = id(shards[r])
            if key not in encoded:
                shared = uses[key] > 1
                encoded[key] = (encode(shards[r][0], shared), encode(shards[r][1], shared))
            refs.append(calls[r].remote(*encoded[key][0], **encoded[key][1]))
        keep = getattr(spec._split, "collect_ranks", None) if spec.execute == "all" else None
        kept = None if keep is None else set(keep(n, self.mesh))
        handle = Handle(self, spec, ranks, refs, kept=kept)
        return handle.get() if spec.blocking else handle

    def collect(self, spec: FunctionSpec, ranks: list[int], refs: list[Any], timeout: float | None,
                kept: set[int] | None = None) -> Any:
        """Wait for the workers' results and collect them (only the `kept` ranks' results, when given)."""
        import ray

        try:
            values = ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RlcoreError(
                f"role '{self.role}': {spec.name}() gave no result within {timeout}s; get() again to keep waiting"
            ) from None
        except ray.exceptions.RayError as exc:
            raise self._failed(exc, ranks, refs, spec.name) from None
        return spec._collect([decode(v) for r, v in zip(ranks, values) if kept is None or r in kept])

    def wait(self, refs: list[Any], method: str) -> None:
        import ray

        try:
            ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise self._failed(exc, list(range(len(refs))), refs, method) from None

    def _failed(self, exc: BaseException, ranks: list[int], refs: list[Any], method: str) -> RoleFailed:
        """The error of the first worker that failed; a dead worker stops its whole group."""
        import ray

        from . import cluster

        ready = set(ray.wait(refs, num_returns=len(refs), timeout=2.0)[0])
        rank = None
        for r, ref in zip(ranks, refs):  # the lowest failed rank; every error is read, so Ray logs none
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as err:
                    if rank is None:
                        rank, exc = r, err
        info = self.infos[rank] if rank is not None else {}
        error = cluster.role_error(exc, role=self.role, rank=rank, node=info.get("ip", ""),
                                   pid=info.get("pid"), method=method)
        if cluster.is_death(exc):
            self.failure = error
            cluster.kill(self.actors)
        return error

    def stop(self, why: str) -> None:
        from . import cluster

        if self.failure is None:
            self.failure = RoleFailed(f"role '{self.role}' is stopped: {why}", role=self.role)
        cluster.kill(self.actors)
