"""Roles as decorated classes: `@worker(group=...)` and `@function(group, dispatch, collect)`.

The semantics are ms-swift's RayHelper. The same class runs three ways:

- no runtime, or `runtime(use_ray=False)`: each group is one in-process worker. The class is built
  normally and a `@function` call still goes through dispatch and collect with one worker, so
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
share its memory. The Ray half (the actor that hosts an instance, and the driver's proxy for a group of
them) is `rlcore.runtime.actors`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import actors as _actors
from . import cluster
from .. import failures, manager
from .actors import Handle, RemoteGroup
from .dispatch import FunctionSpec, Mesh, Mode
from ..errors import ConfigError, RlcoreError
from ..specs import Slot
from .transport import encode

if TYPE_CHECKING:
    from ..manager import Plugins

# Wrappers read the mode through modules (`_actors._actor`, `_here._runtime`), never as their own
# globals: cloudpickle copies a wrapper of a class defined in __main__ by value, globals included.
_here = sys.modules[__name__]
_REMOTE = "_rlcore_remote"  # instance attribute on the driver: {group: RemoteGroup}
_CONSTRUCTING = "_rlcore_constructing"  # instance attribute: True while __init__ runs
_MODES = "_rlcore_modes"  # instance attribute on the driver: {function name: its resolved dispatch Mode}
_BINDINGS = "__rlcore_bindings__"  # class attribute set by @worker: {function name: the group serving it}
EXECUTE = ("all", "first")


# -------------------------------------------------------------------------
# decorators
# -------------------------------------------------------------------------


def function(
    group: str | None = None,
    dispatch: str | Callable[..., Any] = "all",
    execute: str = "all",
    collect: str | Callable[[list[Any]], Any] | None = None,
    blocking: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method as served by `group`'s workers; see the module docstring for the three modes.

    `group=None` means the role the class serves, bound by `@worker` or `bind` (a class of one role).
    `dispatch` names the dispatch mode, `collect` the collector (None: the one the mode pairs with, else
    `none`); `dispatch="first"` calls rank 0 only, with the arguments whole (`execute="first"`, ms-swift's
    spelling, says the same). `blocking=False` returns a `Handle`; its `.get()` waits for the collected result.
    """
    if group is not None and (not isinstance(group, str) or not group):
        raise ConfigError(f"@function(group=...) must be a non-empty string or None, got {group!r}")
    if execute not in EXECUTE:
        raise ConfigError(f"@function(execute={execute!r}) is not supported; use 'all' or 'first'")
    if execute == "first":
        if dispatch not in ("all", "first"):
            raise ConfigError(f"@function(execute='first') is dispatch 'first' (rank 0, the arguments whole); "
                              f"it cannot also dispatch {dispatch!r}")
        dispatch = "first"
    for key, value in (("dispatch", dispatch), ("collect", collect)):
        if not (isinstance(value, str) or callable(value) or (key == "collect" and value is None)):
            raise ConfigError(f"@function({key}=...) must be a registered name or a callable, got {value!r}")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        spec = FunctionSpec(func.__name__, group, dispatch, collect, bool(blocking))

        @functools.wraps(func)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            state = self.__dict__
            group = getattr(type(self), _BINDINGS, {}).get(spec.name, spec.group)
            remote = state.get(_REMOTE)
            if remote is not None:  # the driver, with Ray
                if state.get(_CONSTRUCTING):
                    return None
                return remote[group].call(spec, _mode(self, spec), args, kwargs)
            actor = _actors._actor
            if actor is not None:  # inside an actor
                if group == actor.group:
                    return func(self, *args, **kwargs)
                if state.get(_CONSTRUCTING):
                    return None
                raise RlcoreError(
                    f"{type(self).__name__}.{spec.name}() belongs to group '{group}' but was called inside "
                    f"a worker of group '{actor.group}' (rank {actor.rank}); call it from the driver"
                )
            return _call_local(self, func, spec, _mode(self, spec), args, kwargs)

        wrapper.__rlcore_function__ = spec  # type: ignore[attr-defined]
        return wrapper

    return decorate


