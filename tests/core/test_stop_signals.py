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


def test_sighup_a_closed_terminal_stops_as_sigterm_does_with_129():
    done, seconds = run("SIGHUP", "40")
    assert done.returncode == 129, done.stderr[-2000:]
    assert STOPPED.format("SIGHUP") in done.stderr
    assert "rlcore: shutting the roles down took over 1 s after SIGHUP; exiting" in done.stderr
    assert seconds < 30


HANGING_REWARD = """
import pathlib, time

def reward(prompts, completions, **kw):
    pathlib.Path("started").touch()
    while True:  # a judge that never answers
        time.sleep(0.05)
"""


def test_a_reward_that_never_returns_is_ended_at_once_by_the_first_signal(tmp_path):
    """The reward runs under its time limit (600 s by default) in a thread of its own: the first SIGINT ends
    the run within seconds (130), saying why, with no traceback."""
    import os
    import signal

    (tmp_path / "hang.py").write_text(HANGING_REWARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    run = subprocess.Popen([sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "reward_funcs=[./hang.py:reward]",
                            "output_dir=out", "max_steps=2"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "started").exists(), run.communicate(timeout=30)[1][-2000:]
        time.sleep(0.3)
        signalled = time.monotonic()
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        run.kill()
    assert run.returncode == 130 and took < 10, (run.returncode, took, err[-2000:])
    assert "rlcore: stopped by SIGINT during a step that then failed (a signal to stop arrived while a reward " \
           "function ran); nothing was saved" in err and "Traceback" not in err


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


# -- a double Ctrl-C before the first checkpoint, then the user runs again --------------------------------------

HANGING_HOOK = """
import time
from pathlib import Path

from rlcore import hookimpl

@hookimpl
def rlcore_step_end(trainer, step, metrics):  # step 1 never ends: a long step, interrupted twice
    Path("in-step-1").touch()
    while True:
        time.sleep(0.05)
"""


def _wait(what, until, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Wait for an observable marker (a file, a line of output), however busy the machine is."""
    deadline = time.monotonic() + timeout
    while not until():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.05)


def _interrupted_twice(tmp_path):
    """`rlcore run --plugin grpo` stopped by two SIGINTs during its first step (nothing saved)."""
    import os
    import signal
    import threading

    (tmp_path / "hang.py").write_text(HANGING_HOOK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "--with", "./hang.py", "output_dir=out", "max_steps=3"],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # whatever this test was started with
    )
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        _wait("first step", (tmp_path / "in-step-1").exists, proc)
        proc.send_signal(signal.SIGINT)
        _wait("note of the first SIGINT", lambda: any("SIGINT: finishing this step" in line for line in err), proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=30)
    assert "rlcore: stopped by a second SIGINT, at once; nothing was saved" in "".join(err)
    out = tmp_path / "out"
    assert (out / "metrics.jsonl").stat().st_size and not list(out.glob("checkpoint-*"))
    return out


def _rlcore(cwd, *args: str) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    return subprocess.run([sys.executable, "-m", "rlcore", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def test_after_a_double_ctrl_c_with_no_checkpoint_a_new_run_and_resume_both_start_afresh(tmp_path):
    import json
    import shutil

    out = _interrupted_twice(tmp_path)
    shutil.copytree(out, tmp_path / "again")
    note = ("rlcore: warning: output_dir '{}' holds only what a run left that stopped before its first checkpoint{}; "
            "starting a new run there (its metrics.jsonl is replaced)")

    fresh = _rlcore(tmp_path, "run", "--plugin", "grpo", "output_dir=out", "max_steps=2")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stderr.splitlines()[0] == note.format("out", "")
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "checkpoint-2").is_dir() and (out / "final").is_dir()

    resumed = _rlcore(tmp_path, "run", "--plugin", "grpo", "output_dir=again", "max_steps=2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stderr.splitlines()[0] == note.format("again", " (--resume: there is no checkpoint to resume)")

    # a finished run's directory is another run's: still refused
    refused = _rlcore(tmp_path, "run", "--plugin", "grpo", "output_dir=out", "max_steps=2")
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[0].startswith("rlcore: error: output_dir 'out' already holds checkpoint-2")
