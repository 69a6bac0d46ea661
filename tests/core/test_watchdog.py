"""`bounded`: a call into Ray that never returns ends in RayStuck naming it, within its bound (and within
STOP_GRACE_S of a stop signal for Ray's own work), while the waiting thread still handles signals."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from rlcore import watchdog
from rlcore.watchdog import RayStuck, bounded


@pytest.fixture(autouse=True)
def fresh():
    watchdog.reset()
    watchdog.stopping(False)
    yield
    watchdog.reset()
    watchdog.stopping(False)


def test_a_result_and_an_error_come_back_from_the_call():
    assert bounded(lambda: 7, "seven", 5) == 7
    with pytest.raises(KeyError, match="x"):
        bounded(lambda: {}["x"], "a lookup", 5)
    assert watchdog.stuck() is None


def test_calls_reuse_an_idle_thread_and_never_queue_behind_a_busy_one():
    ran = [bounded(threading.current_thread, "a small call", 5) for _ in range(50)]  # the threads kept alive
    assert len(set(map(id, ran))) == 1 and ran[0] is not threading.current_thread()  # one runner, reused
    slow, result = threading.Event(), []
    waiting = threading.Thread(target=lambda: result.append(bounded(slow.wait, "a long wait", 30, own=False)))
    waiting.start()
    time.sleep(0.2)  # the long wait holds a runner
    assert bounded(lambda: "done", "a call beside it", 5) == "done"  # another runner, not queued behind it
    slow.set()
    waiting.join(10)
    assert result == [True]


def test_a_call_that_never_returns_is_ray_stuck_and_later_calls_fail_at_once():
    never = threading.Event()
    started = time.monotonic()
    said = r"Ray did not answer submitting train_step\(\) to role 'train' within 1s"
    with pytest.raises(RayStuck, match=said) as info:
        bounded(never.wait, "submitting train_step() to role 'train'", 1.0, role="train")
    assert time.monotonic() - started < 10 and info.value.role == "train"
    assert watchdog.stuck() == "submitting train_step() to role 'train'"
    with pytest.raises(RayStuck, match=r"did not answer submitting train_step\(\).*; killing actors was not tried"):
        bounded(lambda: 1, "killing actors", 5)
    never.set()


def test_after_a_stop_signal_rays_own_work_gets_the_grace_and_a_wait_for_results_does_not(monkeypatch):
    monkeypatch.setattr(watchdog, "STOP_GRACE_S", 0.5)
    watchdog.stopping()
    with pytest.raises(RayStuck, match="within 0.5s of the signal to stop"):
        bounded(threading.Event().wait, "submitting generate() to role 'rollout'", None)
    watchdog.reset()
    assert bounded(lambda: time.sleep(1.5) or "done", "the results of generate()", None, own=False) == "done"


WAITS = """
import os, signal, sys, threading
from rlcore.watchdog import bounded

signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
bounded(threading.Event().wait, "submitting a call that Ray never takes", None)  # blocks for good, in its thread
"""


def test_the_waiting_thread_handles_signals_while_the_call_blocks():
    done = subprocess.run([sys.executable, "-c", WAITS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stderr[-2000:]


def test_after_a_signal_a_wait_for_a_worker_goes_on_while_ray_answers_and_ends_when_it_does_not(monkeypatch):
    """A stopped raylet: the step's wait for a worker's result would last worker_timeout_s (30 minutes by
    default). After a stop signal, a store of one object through Ray that does not end within STOP_GRACE_S
    ends the wait (RayStuck); while such stores end, the step goes on."""
    monkeypatch.setattr(watchdog, "STOP_GRACE_S", 0.5)
    monkeypatch.setattr(watchdog, "PROBE_EVERY_S", 0.1)
    answers = threading.Event()
    answers.set()
    monkeypatch.setattr(watchdog._Probe, "_run", lambda self: answers.wait() and self.done.set())
    slow = threading.Event()
    threading.Timer(1.5, slow.set).start()
    watchdog.stopping()
    try:
        assert bounded(lambda: slow.wait() and "done", "the results of step() of role 'train'", None, own=False) == "done"
        answers.clear()  # Ray's own processes stop answering
        started = time.monotonic()
        with pytest.raises(RayStuck, match=r"Ray did not answer the results of step\(\) of role 'train' \(nor a store "
                                           r"of one object, since the signal to stop, within 0.5s\)"):
            bounded(threading.Event().wait, "the results of step() of role 'train'", None, own=False)
        assert time.monotonic() - started < 3
    finally:
        answers.set()
        watchdog.stopping(False)
        watchdog.reset()