def worker(group: str | list[str]) -> Callable[[type], type]:
    """Mark a class as the workers of one or more groups (roles); its `@function`s name one of them.

    A `@function` without a group, or one inherited from a class that serves another role, is served
    by the class's role when it has exactly one: `@worker(group="teacher") class Teacher(Rollout)` runs
    Rollout's functions in the teacher group, with and without Ray.
    """
    groups = [group] if isinstance(group, str) else list(group)
    if not groups or not all(isinstance(g, str) and g for g in groups):
        raise ConfigError(f"@worker(group=...) must be a group name or a list of them, got {group!r}")

    def decorate(cls: type) -> type:
        bindings: dict[str, str] = {}
        specs: list[FunctionSpec] = []
        for name in dir(cls):
            spec = getattr(getattr(cls, name, None), "__rlcore_function__", None)
            if spec is None:
                continue
            own = name in vars(cls)
            if spec.group in groups:
                bound = spec.group
            elif len(groups) == 1 and (spec.group is None or not own):
                bound = groups[0]
            elif spec.group is None:
                raise ConfigError(
                    f"{cls.__name__}.{spec.name}() is a @function without a group, but @worker declares "
                    f"{groups}; name its group: @function(group=...)"
                )
            elif own:
                raise ConfigError(
                    f"{cls.__name__}.{spec.name}() is a @function of group '{spec.group}', but @worker "
                    f"declares {groups}; add '{spec.group}' to @worker(group=...)"
                )
            else:
                raise ConfigError(
                    f"{cls.__name__} inherits {spec.name}() of group '{spec.group}', but @worker declares "
                    f"{groups}; add '{spec.group}' to @worker(group=...), or serve one role only"
                )
            bindings[spec.name] = bound
            specs.append(spec)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            state = self.__dict__
            outer = not state.get(_CONSTRUCTING)
            if outer and _actors._actor is None:
                plugins = worker_plugins()  # a misspelled name fails here, when the group is made, not at a call
                state[_MODES] = {spec.name: spec.mode(plugins, cls.__name__) for spec in specs}
                rt = _here._runtime
                if rt is not None and rt.use_ray and _REMOTE not in state:
                    state[_REMOTE] = rt.launch(type(self), groups, args, kwargs)
            state[_CONSTRUCTING] = True
            try:
                init(self, *args, **kwargs)
            except Exception as exc:
                if outer and _actors._actor is None and _REMOTE not in state:  # an in-process worker's
                    _tag(exc, groups[0] if len(groups) == 1 else "/".join(groups), "__init__")
                raise
            finally:
                if outer:
                    state[_CONSTRUCTING] = False

        cls.__init__ = __init__
        cls.__rlcore_groups__ = tuple(groups)
        setattr(cls, _BINDINGS, bindings)
        return cls

    return decorate


@functools.lru_cache(maxsize=None)
def bind(cls: type, role: str) -> type:
    """`cls` serving `role`: a subclass whose @functions run in that role's group. A worker class is
    written once and serves any role name (a train worker as `train`, `reference` or `teacher`)."""
    if getattr(cls, "__rlcore_groups__", None) == (role,):
        return cls
    groups = getattr(cls, "__rlcore_groups__", ())
    if len(groups) > 1:
        raise ConfigError(f"{cls.__name__} serves several groups {list(groups)}; only a one-role class can be bound to '{role}'")
    namespace = {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}[{role}]", "__doc__": cls.__doc__}
    return worker(group=role)(type(cls.__name__, (cls,), namespace))


def _mode(instance: Any, spec: FunctionSpec) -> Mode:
    """`spec`'s mode as the instance's group resolved it (one outside a @worker class: now)."""
    modes = instance.__dict__.setdefault(_MODES, {})
    if spec.name not in modes:
        modes[spec.name] = spec.mode(worker_plugins(), type(instance).__name__)
    return modes[spec.name]


