"""A step that fails after SIGTERM (a scheduler can signal every process of a job, the roles' too) stops the
run as the signal asked, saying why and what the output_dir holds, and never leaves the driver hanging in
the teardown of roles whose processes are gone."""

from __future__ import annotations

import subprocess
import sys
import time


DRIVER = """
import os, signal, sys, time
from rlcore.signals import StopOnSignal

with StopOnSignal() as stop:
    if sys.argv[1] != "none":
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # noted: the step goes on
    try:
        with stop.failing(lambda: "checkpoint-2 holds step 2 (continue with --resume)", grace_s=1):
            raise RuntimeError("role 'rollout' died during generate()")
    finally:
        time.sleep(float(sys.argv[2]))  # the teardown of the roles
"""
STOPPED = ("rlcore: stopped by {} during a step that then failed (role 'rollout' died during generate()); "
           "checkpoint-2 holds step 2 (continue with --resume)")


def run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


def test_a_step_failing_after_sigterm_stops_with_143_and_ends_a_hanging_teardown():
    done, seconds = run("SIGTERM", "40")
    assert done.returncode == 143, done.stderr[-2000:]
    assert STOPPED.format("SIGTERM") in done.stderr
    assert "rlcore: shutting the roles down took over 1 s after SIGTERM; exiting" in done.stderr
    assert seconds < 30


def test_a_step_failing_after_sigint_is_an_interrupt():
    done, _ = run("SIGINT", "0")
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr, done.stderr[-2000:]
    assert STOPPED.format("SIGINT") in done.stderr
    assert "shutting the roles down" not in done.stderr


def test_without_a_signal_the_steps_error_stays_and_a_slow_teardown_is_waited_for():
    done, _ = run("none", "3")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: role 'rollout' died during generate()" in done.stderr
    assert "rlcore: stopped" not in done.stderr and "shutting the roles down" not in done.stderr
