"""A worker that stops answering (SIGSTOP) ends the call with RoleFailed after the group's call timeout,
naming the rank that did not answer, and the group's actors are killed; an explicit get() timeout
stays a retryable wait."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import ray.cloudpickle

from rlcore import RlcoreError, RoleFailed, Slot, function, worker
from rlcore.runtime import workers

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


@worker(group="stuck")
class Echo:
    @function(collect="flatten")
    def echo(self, xs):
        return [os.getpid()]

    @function(blocking=False)
    def later(self, x):
        return x


def slots(n: int) -> dict[str, list[Slot]]:
    return {"stuck": [Slot("stuck", i, n, 0, None, 0.0, 0.5) for i in range(n)]}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_a_stopped_worker_raises_role_failed_naming_it_and_the_group_is_killed(ray_local):
    with workers.runtime(slots(2), use_ray=True, call_timeout=3.0):
        echo = Echo()
        pids = echo.echo([0, 1])
        group = echo._rlcore_remote["stuck"]
        assert pids == [info["pid"] for info in group.infos]
        os.kill(pids[1], signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RoleFailed, match=rf"role 'stuck' rank 1 on node \S+ \(pid {pids[1]}\) gave no "
                                                 rf"result for echo\(\) within 3s") as info:
                echo.echo([0, 1])
            assert time.monotonic() - start < 10
            assert (info.value.role, info.value.rank) == ("stuck", 1) and info.value.node
            with pytest.raises(RoleFailed, match="rank 1"):
                echo.echo([0, 1])  # the group stays failed
            assert wait_dead([pids[0]], 15) == [], "the group's other worker was not stopped"
        finally:
            os.kill(pids[1], signal.SIGCONT)
        assert wait_dead([pids[1]], 15) == [], "the stopped worker was not killed"


def test_an_explicit_get_timeout_is_a_retryable_wait(ray_local):
    with workers.runtime(slots(2), use_ray=True, call_timeout=60.0):
        echo = Echo()
        pids = echo.echo([0, 1])
        os.kill(pids[1], signal.SIGSTOP)
        try:
            handle = echo.later(7)
            with pytest.raises(RlcoreError, match=r"later\(\) gave no result within 0.5s; get\(\) again") as info:
                handle.get(0.5)
            assert not isinstance(info.value, RoleFailed)
        finally:
            os.kill(pids[1], signal.SIGCONT)
        assert handle.get() == [7, 7]
        assert echo.echo([0, 1]) == pids