def _call_local(instance: Any, func: Callable[..., Any], spec: FunctionSpec, mode: Mode, args: tuple,
                kwargs: dict) -> Any:
    """One in-process worker: the same dispatch/collect path as under Ray, with n=1."""
    shards = mode.split(1, args, kwargs, Mesh())  # one worker: every mode's kept ranks are rank 0
    try:
        value, error = mode.collect([func(instance, *s[0], **s[1]) for s in shards if s is not None]), None
    except Exception as exc:  # raised by get(), as under Ray
        group = getattr(type(instance), _BINDINGS, {}).get(spec.name, spec.group)
        _tag(exc, group or type(instance).__name__, spec.name)
        if spec.blocking:
            raise
        value, error = None, exc
    return value if spec.blocking else Handle(value=value, error=error)


def _tag(exc: Exception, role: str, method: str) -> None:
    """An in-process worker's exception propagates as itself, marked with where it was raised, so the CLI
    reports it in one line as it does a Ray worker's (`rlcore.failures`); rlcore's own errors say that already."""
    if not isinstance(exc, RlcoreError):
        failures.tag(exc, role=role, method=method)


# -------------------------------------------------------------------------
# the runtime: which mode @worker classes start in
# -------------------------------------------------------------------------

_runtime: Runtime | None = None
CALL_TIMEOUT = 1800.0  # seconds a group call may go without a result (RunConfig.worker_timeout_s)


class Runtime:
    """The slots @worker classes are placed on, and whether they run as Ray actors.

    `slots` maps a role (group) to one Slot per worker, ranks 0..n-1 (what `rlcore.runtime.placement.allocate`
    returns). `meshes` gives a group's parallel layout for `dispatch="dp"` (default: all data-parallel).
    `call_timeout` is how long a group call may go without a result before its group counts as hung
    (RoleFailed naming the ranks that did not answer, and the group stops; None: no limit). `plugins` are
    the ones the workers it builds resolve engines, dispatchers and collectors with (`worker_plugins`), in
    this process and, by the module and file plugins they name, in its actors (None: the process's own).
    `max_restarts` gives, per group, how often Ray restarts a worker of it that died (`RemoteGroup`; default 0);
    the groups in `holds_state` are then restarted whole, for their trainer to resume its last checkpoint.
    Use it as a context manager, or call `stop()`: the actors it started are killed.
    """

    def __init__(
        self,
        slots: dict[str, list[Slot]] | None = None,
        use_ray: bool | None = None,
        meshes: dict[str, Mesh] | None = None,
        start_timeout: float = 120.0,
        call_timeout: float | None = CALL_TIMEOUT,
        plugins: Plugins | None = None,
        max_restarts: dict[str, int] | None = None,
        holds_state: frozenset[str] = frozenset(),
    ):
        self.plugins = plugins
        self.max_restarts = dict(max_restarts or {})
        self.holds_state = holds_state
        self.use_ray = bool(slots) if use_ray is None else bool(use_ray)
        self.slots = dict(slots or {})
        self.meshes = dict(meshes or {})
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self._groups: list[RemoteGroup] = []
        self._ahead: dict[tuple[type, str], RemoteGroup] = {}  # started by `start_ahead`, not built yet
        self._validate()

    def _validate(self) -> None:
        if self.use_ray and not self.slots:
            raise ConfigError("runtime(use_ray=True) needs slots: {role: [Slot, ...]} from placement.allocate()")
        if not self.use_ray and self.slots:
            raise ConfigError("runtime(slots=...) places Ray actors; pass use_ray=True, or drop the slots")
        problems = []
        if self.call_timeout is not None and not self.call_timeout > 0:
            problems.append(("call_timeout", f"must be seconds > 0, or None for no limit; got {self.call_timeout!r}"))
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
            if not cluster.is_initialized():
                raise RlcoreError("runtime(use_ray=True) needs a running Ray; call rlcore.runtime.cluster.init() first")

    def _start(self, cls: type, group: str) -> RemoteGroup:
        """`group`'s actors for `cls`, one per slot, with the group's mesh (all data-parallel by default)."""
        mesh = self.meshes.get(group) or Mesh(dp=len(self.slots[group]))
        return RemoteGroup.start(cls, group, self.slots[group], mesh, self.start_timeout, self.call_timeout,
                                 self.max_restarts.get(group, 0), group in self.holds_state)

    def start_ahead(self, cls: type, group: str, imports: tuple[str, ...]) -> None:
        """Start `group`'s actors for `cls` now and have them import `imports` (the engine's heavy modules)
        while other groups build; `launch` later builds `cls` in these actors instead of starting new ones."""
        if not self.use_ray or group not in self.slots or (cls, group) in self._ahead:
            return
        started = self._ahead[(cls, group)] = self._start(cls, group)
        try:
            started.import_ahead(imports)
        except BaseException:
            self._ahead.pop((cls, group)).stop("its imports could not be submitted")
            raise

    def launch(self, cls: type, groups: list[str], args: tuple, kwargs: dict) -> dict[str, RemoteGroup]:
        """Start one actor per slot of each group and build the class in all of them."""
        missing = [g for g in groups if g not in self.slots]
        if missing:
            raise ConfigError(
                f"{cls.__name__} serves group(s) {missing} but the runtime has slots only for "
                f"{sorted(self.slots)}; add them to the resource plan"
            )
        started: dict[str, RemoteGroup] = {}
        try:
            for g in groups:
                started[g] = self._ahead.pop((cls, g), None) or self._start(cls, g)
            shared_args, shared_kwargs = encode(args, True), encode(kwargs, True)
            extra = (self.plugins or manager.plugins()).extra  # the actors load the same module and file plugins
            pending = [(g, g.setup(cls, shared_args, shared_kwargs, extra)) for g in started.values()]
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
        for g in [*self._groups, *self._ahead.values()]:
            g.stop("the runtime was stopped")
        self._groups.clear()
        self._ahead.clear()
        if _runtime is self:
            _runtime = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def runtime(slots: dict[str, list[Slot]] | None = None, use_ray: bool | None = None, **options: Any) -> Runtime:
    """Start the process's worker runtime (`options`: the rest of `Runtime`'s: meshes, start_timeout,
    call_timeout, plugins); `with runtime(slots, use_ray=True): ...` stops it on exit."""
    global _runtime
    if _runtime is not None:
        raise RlcoreError("a worker runtime is already running; stop it (runtime.stop()) before starting another")
    _runtime = Runtime(slots, use_ray, **options)
    return _runtime


