"""A step that fails after SIGTERM (a scheduler can signal every process of a job, the roles' too) must not
leave the driver hanging in the teardown of roles whose processes are gone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

DRIVER = """
import os, signal, sys, time
from rlcore.trainer import _Deferred

with _Deferred() as stop:
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGTERM)  # noted: the step goes on
    try:
        with stop.failing(grace_s=1):
            raise RuntimeError("the rollout worker died")
    finally:
        time.sleep(float(sys.argv[2]))  # the teardown of the roles
"""


def run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


def test_a_step_failing_after_sigterm_ends_a_hanging_teardown():
    done, seconds = run("signal", "40")
    assert done.returncode == 143, done.stderr[-2000:]
    assert "rlcore: shutting the roles down took over 1 s after SIGTERM and a failed step; exiting" in done.stderr
    assert seconds < 30


@pytest.mark.parametrize("sig, teardown_s", [("signal", "0"), ("none", "3")])
def test_a_teardown_that_ends_or_no_signal_keeps_the_steps_error(sig, teardown_s):
    done, _ = run(sig, teardown_s)  # with no signal, a slow teardown is waited for
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: the rollout worker died" in done.stderr
    assert "shutting the roles down" not in done.stderr
