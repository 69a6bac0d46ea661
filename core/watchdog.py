"""Bounded calls into Ray: a call that Ray's own processes never answer (a stopped or overloaded raylet,
its object store, the GCS) ends the run naming the call, instead of blocking the driver for good.

A call into Ray blocks in C++ where Python runs no signal handler, so SIGINT and SIGTERM would wait with
it. `bounded` runs the call in a thread of its own while the caller waits in Python (handlers run), for
at most the call's bound; after a stop signal (`stopping`), Ray's own work (submitting a call, a kill, the
teardown) gets STOP_GRACE_S at most. A call past its bound is left behind in its thread and Ray counts as
not answering (`stuck`): later calls fail at once and the teardown skips what would wait on it.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import RoleFailed

T = TypeVar("T")

STOP_GRACE_S = 15.0  # after SIGINT/SIGTERM: how long Ray's own work (not a worker's step) may take
_POLL_S = 0.5

_stuck: str | None = None  # what the call that never returned was
_stopping_since: float | None = None  # monotonic time of the stop signal


class RayStuck(RoleFailed):
    """A call into Ray gave no answer within its bound: Ray's processes do not answer."""


def stopping(asked: bool = True) -> None:
    """The run was asked to stop (the first SIGINT/SIGTERM): Ray's own work gets STOP_GRACE_S from now;
    `asked=False` when the run that was asked is over."""
    global _stopping_since
    if not asked:
        _stopping_since = None
    elif _stopping_since is None:
        _stopping_since = time.monotonic()


def stop_asked() -> bool:
    """Whether the run was asked to stop (a first SIGINT/SIGTERM/SIGHUP) and has not ended."""
    return _stopping_since is not None


def stuck() -> str | None:
    """The call that Ray never answered (then Ray is left alone), or None."""
    return _stuck


def reset() -> None:
    """Forget a call Ray did not answer: a new Ray is connected."""
    global _stuck
    _stuck = None


PROBE_EVERY_S = 2.0


class _Probe:
    """A store and fetch of one object through Ray, in a thread of its own: it needs the raylet and its
    object store, so one that never ends says Ray's own processes are stopped or gone."""

    def __init__(self) -> None:
        self.started, self.done = time.monotonic(), threading.Event()
        threading.Thread(target=self._run, daemon=True, name="rlcore-ray-probe").start()

    def _run(self) -> None:
        try:
            ray = sys.modules.get("ray")  # a process that never imported Ray has none to ask
            if ray is not None and ray.is_initialized():
                ray.get(ray.put(0), timeout=STOP_GRACE_S)
        except Exception:  # noqa: BLE001 - an error is an answer; only silence counts
            pass
        finally:
            self.done.set()


class _Runner:
    """A daemon thread that runs `bounded`'s calls, one at a time. Idle, it waits in `_idle` for the next call, so a
    small call costs a hand-over, not a thread's start; one whose call never returns stays with it, out of the pool."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="rlcore-ray-call")
        self.thread.start()

    def _serve(self) -> None:
        while True:
            call, what, result, done = self.jobs.get()
            self.thread.name = f"rlcore-ray-call: {what}"[:60]  # what a thread dump of a stuck call shows
            try:
                result["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                result["error"] = exc
            finally:
                _idle.append(self)  # before the caller wakes: its next call finds this runner
                done.set()


_idle: list[_Runner] = []


def _runner() -> _Runner:
    """An idle runner, or a new one (several threads may each wait on a call)."""
    try:
        return _idle.pop()
    except IndexError:
        return _Runner()


def bounded(call: Callable[[], T], what: str, timeout: float | None, *, own: bool = True, role: str = "") -> T:
    """`call()`'s result (or its error), waited for at most `timeout` seconds (None: no bound) and, where
    `own` (Ray's own work, not a wait for a worker's result), STOP_GRACE_S after a stop signal. Past that,
    RayStuck says that Ray did not answer `what` (e.g. "submitting train_step() to role 'train'"). A wait for a
    worker's result after a stop signal goes on (the step finishes) while Ray itself answers: a store of one
    object every PROBE_EVERY_S that takes over STOP_GRACE_S is RayStuck too."""
    global _stuck
    if _stuck is not None:
        raise RayStuck(f"Ray does not answer (it did not answer {_stuck}); {what} was not tried", role=role)
    result: dict[str, Any] = {}
    done = threading.Event()
    started = time.monotonic()
    _runner().jobs.put((call, what, result, done))
    probe: _Probe | None = None  # after a stop signal, a worker's step may go on: is Ray itself still there?
    while not done.wait(_POLL_S):
        now = time.monotonic()
        if not own and _stopping_since is not None:
            if probe is None or (probe.done.is_set() and now - probe.started > PROBE_EVERY_S):
                probe = _Probe()
            elif not probe.done.is_set() and now - probe.started > STOP_GRACE_S:
                bound = f"(nor a store of one object, since the signal to stop, within {STOP_GRACE_S:g}s)"
                break
        if timeout is not None and now - started > timeout:
            bound = f"within {timeout:g}s"
            break
        if own and _stopping_since is not None and now - max(started, _stopping_since) > STOP_GRACE_S:
            bound = f"within {STOP_GRACE_S:g}s of the signal to stop"
            break
    else:
        if "error" in result:
            raise result["error"]
        return result["value"]
    _stuck = what
    raise RayStuck(
        f"Ray did not answer {what} {bound}: its own processes (the raylet and its object store, or the GCS) "
        f"are stopped, overloaded or unreachable. The run stopped; see `ray status` and the raylet's log",
        role=role,
    )