def start_ahead(cls: type, group: str, imports: tuple[str, ...]) -> None:
    """On Ray: start `group`'s actors for the @worker class `cls` and have them import `imports` now, so that
    building it later (`cls(...)`) finds them started and imported (`Runtime.start_ahead`). In one process,
    or outside a runtime: nothing."""
    if _runtime is not None:
        _runtime.start_ahead(cls, group, imports)


def remote_group(instance: Any, group: str) -> RemoteGroup | None:
    """The driver's `RemoteGroup` behind a @worker instance's `group` (None without Ray)."""
    return instance.__dict__.get(_REMOTE, {}).get(group)


def worker_rank() -> int:
    """This worker's rank in its group, from the context the runtime gave the worker (a Ray actor's rank);
    0 for an in-process worker and on the driver. A worker asks this, not the environment's RANK."""
    actor = _actors._actor
    return 0 if actor is None else actor.rank


def worker_plugins() -> Plugins:
    """The plugins workers resolve engines, dispatchers and collectors with: those the running runtime was
    given (a session gives its run's), else the process's own (in a Ray actor: the ones its driver named)."""
    rt = _runtime
    return rt.plugins if rt is not None and rt.plugins is not None else manager.plugins()


def current_runtime() -> Runtime | None:
    """The running worker runtime, or None."""
    return _runtime


def stop_runtime() -> None:
    """Stop the running worker runtime, if any."""
    if _runtime is not None:
        _runtime.stop()
