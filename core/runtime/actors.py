"""The worker side of `@worker` classes: the actor context, handles to results that come later, the Ray
actor that hosts one instance, and the driver's view of a group of them.

`rlcore.runtime.workers` (the decorators) decides when a group runs on Ray and starts it here
(`RemoteGroup.start`, then `setup`); a group call splits its arguments, sends each worker its shard
through the transport in `rlcore.runtime.transport`, and collects the results. This module does not import
`rlcore.runtime.workers`; Ray is imported only when a group starts.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import cluster
from .. import failures, log, manager
from .rendezvous import find_free_port
from .transport import decode, encode
from .dispatch import Mesh
from ..errors import ResourceError, RlcoreError, RoleFailed, RoleRestarted
from ..log import logger
from ..manager import EXTRA_PLUGINS_ENV
from ..specs import Slot
from ..watchdog import RayStuck, bounded

if TYPE_CHECKING:
    from .dispatch import FunctionSpec, Mode


class _NotSubmitted(Exception):
    """A blocking call's submission raised `error` (in the Ray thread), before any worker had the call."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class ActorContext:
    """The group and rank a worker actor serves; `WorkerActor` sets `_actor` in each actor."""

    group: str
    rank: int


_actor: ActorContext | None = None  # None on the driver and without Ray


# -------------------------------------------------------------------------
# results that come later
# -------------------------------------------------------------------------

_PENDING = object()


class Handle:
    """The result of a `blocking=False` call: `.get(timeout)` waits for it and collects it."""

    def __init__(self, group: RemoteGroup | None = None, spec: FunctionSpec | None = None, mode: Mode | None = None,
                 ranks: list[int] | None = None, refs: list[Any] | None = None, value: Any = _PENDING,
                 error: BaseException | None = None, resubmit: Callable[[list[int]], list[Any]] | None = None):
        self._group, self._spec, self._mode, self._ranks, self._refs = group, spec, mode, ranks or [], refs or []
        self._resubmit = resubmit  # the call again, for the given ranks (a restarted worker's shard)
        self._value, self._error = value, error
        self._started = time.monotonic()

    def get(self, timeout: float | None = None) -> Any:
        """The collected result; the call's error is raised here.

        `timeout` bounds this wait only: when it runs out, an RlcoreError says so and get() may be called
        again. The group's `call_timeout`, counted from the call, bounds every wait: a call that has given
        no result by then stops the group with RoleFailed naming the ranks that did not answer.
        """
        if self._error is not None:
            raise self._error
        if self._value is _PENDING:
            self._value = self._group.collect(self._spec, self._mode, self._ranks, self._refs, timeout, self._started,
                                              self._resubmit)
        return self._value


def wait(handles: Iterable[Handle], timeout: float | None = None) -> list[Any]:
    """Wait for several handles (one shared deadline); their results in order."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return [h.get(None if deadline is None else max(0.0, deadline - time.monotonic())) for h in handles]


# -------------------------------------------------------------------------
# Ray
# -------------------------------------------------------------------------


class WorkerActor:
    """The Ray actor behind one worker: it hosts one instance of a @worker class.

    `_actor_class` adds one method per @function, named like it, so a call costs what a plain Ray
    actor call costs; the actor's own methods carry an `_rlcore_` prefix to stay out of their way.
    """

    def __init__(self) -> None:
        self.instance: Any = None

    def _rlcore_info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "ip": _node_ip(), "node_id": ray.get_runtime_context().get_node_id()}

    def _rlcore_free_port(self, ip: str) -> int:
        return find_free_port(ip)

    def _rlcore_import(self, modules: tuple[str, ...]) -> None:
        """Import the engine's heavy modules ahead of its build (queued before `_rlcore_setup`); one that fails
        is left for the build to report in full."""
        import importlib

        log.route_worker_warnings()  # warnings on import (megatron-core's) go where setup's would
        for name in modules:
            with contextlib.suppress(Exception):  # the build imports it again and raises with its context
                importlib.import_module(name)

    def _rlcore_setup(self, cls: bytes, group: str, rank: int, env: dict[str, str], args: tuple, kwargs: dict) -> None:
        """Build the instance; `cls` comes pickled, read once the driver's module and file plugins are loaded
        here (a worker class a plugin file defines lives in that file's module)."""
        import pickle

        log.route_worker_warnings()  # a library's (megatron-core's on import) to the driver's run.log
        os.environ.update(env)
        global _actor
        _actor = ActorContext(group, rank)
        try:
            if manager.extra_plugins_from_env():
                manager.plugins()
            self.instance = pickle.loads(cls)(*decode(args), **decode(kwargs))
        except Exception as exc:
            raise _raised(exc, "__init__") from None


def _node_ip() -> str:
    import ray

    return ray._private.worker.global_worker.node_ip_address  # the Ray node's address, as it was started


def _raised(exc: Exception, method: str) -> RoleFailed:
    """What a worker raised, as a RoleFailed that carries its type, message and traceback as text: Ray pickles
    it whatever `exc` holds (a pydantic ValidationError with vLLM's arguments cannot be pickled)."""
    actor = _actor or ActorContext("?", -1)
    return failures.raised(exc, role=actor.group, rank=actor.rank, node=_node_ip(), method=method)


def _forward(name: str) -> Callable[..., Any]:
    def method(self: WorkerActor, *args: Any, **kwargs: Any) -> Any:
        try:
            return encode(getattr(self.instance, name)(*decode(args), **decode(kwargs)), False)
        except Exception as exc:
            raise _raised(exc, name) from None

    method.__name__ = method.__qualname__ = name
    return method


@functools.lru_cache(maxsize=None)
def _actor_class(cls: type) -> Any:
    """A Ray actor class for `cls`: WorkerActor plus a forwarding method per @function."""
    import ray

    names = [n for n in dir(cls) if hasattr(getattr(cls, n, None), "__rlcore_function__")]
    body = {n: _forward(n) for n in names}
    actor = type(f"{cls.__name__}Worker", (WorkerActor,), body)
    return ray.remote(max_restarts=0, max_task_retries=0)(actor)  # a group's `max_restarts` is set per group


RESTART_POLL_S = 0.5  # how often a restarting worker is asked whether it is back
CALL_TIMEOUT_S = 1800.0  # the wait for a restarted worker of a group without a call timeout
GET_MARGIN_S = 5.0  # a ray.get past its own timeout by this much is stuck in Ray itself (see rlcore.watchdog)


class RemoteGroup:
    """The driver's side of one group: its actors, and how a call is spread over them.

    `call_timeout` (seconds, None for none) is how long any call may go without a result before its
    group counts as hung: the ranks that did not answer are named in a RoleFailed and the group stops.
    Submitting a call is bounded by it too: a submission that Ray never takes (a stopped raylet) is a
    RayStuck naming the call (see `rlcore.watchdog`).

    `max_restarts` (a group whose workers hold no training state): Ray restarts a worker whose process died up to
    that many times; its instance is built again as at the start, `on_restart(ranks)` gives back what the run gave
    it (its weights), and the call it died in is sent again to it alone. `restarted` counts the restarts. A group
    that `holds_state` (a train engine) cannot take up a call where a worker died: all its workers are restarted and
    built again (one new torch.distributed world), `on_restart` gets them all, and the call raises RoleRestarted, for
    the trainer to resume the run from its last checkpoint.
    """

    def __init__(self, role: str, actors: list[Any], infos: list[dict[str, Any]], mesh: Mesh,
                 call_timeout: float | None = None, max_restarts: int = 0, holds_state: bool = False):
        self.role, self.actors, self.infos, self.mesh = role, actors, infos, mesh
        self.holds_state = holds_state
        self.call_timeout = call_timeout
        self._calls: dict[str, list[Any]] = {}  # method name -> each actor's bound remote method
        self.failure: RoleFailed | None = None
        self.max_restarts = max_restarts
        self.restarts_of = [0] * len(actors)  # per rank: the restarts Ray made of it
        self.restarted = 0  # the group's worker restarts so far
        self.on_restart: Callable[[list[int]], None] | None = None
        self._setups: list[tuple] = []  # per rank: the arguments of `_rlcore_setup`, to build a restarted worker again

    @classmethod
    def start(cls, worker_cls: type, role: str, slots: list[Slot], mesh: Mesh, timeout: float,
              call_timeout: float | None = None, max_restarts: int = 0, holds_state: bool = False) -> RemoteGroup:
        """One actor per slot, scheduled on the slot's bundle; waits until all are up."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actors: list[Any] = []

        def started() -> list[dict[str, Any]]:
            for slot in slots:
                options: dict[str, Any] = {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus,
                                           "max_restarts": max_restarts}
                if slot.placement_group is not None:
                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        slot.placement_group, -1 if slot.bundle_index is None else slot.bundle_index
                    )
                actors.append(_actor_class(worker_cls).options(**options).remote())
            return ray.get([a._rlcore_info.remote() for a in actors], timeout=timeout)

        try:
            infos = bounded(started, f"starting the workers of role '{role}'", timeout + GET_MARGIN_S, role=role)
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
        except BaseException:  # a signal's stop while the actors start: none of them is left behind
            cluster.kill(actors)
            raise
        return cls(role, actors, infos, mesh, call_timeout, max_restarts, holds_state)

    def import_ahead(self, modules: tuple[str, ...]) -> None:
        """Have every actor import `modules` now, without waiting: the actor runs it before `setup`'s build."""
        if modules:
            self._submit(lambda: [a._rlcore_import.remote(tuple(modules)) for a in self.actors], "import")

    def setup(self, cls: type, args: tuple, kwargs: dict, extra_plugins: tuple[str, ...] = ()) -> list[Any]:
        """Give every actor its group environment and build the instance (returns the pending refs);
        `extra_plugins`, the module and file plugins of the driver's run, are loaded there too."""
        from ray import cloudpickle

        pickled = cloudpickle.dumps(cls)
        master = self.infos[0]["ip"]
        asked = self._submit(lambda: [self.actors[0]._rlcore_free_port.remote(master)], "setup")
        port = self._get(asked, [0], "setup")[0]
        per_node = collections.Counter(info["node_id"] for info in self.infos)
        seen: collections.Counter = collections.Counter()
        calls = []
        for rank, (actor, info) in enumerate(zip(self.actors, self.infos)):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(len(self.actors)),
                "LOCAL_RANK": str(seen[info["node_id"]]), "LOCAL_WORLD_SIZE": str(per_node[info["node_id"]]),
                "MASTER_ADDR": master, "MASTER_PORT": str(port),
                # a user's own plugin files and modules: the worker resolves engines and names with them too
                EXTRA_PLUGINS_ENV: os.pathsep.join(extra_plugins),
            }
            seen[info["node_id"]] += 1
            self._setups.append((pickled, self.role, rank, env, args, kwargs))
            calls.append(functools.partial(actor._rlcore_setup.remote, *self._setups[-1]))
        return self._submit(lambda: [call() for call in calls], "__init__")

    def call(self, spec: FunctionSpec, mode: Mode, args: tuple, kwargs: dict) -> Any:
        """Split the arguments over the workers as `mode` says and call them; the collected result, or a Handle."""
        if self.failure is not None:
            raise self.failure
        calls = self._calls.get(spec.name)
        if calls is None:
            calls = self._calls[spec.name] = [getattr(a, spec.name) for a in self.actors]
        n = len(calls)
        shards = mode.split(n, args, kwargs, self.mesh)
        if len(shards) != n:
            raise RlcoreError(f"dispatch '{mode.dispatch}' returned {len(shards)} shards for {n} workers")
        ranks = [r for r, s in enumerate(shards) if s is not None]
        uses = collections.Counter(id(shards[r]) for r in ranks)

        def submit(only: list[int]) -> list[Any]:  # large arguments go into the object store, through the raylet
            encoded: dict[int, tuple] = {}
            refs = []
            for r in only:
                key = id(shards[r])
                if key not in encoded:
                    shared = uses[key] > 1
                    encoded[key] = (encode(shards[r][0], shared), encode(shards[r][1], shared))
                refs.append(calls[r].remote(*encoded[key][0], **encoded[key][1]))
            return refs

        if not spec.blocking or self.max_restarts:
            refs = self._submit(lambda: submit(ranks), spec.name)
            resubmit = (lambda only: self._submit(lambda: submit(only), spec.name)) if self.max_restarts else None
            handle = Handle(self, spec, mode, ranks, refs, resubmit=resubmit)
            return handle.get() if spec.blocking else handle
        import ray

        sent: list[Any] = []  # filled before the wait, for the errors that name the ranks

        def submit_and_get(wait: float | None) -> list[Any]:  # one hand-over to a Ray thread per blocking call
            try:
                sent.extend(submit(ranks))
            except BaseException as exc:  # noqa: BLE001 - raised as itself in the caller's thread
                raise _NotSubmitted(exc) from exc
            return ray.get(sent, timeout=wait)

        try:
            values = self._get(sent, ranks, spec.name, fetch=submit_and_get)
        except _NotSubmitted as exc:
            raise exc.error from None
        return self._collected(mode, ranks, values)

    def collect(self, spec: FunctionSpec, mode: Mode, ranks: list[int], refs: list[Any], timeout: float | None,
                started: float | None = None, resubmit: Callable[[list[int]], list[Any]] | None = None) -> Any:
        """Wait for the workers' results and collect them as `mode` says (only its kept ranks' results);
        `timeout` bounds this wait, the group's `call_timeout` from `started` the call (see Handle.get); with
        `resubmit`, a worker that died and was restarted is sent its shard again."""
        return self._collected(mode, ranks, self._get(refs, ranks, spec.name, started, timeout, resubmit))

    def _collected(self, mode: Mode, ranks: list[int], values: list[Any]) -> Any:
        kept = mode.kept(len(self.actors), self.mesh)
        return mode.collect([decode(v) for r, v in zip(ranks, values) if kept is None or r in kept])

    def wait(self, refs: list[Any], method: str) -> None:
        """Wait for every worker's call (`__init__` while starting); a failure raises RoleFailed."""
        self._get(refs, list(range(len(refs))), method)

    def _submit(self, submit: Callable[[], list[Any]], method: str) -> list[Any]:
        """`submit()` (which hands a call to the workers through Ray) within `call_timeout`; RayStuck past it."""
        try:
            return bounded(submit, f"submitting {method}() to role '{self.role}'", self.call_timeout, role=self.role)
        except RayStuck as exc:
            self.failure = exc
            raise

    def _get(self, refs: list[Any], ranks: list[int], method: str, started: float | None = None,
             timeout: float | None = None, resubmit: Callable[[list[int]], list[Any]] | None = None,
             fetch: Callable[[float | None], list[Any]] | None = None) -> list[Any]:
        """The workers' results, within `timeout` (an RlcoreError after it) and the call's `call_timeout`
        from `started` (a hung group: RoleFailed, and the group stops). A ray.get that outlives its own
        timeout by GET_MARGIN_S is stuck in Ray itself: RayStuck. With `resubmit` (the call again, for some
        ranks), workers that died are restarted (`max_restarts`) and their shards sent again. `fetch(wait)`: what gets
        them (default: `ray.get(refs)`; a blocking call without restarts submits first, filling `refs`)."""
        import ray

        while True:
            left = None
            if self.call_timeout is not None:
                elapsed = 0.0 if started is None else time.monotonic() - started
                left = max(0.0, self.call_timeout - elapsed)
            own = timeout is not None and (left is None or timeout < left)
            wait = timeout if own else left
            what = (f"a call of {method}() to role '{self.role}'" if fetch
                    else f"the results of {method}() of role '{self.role}'")
            get = fetch or (lambda w, refs=refs: ray.get(refs, timeout=w))
            try:
                return bounded(lambda: get(wait), what, None if wait is None else wait + GET_MARGIN_S, own=False,
                               role=self.role)
            except RayStuck as exc:
                self.failure = exc
                raise
            except ray.exceptions.GetTimeoutError:
                if own:
                    raise RlcoreError(
                        f"role '{self.role}': {method}() gave no result within {timeout}s; get() again to keep waiting"
                    ) from None
                raise self._hung(refs, ranks, method) from None
            except ray.exceptions.RayError as exc:
                if self.failure is not None:  # the group was stopped (hung, a death, stop()): that is the cause
                    raise self.failure from None
                failed = self._errors(refs, ranks, method)
                if resubmit is not None and self.holds_state and self._restartable(failed):
                    raise self._rebuild(failed, method) from None
                if resubmit is None or not self._restart(failed, method):
                    raise self._failed(exc, failed, method) from None
                again = dict(zip([r for r, _ in failed], resubmit([r for r, _ in failed])))
                refs = [again.get(r, ref) for r, ref in zip(ranks, refs)]

    def _restartable(self, failed: list[tuple[int, BaseException]]) -> bool:
        """Every failure is a death (where the group holds state, one is: its peers' errors, a collective cut off,
        follow from it), and every worker of those (all of them, where the group holds state) has a restart left."""
        deaths = [r for r, err in failed if cluster.is_death(err)]
        if self.holds_state:
            return bool(deaths) and all(n < self.max_restarts for n in self.restarts_of)
        return bool(failed) and len(deaths) == len(failed) and all(self.restarts_of[r] < self.max_restarts for r in deaths)

    def _restart(self, failed: list[tuple[int, BaseException]], method: str) -> bool:
        """Build the workers in `failed` again once Ray restarted them, where every failure is a death and each
        of them has a restart left; `on_restart` then gives back their weights. False: they cannot be restarted."""
        if not self._restartable(failed):
            return False
        dead = [r for r, _ in failed]
        for r in dead:
            self.restarts_of[r] += 1
            info = self.infos[r]
            logger.warning(f"role '{self.role}' rank {r} on node {info.get('ip') or '?'} (pid {info.get('pid')}) died "
                           f"during {method}(); Ray restarts it (restart {self.restarts_of[r]} of max_restarts "
                           f"{self.max_restarts}); it is built again and sent {method}() again")
        for r, info in zip(dead, self._restarted_infos(dead)):
            self.infos[r] = info
        self._get(self._submit(lambda: [self.actors[r]._rlcore_setup.remote(*self._setups[r]) for r in dead],
                               "__init__"), dead, "__init__")
        self.restarted += len(dead)
        if self.on_restart is not None:
            self.on_restart(dead)
        return True

    def _rebuild(self, failed: list[tuple[int, BaseException]], method: str) -> RoleRestarted:
        """A group holding state lost workers: the others are killed for Ray to restart them too (their
        torch.distributed world lost its peers), all are built again in a new world; the RoleRestarted to raise."""
        import ray

        dead = [r for r, err in failed if cluster.is_death(err)]
        info = self.infos[dead[0]]
        where = f"role '{self.role}' rank {dead[0]} on node {info.get('ip') or '?'} (pid {info.get('pid')})"
        for r, actor in enumerate(self.actors):
            if r not in dead:
                with contextlib.suppress(Exception):  # one that died meanwhile is restarted all the same
                    ray.kill(actor, no_restart=False)
            self.restarts_of[r] += 1
        everyone = list(range(len(self.actors)))
        self.infos = self._restarted_infos(everyone)
        master = self.infos[0]["ip"]
        port = self._get(self._submit(lambda: [self.actors[0]._rlcore_free_port.remote(master)], "restart"), [0],
                         "restart")[0]
        self._setups = [(cls, role, rank, {**env, "MASTER_ADDR": master, "MASTER_PORT": str(port)}, args, kwargs)
                        for cls, role, rank, env, args, kwargs in self._setups]
        self._get(self._submit(lambda: [a._rlcore_setup.remote(*s) for a, s in zip(self.actors, self._setups)],
                               "__init__"), everyone, "__init__")
        self.restarted += len(self.actors)
        if self.on_restart is not None:
            self.on_restart(everyone)
        return RoleRestarted(
            f"{where} died during {method}(); Ray restarted the role's {len(self.actors)} worker(s) (restart "
            f"{self.restarts_of[0]} of max_restarts {self.max_restarts}), built again from the model the run started "
            "with", role=self.role, rank=dead[0], node=info.get("ip", ""))

    def _restarted_infos(self, ranks: list[int]) -> list[dict[str, Any]]:
        """The new processes of `ranks` (pid, node), once Ray has restarted them: a call while an actor restarts is
        refused (ActorUnavailableError), so it is asked again, within the group's call timeout."""
        import ray

        deadline = time.monotonic() + (self.call_timeout or CALL_TIMEOUT_S)
        while True:
            refs = self._submit(lambda: [self.actors[r]._rlcore_info.remote() for r in ranks], "restart")
            left = max(0.0, deadline - time.monotonic())
            try:
                return bounded(lambda: ray.get(refs, timeout=left), f"the restart of role '{self.role}'",
                               left + GET_MARGIN_S, own=False, role=self.role)
            except ray.exceptions.ActorUnavailableError:
                time.sleep(RESTART_POLL_S)  # on its way back
            except ray.exceptions.GetTimeoutError:
                raise self._hung(refs, ranks, "restart") from None
            except ray.exceptions.RayError as exc:
                raise self._failed(exc, self._errors(refs, ranks, "restart"), "restart") from None

    def call_ranks(self, name: str, ranks: list[int], *args: Any) -> list[Any]:
        """@function `name` on `ranks` alone, with the same arguments (a restarted worker put back to sleep)."""
        refs = self._submit(lambda: [getattr(self.actors[r], name).remote(*encode(args, False)) for r in ranks], name)
        return [decode(v) for v in self._get(refs, ranks, name)]

    def _hung(self, refs: list[Any], ranks: list[int], method: str) -> RoleFailed:
        """A call that gave no result within `call_timeout`: name the ranks that did not answer (the
        lowest first) and stop the group, whose workers may be stopped, deadlocked or waiting on a peer."""
        import ray

        try:
            ready = set(bounded(lambda: ray.wait(refs, num_returns=len(refs), timeout=0)[0],
                                f"which ranks answered {method}()", GET_MARGIN_S))
        except RayStuck:
            ready = set()
        silent = [r for r, ref in zip(ranks, refs) if ref not in ready] or list(ranks)
        rank, info = silent[0], self.infos[silent[0]]
        node, pid = info.get("ip", ""), info.get("pid")
        also = f" (ranks {', '.join(map(str, silent))} gave none)" if len(silent) > 1 else ""
        error = RoleFailed(
            f"role '{self.role}' rank {rank} on node {node or '?'} (pid {pid}) gave no result for {method}() "
            f"within {self.call_timeout:g}s{also}: it is stuck (stopped, deadlocked, waiting on a peer) or "
            f"slower than that. The group's workers were stopped; if the call is only slow, raise worker_timeout_s.",
            role=self.role, rank=rank, node=node,
        )
        self.failure = error
        cluster.kill(self.actors)
        return error

    def _errors(self, refs: list[Any], ranks: list[int], method: str) -> list[tuple[int, BaseException]]:
        """(rank, error) of each worker whose call failed by now (within 2 s)."""
        import ray

        def errors() -> list[tuple[int, BaseException]]:
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=2.0)[0])
            failed = []
            for r, ref in zip(ranks, refs):  # every error is read, so Ray logs none
                if ref in ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as err:
                        failed.append((r, err))
            return failed

        try:
            return bounded(errors, f"the errors of {method}() of role '{self.role}'", 2.0 + GET_MARGIN_S)
        except RayStuck:
            return []

    def _failed(self, exc: BaseException, failed: list[tuple[int, BaseException]], method: str) -> RoleFailed:
        """The error of the first worker that failed (a dead one before one that raised); a dead worker stops
        its whole group."""
        # the lowest failed rank, a dead one first: its peers' errors (a collective cut off) follow from its death
        dead = [(r, err) for r, err in failed if cluster.is_death(err)]
        rank = None
        if failed:
            rank, exc = (dead or failed)[0]
        info = self.infos[rank] if rank is not None else {}
        error = cluster.role_error(exc, role=self.role, rank=rank, node=info.get("ip", ""),
                                   pid=info.get("pid"), method=method)
        if cluster.is_death(exc):
            self.failure = error
            cluster.kill(self.actors)
        return error

    def stop(self, why: str) -> None:
        """Kill the group's actors; later calls raise RoleFailed saying `why`."""
        if self.failure is None:
            self.failure = RoleFailed(f"role '{self.role}' is stopped: {why}", role=self.role)
        cluster.kill(self.actors)
