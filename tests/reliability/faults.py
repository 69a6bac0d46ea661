"""Fault scenarios run end to end through the real CLI, as a user and an operator meet them.

Each scenario starts `python -m rlcore run --plugin grpo ...` in subprocesses inside a temp dir, injects
one fault (a signal to the driver, kill -9 or kill -STOP of a Ray worker at a chosen call, a kill during a
checkpoint write, a damaged file, a second run, a bad config) and returns an `Outcome`. A scenario
survives when it ends in a clear error (the expected exit status, one `rlcore: error:` line, no
traceback) or a correct resume (metrics.jsonl holds every step 1..MAX_STEPS once and the last
checkpoint exists). Every subprocess runs in a session of its own with a timeout; one that overruns it is
a hang, and its session (the driver and every Ray process it started) is killed.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

MAX_STEPS = 6
QUICK = ("max_completion_length=8", "per_device_train_batch_size=16", "num_generations=4",
         f"max_steps={MAX_STEPS}", "save_steps=1")
RUN_TIMEOUT = {False: 120.0, True: 240.0}  # seconds a whole run may take (a Ray start is ~20 s on 2 cores)
EXIT_TIMEOUT = 30.0  # seconds a driver may take to stop once a fault is injected (it takes ~3)
QUICK_ERROR_S = 20.0  # a bad config is refused within this
BASE_STEPS = 4  # the finished run that damaged-file and lock scenarios start from
WORKER_CLASS = {"train": "TrainWorkerWorker", "rollout": "GenerateWorkerWorker", "orm": "ScoreWorkerWorker"}  # Ray's titles


@dataclasses.dataclass
class Outcome:
    fault: str
    survived: bool
    hang: bool
    steps_lost: int
    seconds: float
    detail: str


class Hang(Exception):
    """A subprocess did not exit within its timeout (it and its session were killed)."""


class Broken(Exception):
    """The scenario ended neither in a clear error nor in a correct resume."""


# ---------------------------------------------------------------------------------------------------------
# one `rlcore run` in a session of its own
# ---------------------------------------------------------------------------------------------------------

HOOK = '''
import os, signal, time
from pathlib import Path
from rlcore import hookimpl

STEP_SLEEP = {step_sleep!r}
KILL_IN_SAVE_AT = {kill_in_save_at!r}
NAN_AT = {nan_at!r}  # the train engine's train_step call (1-based) whose loss is made NaN; 0: none
SLOW = {slow!r}  # "role.method": seconds that engine method waits first, where it runs (Ray workers load
                 # --with files too), so that a signal to the worker lands in that call


def _slowed(cls, name, seconds):
    original = getattr(cls, name)
    def slowed(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)
    setattr(cls, name, slowed)


if SLOW:
    from rlcore.plugins.hf.rollout import HFRolloutEngine
    from rlcore.plugins.hf.train import HFTrainEngine
    from rlcore.plugins.rewards.orm import OrmScorer

    for key, seconds in SLOW.items():
        role, name = key.split(".")
        _slowed({{"rollout": HFRolloutEngine, "train": HFTrainEngine, "orm": OrmScorer}}[role], name, seconds)

if NAN_AT:  # a loss gone NaN (as a too-high learning rate or a bad batch makes it), in that step alone
    from rlcore.plugins.hf.train import HFTrainEngine

    _train_step, _calls = HFTrainEngine.train_step, [0]

    def poisoned(self, batch, loss_fn, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == NAN_AT:
            inner = loss_fn
            def loss_fn(outputs, micro):
                loss, metrics = inner(outputs, micro)
                return loss * float("nan"), metrics
        return _train_step(self, batch, loss_fn, *args, **kwargs)

    HFTrainEngine.train_step = poisoned

@hookimpl
def rlcore_train_start(trainer):
    if STEP_SLEEP:  # a slower step, so that a signal lands in one
        step = trainer.train_step
        def slow():
            time.sleep(STEP_SLEEP)
            return step()
        trainer.train_step = slow

@hookimpl
def rlcore_step_end(trainer, step, metrics):
    if step == KILL_IN_SAVE_AT:  # this step's checkpoint: the engines write, one file is torn, then SIGKILL
        save = trainer.save_model
        def torn(path):
            save(path)
            files = sorted(Path(path).rglob("*.safetensors"))
            with open(files[0], "r+b") as f:
                f.truncate(files[0].stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.save_model = torn
'''


def write_hook(work: Path, *, step_sleep: float = 0.0, kill_in_save_at: int = 0,
               slow: dict[str, float] | None = None, nan_at: int = 0) -> str:
    """A hook-only plugin file for `--with`; returns its path relative to `work`."""
    (work / "hook.py").write_text(HOOK.format(step_sleep=step_sleep, kill_in_save_at=kill_in_save_at, slow=slow or {},
                                              nan_at=nan_at))
    return "./hook.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RLCORE_DEBUG", "RLCORE_PLUGINS", "RLCORE_RAY_ADDRESS", "RLCORE_STRICT_PLUGINS")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


class Run:
    """`rlcore run --plugin grpo ARGS` started in `work`, in a new session: the driver and every process its
    Ray starts share the session id (the driver's pid), so they can be found and killed after it is gone."""

    def __init__(self, work: Path, name: str, args: list[str], *, ray: bool = False, plugin_with: str | None = None,
                 file_size_limit: int | None = None, command: tuple[str, ...] = ("run", "--plugin", "grpo"),
                 env: dict[str, str | None] | None = None):
        self.work, self.name, self.ray = work, name, ray
        cmd = [*_limited(file_size_limit), sys.executable, "-m", "rlcore", *command]
        cmd += ["--use-ray"] if ray else []
        cmd += ["--with", plugin_with] if plugin_with else []
        self.cmd = cmd + list(args)
        environment = {k: v for k, v in {**_env(), **(env or {})}.items() if v is not None}  # None: unset
        with open(work / f"{name}.out", "w") as out, open(work / f"{name}.err", "w") as err:
            self.proc = subprocess.Popen(self.cmd, cwd=work, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=environment, start_new_session=True)
        self.pid = self.proc.pid
        self.started = time.monotonic()

    @property
    def stderr(self) -> str:
        return (self.work / f"{self.name}.err").read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return (self.work / f"{self.name}.out").read_text(errors="replace")

    def members(self) -> list[psutil.Process]:
        """The live processes of this run's session (the driver, its Ray, Ray's workers and agents)."""
        found = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == self.pid and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except (OSError, psutil.Error):
                continue
        return found

    def wait(self, timeout: float) -> int:
        """The exit status; a Hang (after killing the session) when it takes longer than `timeout`."""
        try:
            return self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            raise Hang(f"{self.name} did not exit within {timeout:.0f}s: {tail(self.stderr)}") from None

    def kill(self) -> None:
        """SIGKILL the driver and everything else in its session."""
        for process in self.members():
            try:
                process.kill()
            except psutil.Error:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def leftovers(self, grace: float = 10.0) -> list[str]:
        """The titles of the session's processes that outlive the driver by `grace` seconds (then killed)."""
        deadline = time.monotonic() + grace
        left = self.members()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.members()
        titles = [_title(p.pid)[:60] for p in left]
        self.kill()
        return titles

    def worker(self, role: str, timeout: float) -> psutil.Process:
        """The Ray worker process of `role` (found by its process title), waiting for it to start."""
        title = f"ray::{WORKER_CLASS[role]}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            for process in self.members():
                if _title(process.pid).startswith(title):
                    return process
            time.sleep(0.2)
        raise Broken(f"no {title} process appeared (exit {self.proc.poll()}): {tail(self.stderr)}")


def _limited(file_size: int | None) -> list[str]:
    """The prefix of a command that runs it on a full disk for files over `file_size` bytes: RLIMIT_FSIZE set
    in the child, which then execs the command in its own pid (Python ignores SIGXFSZ, so such a write fails with
    OSError, as on a full disk). Not a preexec_fn, which is unsafe where threads run (test_faults runs scenarios
    in threads)."""
    if file_size is None:
        return []
    limit = ("import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
             "os.execv(sys.argv[2], sys.argv[2:])")
    return [sys.executable, "-c", limit, str(file_size)]


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def tail(text: str, lines: int = 6) -> str:
    kept = [line.strip() for line in text.splitlines() if line.strip() and "it/s]" not in line and "step/s" not in line]
    return " | ".join(kept[-lines:])[-1200:]


def traced(err: str) -> str:
    return ", a traceback" if "Traceback" in err else ""


def metrics_steps(out: Path) -> list[int | None]:
    """The step of each line of metrics.jsonl (None for a line that is not a JSON object with a step)."""
    path = out / "metrics.jsonl"
    steps: list[int | None] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                steps.append(None)
    return steps


def steps_lost(out: Path) -> int:
    """Steps doubled in metrics.jsonl, missing below the last one logged (all of 1..MAX_STEPS once the run
    has its last checkpoint), and lines of no such step. Steps a refused run never trained are not lost."""
    steps = metrics_steps(out)
    counts = collections.Counter(steps)
    done = (out / f"checkpoint-{MAX_STEPS}").is_dir()
    last = MAX_STEPS if done else max((s for s in steps if isinstance(s, int) and 1 <= s <= MAX_STEPS), default=0)
    lost = sum(abs(counts.pop(step, 0) - 1) for step in range(1, last + 1))
    return lost + sum(counts.values())  # what is left: lines of no step in 1..MAX_STEPS


def wait_for(condition: Callable[[], bool], run: Run, timeout: float, what: str, poll: float = 0.05) -> None:
    """Poll until `condition()`; Broken when the run ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if run.proc.poll() is not None:
            raise Broken(f"{run.name} ended (exit {run.proc.returncode}) before {what}: {tail(run.stderr)}")
        if time.monotonic() > deadline:
            run.kill()
            raise Hang(f"{run.name}: no {what} within {timeout:.0f}s: {tail(run.stderr)}")
        time.sleep(poll)


def clear_error(run: Run, code: int, timeout: float, match: str | None = None) -> str:
    """The run ends with status `code`, exactly one `rlcore: error:` line (matching `match`) and no
    traceback; returns that line."""
    rc = run.wait(timeout)
    err = run.stderr
    errors = [line for line in err.splitlines() if line.startswith("rlcore: error:")]
    problems = []
    if rc != code:
        problems.append(f"exit {rc}, expected {code}")
    if len(errors) != 1:
        problems.append(f"{len(errors)} 'rlcore: error:' lines")
    if "Traceback" in err:
        problems.append("a traceback on stderr")
    if match and not re.search(match, err):
        problems.append(f"stderr does not say {match!r}")
    if problems:
        raise Broken(f"{run.name}: {'; '.join(problems)}: {tail(err)}")
    return errors[0][len("rlcore: error: "):]


class Scene:
    """A scenario's temp dir, its output_dir, and the runs it started (all killed at the end)."""

    def __init__(self, work: Path):
        self.work, self.out = work, work / "run"
        self.runs: list[Run] = []
        self.notes: list[str] = []
        self.cleanup: list[Callable[[], object]] = []
        self.resumed = False

    def run(self, name: str, *extra: str, ray: bool = False, plugin_with: str | None = None,
            resume: bool = False, file_size_limit: int | None = None) -> Run:
        args = [*QUICK, f"output_dir={self.out}", *extra] + (["--resume"] if resume else [])
        run = Run(self.work, name, args, ray=ray, plugin_with=plugin_with, file_size_limit=file_size_limit)
        self.runs.append(run)
        return run

    def cli(self, name: str, *command: str, env: dict[str, str | None] | None = None) -> Run:
        """`rlcore COMMAND...` as given (no QUICK keys, no output_dir), in the scene's dir."""
        run = Run(self.work, name, [], command=command, env=env)
        self.runs.append(run)
        return run

    def finished_run(self) -> None:
        """output_dir: a copy of a finished run of BASE_STEPS steps (made once per process, moved here as
        an operator moves a run's folder)."""
        shutil.copytree(_base_run(), self.out)

    def resume(self, *extra: str, ray: bool = False, expect: str | None = None, plugin_with: str | None = None) -> None:
        """`--resume` to the end: exit 0 and checkpoint-MAX_STEPS (steps lost are counted afterwards);
        `expect` is a pattern its stderr must show (a warning)."""
        self.resumed = True
        run = self.run("resume", *extra, ray=ray, resume=True, plugin_with=plugin_with)
        rc = run.wait(RUN_TIMEOUT[ray])
        if rc != 0:
            raise Broken(f"--resume exited {rc}: {tail(run.stderr)}")
        if not (self.out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").is_file():
            raise Broken(f"--resume ended without checkpoint-{MAX_STEPS}")
        if expect and not re.search(expect, run.stderr):
            raise Broken(f"--resume did not say {expect!r}: {tail(run.stderr)}")
        self.notes.append(f"resumed ({resume_line(run.stderr)})")

    def settled(self, run: Run) -> None:
        """Ray processes that outlive their driver (an exit that the driver saw stops its local Ray) are
        Broken."""
        if run.ray:
            left = run.leftovers()
            if left:
                raise Broken(f"{len(left)} Ray process(es) of {run.name} outlived it by 10 s: {left}")

    def close(self) -> None:
        for run in self.runs:
            run.kill()
        for step in self.cleanup:
            step()


_BASE_LOCK = threading.Lock()  # scenarios may run in threads (test_faults.py)


def _base_run() -> Path:
    """A finished run of BASE_STEPS steps, made once per process (removed at exit)."""
    with _BASE_LOCK:
        return _make_base_run()


@functools.cache
def _make_base_run() -> Path:
    work = Path(tempfile.mkdtemp(prefix="rlcore-fault-base-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    run = Run(work, "base", [*QUICK, f"max_steps={BASE_STEPS}", f"output_dir={work / 'run'}"])
    if run.wait(RUN_TIMEOUT[False]) != 0:
        raise Broken(f"a plain run of {BASE_STEPS} steps failed: {tail(run.stderr)}")
    return work / "run"


def resume_line(err: str) -> str:
    said = [line[len("rlcore: "):] for line in err.splitlines()
            if line.startswith("rlcore: warning:") or line.startswith("rlcore: resume:")]
    return "; ".join(said)[:300] or "no warning"


# ---------------------------------------------------------------------------------------------------------
# scenarios
# ---------------------------------------------------------------------------------------------------------

STOPPED = re.compile(r"^rlcore: stopped by (SIGINT|SIGTERM|SIGHUP) after step (\d+)(?:; saved (\S+)|, which (checkpoint-\d+) "
                     r"holds) \(continue with --resume\)$", re.M)


def signal_driver(sig: signal.Signals, ray: bool, group: bool, save_steps: int) -> Callable[[Scene], None]:
    """SIGINT/SIGTERM while step 3 runs: the step finishes, a checkpoint is saved, exit 130/143 saying
    where (or which checkpoint, saved by save_steps, holds the step); then --resume. `group` sends the
    signal to the whole process group, as Ctrl-C in a terminal and a scheduler's cancel do."""

    def scenario(scene: Scene) -> None:
        run = scene.run("first", f"save_steps={save_steps}", ray=ray,
                        plugin_with=write_hook(scene.work, step_sleep=0.5))
        wait_for(lambda: len(metrics_steps(scene.out)) >= 2, run, RUN_TIMEOUT[ray], "step 2")
        if group:
            os.killpg(run.pid, sig)
        else:
            os.kill(run.pid, sig)
        try:
            rc = run.wait(EXIT_TIMEOUT)
        except Hang:  # killed: does --resume still continue from what it saved?
            said = STOPPED.search(run.stderr)
            scene.notes.append(f"before the hang: {said.group(0) if said else 'no stopped line'}")
            try:
                scene.resume(f"save_steps={save_steps}", ray=ray)
            except Broken as exc:
                scene.notes.append(str(exc))
            raise
        err = run.stderr
        stopped = STOPPED.search(err)
        expected = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}[sig]
        if rc != expected or not stopped or "Traceback" in err:
            raise Broken(f"exit {rc} (expected {expected}), {'a' if stopped else 'no'} 'stopped by' line{traced(err)}: "
                         f"{tail(err)}")
        step, saved = int(stopped.group(2)), stopped.group(3) or str(scene.out / stopped.group(4))
        checkpoint = scene.out / f"checkpoint-{step}"
        if saved != str(checkpoint) or not (checkpoint / "trainer_state.json").is_file():
            raise Broken(f"stopped after step {step}, saved {saved}; checkpoint-{step} "
                         f"{'exists' if checkpoint.is_dir() else 'does not exist'}")
        if metrics_steps(scene.out) != list(range(1, step + 1)):
            raise Broken(f"after stopping at step {step}, metrics.jsonl holds steps {metrics_steps(scene.out)}")
        record = run_record(scene.out)
        if (record.get("state"), record.get("reason")) != ("stopped", sig.name):
            raise Broken(f"after stopping by {sig.name}, rlcore_run.json says {record}")
        scene.notes.append(f"exit {rc}: {stopped.group(0)[len('rlcore: '):]}")
        scene.settled(run)
        scene.resume(f"save_steps={save_steps}", ray=ray)

    return scenario


def sigterm_every_process(scene: Scene) -> None:
    """SIGTERM to every process of the run, Ray's and its workers' too, as Slurm's scancel or a preemption
    does (the job's cgroup, not a process group): the driver exits 143 within EXIT_TIMEOUT saying which
    checkpoint holds its last step, with no traceback, and --resume continues with every step once."""
    run = scene.run("first", "save_steps=1", ray=True, plugin_with=write_hook(scene.work, step_sleep=0.5))
    wait_for(lambda: len(metrics_steps(scene.out)) >= 2, run, RUN_TIMEOUT[True], "step 2")
    for process in run.members():
        try:
            process.terminate()
        except psutil.Error:
            pass
    rc = run.wait(EXIT_TIMEOUT)
    err = run.stderr
    said = [line for line in err.splitlines() if line.startswith(("rlcore: stopped", "rlcore: error"))]
    if rc != 143 or not said or "Traceback" in err:
        raise Broken(f"exit {rc} (expected 143), {len(said)} rlcore line(s){traced(err)}: {tail(err)}")
    scene.notes.append(f"exit {rc}: {' / '.join(said)[:200]}")
    scene.settled(run)
    scene.resume("save_steps=1", ray=True)


def signal_twice(scene: Scene) -> None:
    """Ctrl-C twice: the second stops at once (exit 130) wherever it lands; --resume continues from the
    newest intact checkpoint."""
    run = scene.run("first", plugin_with=write_hook(scene.work, step_sleep=0.3))
    wait_for(lambda: len(metrics_steps(scene.out)) >= 2, run, RUN_TIMEOUT[False], "step 2")
    os.killpg(run.pid, signal.SIGINT)
    time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    rc = run.wait(EXIT_TIMEOUT)
    if rc != 130 or "Traceback" in run.stderr:
        raise Broken(f"exit {rc} (expected 130){traced(run.stderr)}: {tail(run.stderr)}")
    scene.notes.append(f"exit 130 with steps {metrics_steps(scene.out)} logged")
    scene.resume()


def signal_at_startup(ray: bool) -> Callable[[Scene], None]:
    """SIGTERM while the run starts (its lock taken, its roles loading, no step yet): exit 143 with one
    line, no traceback; what the line advises (--resume, or nothing) then runs the whole run."""

    def scenario(scene: Scene) -> None:
        # a slow first step: on a quick machine step 1 was logged within the wait below, and nothing was tried
        run = scene.run("first", ray=ray, plugin_with=write_hook(scene.work, step_sleep=2.0))
        wait_for(lambda: (scene.out / ".rlcore.lock").is_file(), run, RUN_TIMEOUT[ray], "lock file", poll=0.01)
        time.sleep(1.0 if ray else 0.2)
        if metrics_steps(scene.out):
            raise Broken("the first step ended before the signal; nothing was tried at startup")
        os.kill(run.pid, signal.SIGTERM)
        rc = run.wait(EXIT_TIMEOUT)
        err = run.stderr
        said = [line for line in err.splitlines() if line.startswith(("rlcore: stopped", "rlcore: error"))]
        scene.notes.append(f"exit {rc}: {' / '.join(said) or 'no rlcore line'}")
        scene.settled(run)
        if rc != 143 or not said or "Traceback" in err:
            raise Broken(f"exit {rc} (expected 143), {len(said)} rlcore line(s) saying so{traced(err)}: {tail(err, 3)}")
        if "(continue with --resume)" in err:
            scene.resume(ray=ray)
        else:
            scene.resumed = True
            again = scene.run("again", ray=ray)
            if again.wait(RUN_TIMEOUT[ray]) != 0:
                raise Broken(f"a new run into the output_dir failed: {tail(again.stderr)}")

    return scenario


def stale_lock(owner: str) -> Callable[[Scene], None]:
    """The lock a SIGKILLed run left, whose pid now belongs to another process: `owner` 'other' (pid reuse
    on a busy host) or 'self' (a restarted container, where the new driver gets the dead one's pid):
    --resume must take the lock over, not call the dead run alive. `owner` 'host': the lock of a node that
    died, on a shared filesystem; rlcore cannot check it, so the error must name the lock file to remove."""

    def scenario(scene: Scene) -> None:
        scene.finished_run()
        lock = scene.out / ".rlcore.lock"
        subprocess.run([sys.executable, "-c", DIE_HOLDING_THE_LOCK, str(scene.out)], env=_env(), timeout=60)
        left = json.loads(lock.read_text())
        if owner == "host":
            lock.write_text(json.dumps({**left, "host": "node-that-died"}))
            line = clear_error(scene.run("resume", resume=True), 2, RUN_TIMEOUT[False], match=r"\.rlcore\.lock")
            scene.notes.append(line[:200])
            return
        plugin = None
        if owner == "other":
            other = subprocess.Popen(["sleep", "300"], start_new_session=True)
            scene.cleanup.append(other.kill)
            lock.write_text(json.dumps({**left, "pid": other.pid}))
            scene.notes.append(f"the lock names pid {other.pid}, a sleep started after the run died")
        else:
            (scene.work / "same_pid.py").write_text(SAME_PID.format(lock=str(lock)))
            plugin = "./same_pid.py"
            scene.notes.append("the lock names the resuming driver's own pid")
        scene.resume(plugin_with=plugin, expect=r"left by a run that is gone")

    return scenario


DIE_HOLDING_THE_LOCK = """
import os, signal, sys, time
from rlcore.checkpoint import RunLock
RunLock(sys.argv[1]).__enter__()
time.sleep(1.5)  # a run lives a while before it is killed: whoever gets its pid later started later
os.kill(os.getpid(), signal.SIGKILL)
"""

SAME_PID = """
import json, os
from pathlib import Path
from rlcore import hookimpl

# a driver SIGKILLed in a container left its lock; the restarted container's driver has the same pid
lock = Path({lock!r})
lock.write_text(json.dumps({{**json.loads(lock.read_text()), "pid": os.getpid()}}))

@hookimpl
def rlcore_train_start(trainer):
    pass
"""


def changed_on_resume(scene: Scene) -> None:
    """--resume with a changed num_generations (the batch's shape): exit 2 naming it; the run is intact."""
    scene.finished_run()
    before = metrics_steps(scene.out)
    line = clear_error(scene.run("resume", "num_generations=8", resume=True), 2, RUN_TIMEOUT[False],
                       match="num_generations")
    scene.notes.append(line[:200])
    if metrics_steps(scene.out) != before or (scene.out / ".rlcore.lock").exists():
        raise Broken("the refused resume changed the run's metrics or left its lock")


def changed_learning_rate(scene: Scene) -> None:
    """--resume with learning_rate=5e-4 after a run at 1e-3 (the demo's): the resume says it changed, and the
    resumed steps train at it (their metrics' lr, the optimizer state in the last checkpoint)."""
    import torch

    scene.finished_run()
    scene.resume("learning_rate=5e-4", expect=r"learning_rate 0\.001 -> 0\.0005")
    rows = map(json.loads, (scene.out / "metrics.jsonl").read_text().splitlines())
    rates = {row["step"]: row.get("learning_rate") for row in rows}
    state = torch.load(next((scene.out / f"checkpoint-{MAX_STEPS}").rglob("engine_state.pt")), weights_only=True)
    saved = [group["lr"] for group in state["optimizer"]["param_groups"]]
    expected = {step: 1e-3 if step <= BASE_STEPS else 5e-4 for step in range(1, MAX_STEPS + 1)}
    if any(not math.isclose(rates.get(step) or 0.0, lr) for step, lr in expected.items()) or \
            not all(math.isclose(lr, 5e-4) for lr in saved):
        raise Broken(f"said learning_rate 0.001 -> 0.0005, but trained at {rates} (lr per step); the optimizer state "
                     f"of checkpoint-{MAX_STEPS} holds {saved}")
    scene.notes.append(f"lr per step {rates}")


def finite_weights(checkpoint: Path) -> bool:
    from safetensors.torch import load_file

    files = sorted(checkpoint.rglob("*.safetensors"))
    return bool(files) and all(bool(t.isfinite().all()) for f in files for t in load_file(f).values())


def nonfinite_step(skip: bool) -> Callable[[Scene], None]:
    """Step 3's loss is NaN (its gradients too). By default the run stops with one clear error naming step
    3 and checkpoint-2 (exit 1), which --resume continues from; with on_nonfinite=skip the run says it
    skipped step 3, whose update is dropped (checkpoint-3 holds checkpoint-2's weights), and finishes. No
    checkpoint ever holds a NaN weight."""

    def scenario(scene: Scene) -> None:
        run = scene.run("first", *(["on_nonfinite=skip"] if skip else []), plugin_with=write_hook(scene.work, nan_at=3))
        if skip:
            scene.resumed = True  # this run's metrics are what is counted
            rc = run.wait(RUN_TIMEOUT[False])
            said = [line for line in run.stderr.splitlines() if line.startswith("rlcore: warning: step 3")]
            if rc != 0 or not said or "Traceback" in run.stderr:
                raise Broken(f"exit {rc}, {len(said)} warning(s) naming step 3{traced(run.stderr)}: {tail(run.stderr)}")
            from safetensors.torch import load_file

            before, after = (load_file(next((scene.out / f"checkpoint-{n}").rglob("*.safetensors"))) for n in (2, 3))
            if any(not before[k].equal(after[k]) for k in before):
                raise Broken("step 3 was said to be skipped, but its checkpoint's weights differ from step 2's")
            scene.notes.append(said[0][len("rlcore: "):][:200])
        else:
            line = clear_error(run, 1, RUN_TIMEOUT[False], match=r"step 3: loss nan.*checkpoint-2 holds step 2")
            if (scene.out / "checkpoint-3").exists():
                raise Broken("the run that stopped at step 3's NaN loss saved checkpoint-3")
            scene.notes.append(line[:200])
            scene.resume()
        bad = [c.name for c in sorted(scene.out.glob("checkpoint-*")) if not finite_weights(c)]
        if bad:
            raise Broken(f"{', '.join(bad)} hold NaN or infinite weights")

    return scenario


def kill_worker(role: str, method: str, how: signal.Signals = signal.SIGKILL, after_step: int = 1,
                timeout_s: float = 0) -> Callable[[Scene], None]:
    """On Ray, SIGKILL (or SIGSTOP) `role`'s worker while it runs `method()` after `after_step` steps (the
    engine's method is slowed by SLOW_CALL_S in the first run, so the signal lands in it); the driver
    stops with RoleFailed naming the role (exit 1) and --resume continues from the last checkpoint."""

    def scenario(scene: Scene) -> None:
        slow = write_hook(scene.work, slow={f"{role}.{method}": SLOW_CALL_S})
        run = scene.run("first", *([f"worker_timeout_s={timeout_s:g}"] if timeout_s else []), ray=True,
                        plugin_with=slow)
        worker = run.worker(role, RUN_TIMEOUT[True])
        title = f"ray::{WORKER_CLASS[role]}.{method}"
        wait_for(lambda: _title(worker.pid).split(" ")[0] == title and len(metrics_steps(scene.out)) >= after_step,
                 run, RUN_TIMEOUT[True], f"{title} after step {after_step}", poll=0.02)
        os.kill(worker.pid, how)
        at = len(metrics_steps(scene.out))
        injected = time.monotonic()
        try:
            line = clear_error(run, 1, EXIT_TIMEOUT + timeout_s, match=f"role '{role}'")
        finally:
            stopped_for = time.monotonic() - injected
            if how == signal.SIGSTOP:
                try:
                    worker.kill()  # what an operator does with a stopped worker the run gave up on
                except psutil.Error:
                    pass
        if how == signal.SIGSTOP and (str(worker.pid) not in line or stopped_for > timeout_s + 30):
            raise Broken(f"after {stopped_for:.0f}s the error does not name pid {worker.pid}: {line}")
        scene.notes.append(f"{how.name} in {method}() after step {at}, run stopped in {stopped_for:.1f}s: {line[:160]}")
        scene.settled(run)
        scene.resume(ray=True)

    return scenario


SLOW_CALL_S = 0.5


def survive_lost_workers(scene: Scene) -> None:
    """max_restarts=2, a reward model (orm) beside the toy reward, weights sent over gloo, a checkpoint every 2 steps.
    SIGKILL of the train worker in train_step() after step 1 (no checkpoint yet: it is built again and the run goes
    back to the start), of the rollout worker in generate() after step 2 (restarted, it joins a new broadcast group,
    takes the trained weights and generates again), of the reward worker in score() after step 4 (it scores again)
    and of the train worker after step 5 (it takes checkpoint-4; steps 5 and 6 are trained again). The run finishes
    (exit 0) with every step once, the restart counters at 2 (train), 1 (rollout) and 1 (orm), and final weights equal
    to those of the same run without the faults (hf on the CPU with a fixed seed is deterministic)."""
    from safetensors.torch import load_file

    from rlcore.testing import build_tiny_model

    orm = build_tiny_model(scene.work / "orm", num_labels=1, seed=1)
    extra = ("max_restarts=2", "reward_funcs=[toy,orm]", f"orm.model={orm}", "weight_sync_backend=gloo", "save_steps=2",
             # three roles on the 2 CPUs of the local Ray
             "device_groups={cpu: {device: CPU, ranks: 1, workers: [train, rollout]}, "
             "rm: {device: CPU, ranks: 1, workers: [orm]}}")
    slow = write_hook(scene.work, slow={"rollout.generate": SLOW_CALL_S, "orm.score": SLOW_CALL_S,
                                        "train.train_step": SLOW_CALL_S})
    run = scene.run("first", *extra, ray=True, plugin_with=slow)
    scene.resumed = True  # this run's metrics are what is counted
    for role, method, after_step in (("train", "train_step", 1), ("rollout", "generate", 2), ("orm", "score", 4),
                                     ("train", "train_step", 5)):
        worker, title = run.worker(role, RUN_TIMEOUT[True]), f"ray::{WORKER_CLASS[role]}.{method}"
        wait_for(lambda: _title(worker.pid).split(" ")[0] == title and len(metrics_steps(scene.out)) >= after_step,
                 run, RUN_TIMEOUT[True], f"{title} after step {after_step}", poll=0.02)
        os.kill(worker.pid, signal.SIGKILL)
        scene.notes.append(f"SIGKILL of {role} in {method}() after step {len(metrics_steps(scene.out))}")
    rc = run.wait(RUN_TIMEOUT[True])
    err = run.stderr
    restarted = [line for line in err.splitlines() if "Ray restart" in line]
    went_on = re.findall(r"the run goes on from (checkpoint-\d+|the start)", err)
    if rc != 0 or "Traceback" in err or len(restarted) != 4 or went_on != ["the start", "checkpoint-4"]:
        raise Broken(f"exit {rc}, {len(restarted)} restart warning(s){traced(err)}: {tail(err)}")
    rows = [json.loads(line) for line in (scene.out / "metrics.jsonl").read_text().splitlines()]
    counted = {role: [row[f"restarts/{role}"] for row in rows] for role in ("rollout", "orm", "train")}
    expected = {"rollout": [0, 0, 1, 1, 1, 1], "orm": [0, 0, 0, 0, 1, 1], "train": [1, 1, 1, 1, 2, 2]}  # counters
    if counted != expected or metrics_steps(scene.out) != list(range(1, MAX_STEPS + 1)):
        raise Broken(f"the metrics count restarts {counted}, not {expected}; steps {metrics_steps(scene.out)}")
    scene.settled(run)
    clean = Run(scene.work, "clean", [*QUICK, f"output_dir={scene.work / 'clean'}", *extra], ray=True, plugin_with=slow)
    scene.runs.append(clean)
    if clean.wait(RUN_TIMEOUT[True]) != 0:
        raise Broken(f"the run without faults failed: {tail(clean.stderr)}")
    got, want = (load_file(next((out / "final").glob("*.safetensors"))) for out in (scene.out, scene.work / "clean"))
    differ = sorted(k for k in want if not torch_equal(got.get(k), want[k]))
    if differ or set(got) != set(want):
        raise Broken(f"the final weights differ from a run without faults in {differ[:5] or 'their names'}")
    scene.notes.append(f"went on from {' then '.join(went_on)}; restarts counted once each; final weights equal a "
                       "run without faults")


def torch_equal(a: object, b: object) -> bool:
    import torch

    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


def kill_ray_process(name: str, after_step: int = 2) -> Callable[[Scene], None]:
    """SIGKILL of one of the local Ray's own processes (`raylet` or `gcs_server`: the OOM killer's choice,
    a crash) after `after_step` steps: either the driver stops with one clear error within EXIT_TIMEOUT
    (exit 1) and --resume continues from the last checkpoint, or the run needs no more of that process
    (calls to actors go straight to them, without the GCS) and finishes, every step once, and exits."""

    def scenario(scene: Scene) -> None:
        run = scene.run("first", ray=True, plugin_with=write_hook(scene.work, step_sleep=0.5))
        wait_for(lambda: len(metrics_steps(scene.out)) >= after_step, run, RUN_TIMEOUT[True], f"step {after_step}")
        found = [p for p in run.members() if _title(p.pid).split(" ")[0].endswith(name)]
        if not found:
            raise Broken(f"no {name} process among the run's: {[_title(p.pid)[:40] for p in run.members()]}")
        found[0].kill()
        injected = time.monotonic()
        rc = run.wait(RUN_TIMEOUT[True])
        took = time.monotonic() - injected
        if rc == 0:
            if metrics_steps(scene.out) != list(range(1, MAX_STEPS + 1)) or "Traceback" in run.stderr or \
                    not (scene.out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").is_file():
                raise Broken(f"exit 0 after the SIGKILL of {name}, but metrics.jsonl holds steps "
                             f"{metrics_steps(scene.out)}{traced(run.stderr)}: {tail(run.stderr)}")
            scene.notes.append(f"SIGKILL of {name} after step {after_step}: the run finished in {took:.1f}s")
            scene.settled(run)
            return
        if took > EXIT_TIMEOUT:
            raise Hang(f"{run.name} took {took:.0f}s to stop after the SIGKILL of {name}: {tail(run.stderr)}")
        line = clear_error(run, 1, 0, match=None)
        scene.notes.append(f"SIGKILL of {name} after step {after_step}, run stopped in {took:.1f}s: {line[:160]}")
        scene.settled(run)
        scene.resume(ray=True)

    return scenario


def stop_raylet(timeout_s: float = 0, signals: int = 0, sig: signal.Signals = signal.SIGTERM) -> Callable[[Scene], None]:
    """SIGSTOP of the local Ray's raylet (and its object store) after step 1: calls into Ray then block in
    C++, where no signal handler runs. The driver must still stop: with no signal, one clear error within
    `timeout_s` (worker_timeout_s) + EXIT_TIMEOUT (exit 1); with `signals` SIGTERMs to it (2 s apart), exit
    143 within EXIT_TIMEOUT (one signal lets the step go on while Ray answers: a store of one object that Ray
    does not answer within 15 s ends it), saying it stopped, the whole message (`sig` SIGINT: 130). Its local
    Ray ends with it (the stopped raylet too), and --resume continues from the last checkpoint."""

    def scenario(scene: Scene) -> None:
        run = scene.run("first", *([f"worker_timeout_s={timeout_s:g}"] if timeout_s else []), ray=True,
                        plugin_with=write_hook(scene.work, step_sleep=0.5))
        wait_for(lambda: len(metrics_steps(scene.out)) >= 1, run, RUN_TIMEOUT[True], "step 1")
        found = [p for p in run.members() if _title(p.pid).split(" ")[0].endswith("raylet")]
        if not found:
            raise Broken(f"no raylet among the run's processes: {[_title(p.pid)[:40] for p in run.members()]}")
        found[0].suspend()
        injected = time.monotonic()
        for _ in range(signals):
            time.sleep(2.0)
            if run.proc.poll() is None:
                os.kill(run.pid, sig)
        limit = EXIT_TIMEOUT + (timeout_s if signals < 2 else 0)
        rc = run.wait(limit - (time.monotonic() - injected))
        took, err = time.monotonic() - injected, run.stderr
        if signals:
            said = [line for line in err.splitlines() if line.startswith(("rlcore: stopped", "rlcore: error"))]
            expected = 130 if sig == signal.SIGINT else 143
            if rc != expected or not said or "Traceback" in err:
                raise Broken(f"exit {rc} (expected {expected}), {len(said)} rlcore line(s){traced(err)}: {tail(err)}")
            if not said[-1].endswith(("(continue with --resume)", "(run again, without --resume)")):
                raise Broken(f"the stop's message is cut off: {said[-1]!r}")
            line = " / ".join(said)
        else:
            line = clear_error(run, 1, 0)
        scene.notes.append(f"raylet stopped after step 1, {signals} {sig.name}(s), run stopped in {took:.1f}s: "
                           f"{line[:200]}")
        scene.settled(run)
        scene.resume(ray=True)

    return scenario


def kill_driver_in_checkpoint(ray: bool) -> Callable[[Scene], None]:
    """SIGKILL of the driver while checkpoint-3 is written (one safetensors file torn): --resume takes the
    dead run's lock over and continues from checkpoint-2; on Ray it ends the Ray the dead driver left."""

    def scenario(scene: Scene) -> None:
        run = scene.run("first", ray=ray, plugin_with=write_hook(scene.work, kill_in_save_at=3))
        rc = run.wait(RUN_TIMEOUT[ray])
        if rc != -signal.SIGKILL:
            raise Broken(f"the driver was to kill itself in the checkpoint write, but exited {rc}: {tail(run.stderr)}")
        found = sorted(p.name for p in scene.out.iterdir() if "checkpoint" in p.name)
        scene.notes.append(f"killed with {', '.join(found)} on disk")
        orphans = run.members()
        scene.resume(ray=ray, expect=r"left by a run that is gone")
        if ray:
            alive = [p for p in orphans if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            scene.notes.append(f"{len(orphans)} Ray process(es) orphaned, {len(alive)} still alive after --resume")
            if alive:
                raise Broken(f"{len(alive)} Ray process(es) of the killed driver outlived the next run: "
                             f"{[_title(p.pid)[:40] for p in alive]}")

    return scenario


def damaged(damage: Callable[[Path], str], expect: str | None) -> Callable[[Scene], None]:
    """A finished run of BASE_STEPS steps; `damage(output_dir)` breaks a file; --resume (to MAX_STEPS) must
    get past it, saying so (`expect`)."""

    def scenario(scene: Scene) -> None:
        scene.finished_run()
        scene.notes.append(damage(scene.out))
        scene.resume(expect=expect)

    return scenario


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def truncated_safetensors(out: Path) -> str:
    file = sorted((out / "checkpoint-4").rglob("*.safetensors"))[0]
    truncate(file)
    return f"truncated {file.relative_to(out)}"


def truncated_engine_state(out: Path) -> str:
    file = sorted((out / "checkpoint-4").rglob("engine_state.pt"))[0]
    truncate(file)
    return f"truncated {file.relative_to(out)}"


def state_not_json(out: Path) -> str:
    (out / "checkpoint-4" / "trainer_state.json").write_text('{"step": 4, "data": {')
    return "checkpoint-4/trainer_state.json is not JSON"


def torn_metrics(out: Path) -> str:
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"reward": 0.04, "loss": 0.1, "st')
    return "a torn last line in metrics.jsonl"


def disk_full(scene: Scene) -> None:
    """A checkpoint write fails (the optimizer state does not fit): a clear error naming the checkpoint
    (exit 1, no traceback); --resume, with room again, continues from the last complete checkpoint."""
    scene.finished_run()
    full = scene.run("full", resume=True, file_size_limit=DISK_FULL_AT)
    try:
        line = clear_error(full, 1, RUN_TIMEOUT[False], match="checkpoint-5")
    except Broken:  # does --resume still continue? then say what was not clear
        scene.resume()
        raise
    on_disk = sorted(p.name for p in scene.out.iterdir() if "checkpoint" in p.name)
    scene.notes.append(f"{line[:160]}; on disk: {on_disk}")
    if run_record(scene.out).get("state") != "failed":  # it said "running" after a full disk
        scene.resume()
        raise Broken(f"after the failed write rlcore_run.json says {run_record(scene.out)}")
    scene.resume()


DISK_FULL_AT = 500_000  # bytes: the demo model's safetensors (368 kB) fit, its optimizer state (753 kB) does not


def every_checkpoint_damaged(scene: Scene) -> None:
    """Every checkpoint of a run damaged: --resume is a clear error naming a file (exit 1)."""
    scene.finished_run()
    for step in range(1, BASE_STEPS + 1):
        (scene.out / f"checkpoint-{step}" / "trainer_state.json").write_text("not json")
    line = clear_error(scene.run("resume", resume=True), 1, RUN_TIMEOUT[False], match="trainer_state.json")
    scene.notes.append(line[:200])


def concurrent_runs(scene: Scene) -> None:
    """A second run into the output_dir of a running one exits 2 at once; the first finishes intact."""
    first = scene.run("first", plugin_with=write_hook(scene.work, step_sleep=0.5))
    wait_for(lambda: (scene.out / ".rlcore.lock").is_file(), first, RUN_TIMEOUT[False], "lock file")
    second = scene.run("second")
    started = time.monotonic()
    line = clear_error(second, 2, QUICK_ERROR_S + 10, match="in use by another run")
    scene.notes.append(f"second refused in {time.monotonic() - started:.1f}s: {line[:120]}")
    if first.proc.poll() is not None:
        raise Broken("the first run ended before the second was refused; nothing was concurrent")
    scene.resumed = True  # the first run's metrics are what is counted
    if first.wait(RUN_TIMEOUT[False]) != 0:
        raise Broken(f"the first run failed after the second was refused: {tail(first.stderr)}")
    if not (scene.out / f"checkpoint-{MAX_STEPS}").is_dir():
        raise Broken(f"the first run ended without checkpoint-{MAX_STEPS}")


def bad_config(*args: str, match: str, resume: bool = False, existing_dir: bool = False,
               config: str | bytes | None = None, files: dict[str, bytes] | None = None) -> Callable[[Scene], None]:
    """A run refused before it allocates: exit 2 within QUICK_ERROR_S, one error paragraph, no traceback,
    and no output_dir made (an existing one left as it was). `config` is written to ./config.yaml, `files`
    (name: content) into the scene's dir."""

    def scenario(scene: Scene) -> None:
        if existing_dir:
            scene.out.mkdir()
        for name, content in {**(files or {}), **({"config.yaml": config} if config is not None else {})}.items():
            (scene.work / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        run = scene.run("run", *args, resume=resume)
        quick_refusal(scene, run, match)
        if existing_dir and any(scene.out.iterdir()):
            raise Broken(f"the refused run left {sorted(p.name for p in scene.out.iterdir())} in output_dir")
        if not existing_dir and scene.out.exists():
            raise Broken("the refused run made its output_dir")

    return scenario


def quick_refusal(scene: Scene, run: Run, match: str) -> None:
    """`run` ends with exit 2 within QUICK_ERROR_S: one error paragraph matching `match`, no traceback."""
    clear_error(run, 2, RUN_TIMEOUT[False], match=match)
    took = time.monotonic() - run.started
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    start = next(i for i, x in enumerate(lines) if x.startswith("rlcore: error:"))
    if start or any(not x.startswith(" ") for x in lines[1:]):
        raise Broken(f"stderr is more than the error paragraph: {tail(run.stderr)}")
    scene.notes.append(f"{took:.1f}s: " + " / ".join(x.strip() for x in lines)[:300])
    if took > QUICK_ERROR_S:
        raise Broken(f"refused only after {took:.0f}s")


def refused_cli(*command: str, match: str, files: dict[str, str | bytes] | None = None,
                env: dict[str, str | None] | None = None) -> Callable[[Scene], None]:
    """`rlcore COMMAND...` (`config validate`, a run of another algorithm) refused as `bad_config` is: exit 2
    within QUICK_ERROR_S, one error paragraph matching `match`, no traceback. `files` are written first."""

    def scenario(scene: Scene) -> None:
        for name, content in (files or {}).items():
            (scene.work / name).parent.mkdir(parents=True, exist_ok=True)
            (scene.work / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        quick_refusal(scene, scene.cli("cli", *command, env=env), match)

    return scenario


NOT_UTF8 = b'{"prompt": "caf\xe9"}\n'  # Latin-1, as an old export writes it
NO_TRL = {"no-trl/sitecustomize.py": (  # TRL as if not installed: neither importable nor found (rlcore looks first)
    "import sys\n\n\nclass NoTrl:\n    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'trl' or name.startswith('trl.'):\n"
    "            raise ModuleNotFoundError(\"No module named 'trl'\", name='trl')\n\n\n"
    "sys.meta_path.insert(0, NoTrl())\n")}
OFFLINE_HUB = {"HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"}  # refused


def read_only_output_dir(scene: Scene) -> None:
    """output_dir in a directory this user cannot write (a 0555 one; as root, which writes anywhere, the
    read-only /proc/sys): exit 2 naming it, no traceback."""
    if os.geteuid():
        parent = scene.work / "read-only"
        parent.mkdir(mode=0o555)
        scene.cleanup.append(lambda: parent.chmod(0o755))
    else:
        parent = Path("/proc/sys")
        if os.access(parent, os.W_OK):
            raise Broken("running as root with a writable /proc/sys: no read-only directory to try")
    bad_config(f"output_dir={parent / 'run'}", match="not writable")(scene)


def user_checkpoint_folder(scene: Scene) -> None:
    """output_dir holds a folder of the user's named checkpoint-1 (a thesis in it): the run is refused (exit 2,
    naming it and overwrite_output_dir) and the folder is left as it was."""
    thesis = scene.out / "checkpoint-1" / "thesis.txt"
    thesis.parent.mkdir(parents=True)
    thesis.write_text("three years of work\n")
    run = scene.run("run", "max_steps=2", "save_steps=1")
    line = clear_error(run, 2, RUN_TIMEOUT[False], match=r"checkpoint-1.*overwrite_output_dir")
    scene.notes.append(line[:200])
    if not thesis.is_file() or sorted(p.name for p in scene.out.iterdir()) != ["checkpoint-1"]:
        raise Broken(f"after the refused run output_dir holds {sorted(p.name for p in scene.out.rglob('*'))}")


def late_second_run(delay_s: float) -> Callable[[Scene], None]:
    """A second run with another seed into the output_dir of one started `delay_s` earlier (it may land in
    the first one's setup, its steps, or after it): one of them finishes (exit 0), the other is refused (exit 2)
    having changed nothing, and output_dir holds the finished one's steps, checkpoint and demo model only."""

    def scenario(scene: Scene) -> None:
        first = scene.run("first", "max_steps=3", "save_steps=3")
        time.sleep(delay_s)
        second = scene.run("second", "max_steps=3", "save_steps=3", "seed=7")
        codes = {run.name: run.wait(RUN_TIMEOUT[False]) for run in (first, second)}
        if sorted(codes.values()) != [0, 2]:
            raise Broken(f"exit statuses {codes}: expected one run to finish and the other to be refused: "
                         f"first: {tail(first.stderr, 2)}; second: {tail(second.stderr, 2)}")
        winner, loser = (first, second) if codes["first"] == 0 else (second, first)
        line = clear_error(loser, 2, 0)
        seed = 7 if winner is second else 42
        state = json.loads((scene.out / "checkpoint-3" / "trainer_state.json").read_text())
        model = json.loads((scene.out / "tiny-model" / "rlcore_tiny.json").read_text())
        scene.notes.append(f"{winner.name} finished, {loser.name} refused: {line[:150]}")
        if metrics_steps(scene.out) != [1, 2, 3] or state["config"]["seed"] != seed or model["seed"] != seed:
            raise Broken(f"output_dir holds steps {metrics_steps(scene.out)}, a checkpoint of seed "
                         f"{state['config']['seed']} and a demo model of seed {model['seed']}; {winner.name} (seed "
                         f"{seed}) finished")

    return scenario


SECRET = "sk-rlcore-fault-0123456789abcdef"


def distill_api_key(scene: Scene) -> None:
    """`api_key=sk-...` given to distill (its endpoint down), then --resume with another key: neither key is in
    any file of output_dir, on stdout or stderr, or in `config show`."""
    keys = [SECRET, SECRET[::-1]]
    args = ("run", "--plugin", "distill", f"output_dir={scene.out}", "api_base=http://127.0.0.1:9/v1",
            "model=teacher", "max_retries=0")
    said, runs = [], []
    for name, command in (("first", (*args, f"api_key={keys[0]}")), ("resume", (*args, f"api_key={keys[1]}", "--resume")),
                          ("show", ("config", "show", "--plugin", "distill", f"api_key={keys[0]}"))):
        run = scene.cli(name, *command)  # one after the other
        runs.append(run)
        rc = run.wait(RUN_TIMEOUT[False])
        said.append(f"{run.name} exit {rc}")
        if "Traceback" in run.stderr:
            raise Broken(f"{run.name}: a traceback: {tail(run.stderr)}")
    leaks = [str(p.relative_to(scene.work)) for p in sorted(scene.out.rglob("*")) if p.is_file()
             and any(k.encode() in p.read_bytes() for k in keys)]
    leaks += [f"{run.name}'s {where}" for run in runs for where, text in (("stdout", run.stdout), ("stderr", run.stderr))
              if any(k in text for k in keys)]
    scene.notes.append(", ".join(said))
    if not list(scene.out.glob(".*state.json")):
        raise Broken(f"the first run wrote no state file, so nothing was tried: {tail(runs[0].stderr)}")
    if leaks:
        raise Broken(f"the API key is written or printed in: {', '.join(leaks)}")


EVIL = """from pathlib import Path
Path(__file__).with_name("ran").write_text("validate ran this file")  # what any top level could do

def f(prompts, completions, **columns):
    return [0.0] * len(completions)
"""


def validate_runs_no_code(scene: Scene) -> None:
    """`config validate` with reward_funcs naming `evil.py:f` and then `evil.py:g` (absent): valid, then exit
    2 naming 'g'; evil.py's top level never runs."""
    (scene.work / "x").mkdir()
    (scene.work / "x" / "evil.py").write_text(EVIL)
    for function in ("f", "g"):
        reward = f"reward_funcs: ['{scene.work / 'x' / 'evil.py'}:{function}']\n"
        (scene.work / f"{function}.yaml").write_text(f"model: tiny\ndataset: tiny:toy\n{reward}")
    valid = scene.cli("valid", "config", "validate", "--plugin", "grpo", "--config", "f.yaml")
    if valid.wait(RUN_TIMEOUT[False]) != 0:
        raise Broken(f"validating a config naming evil.py:f failed: {tail(valid.stderr)}")
    line = clear_error(scene.cli("absent", "config", "validate", "--plugin", "grpo", "--config", "g.yaml"), 2,
                       RUN_TIMEOUT[False], match="'g'")
    scene.notes.append(line[:200])
    if (scene.work / "x" / "ran").exists():
        raise Broken("config validate imported evil.py: its top level ran")


REWARDS = """import math, pathlib, sys, time

def hangs(prompts, completions, **kw):
    pathlib.Path("reward-started").touch()
    while True:  # a judge that never answers
        time.sleep(0.05)

def nan(prompts, completions, **kw):
    return [math.nan] * len(completions)

def huge(prompts, completions, **kw):
    return [1e200] * len(completions)

def leaves(prompts, completions, **kw):
    sys.exit(0)

def constant(prompts, completions, **kw):
    return [1.0] * len(completions)
"""


def bad_reward(name: str, match: str, *extra: str) -> Callable[[Scene], None]:
    """A reward function of rewards.py (NaN or 1e200 for every completion, sys.exit(0), a constant under
    strict_rewards, one past reward_timeout_s): the run ends with exit 1 and one error naming the cause,
    never exit 0 with the weights unchanged."""

    def scenario(scene: Scene) -> None:
        (scene.work / "rewards.py").write_text(REWARDS)
        run = scene.run("first", f"reward_funcs=[./rewards.py:{name}]", *extra)
        scene.notes.append(clear_error(run, 1, RUN_TIMEOUT[False], match=match)[:200])

    return scenario


def hanging_reward_then_signal(ray: bool, sig: signal.Signals = signal.SIGINT) -> Callable[[Scene], None]:
    """A reward function that never returns (reward_timeout_s at its default, 600 s), then `sig` once: the run
    ends within 10 s with the signal's status, saying why, no traceback; no Ray process outlives it."""

    def scenario(scene: Scene) -> None:
        (scene.work / "rewards.py").write_text(REWARDS)
        run = scene.run("first", "reward_funcs=[./rewards.py:hangs]", ray=ray)
        wait_for(lambda: (scene.work / "reward-started").exists(), run, RUN_TIMEOUT[ray], "the reward call")
        os.kill(run.pid, sig)
        signalled = time.monotonic()
        rc = run.wait(EXIT_TIMEOUT)
        took, err = time.monotonic() - signalled, run.stderr
        expected = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}[sig]
        said = [line for line in err.splitlines() if line.startswith("rlcore: stopped by")]
        if rc != expected or not said or "reward function ran" not in said[0] or "Traceback" in err or took > 10:
            raise Broken(f"exit {rc} (expected {expected}) {took:.1f}s after {sig.name}{traced(err)}: {tail(err)}")
        scene.notes.append(f"exit {rc} {took:.1f}s after {sig.name}: {said[0][:160]}")
        scene.settled(run)

    return scenario


def nothing_at_ray_address(scene: Scene) -> None:
    """ray_address where nothing listens: exit 1 within QUICK_ERROR_S + 10 s, naming the address."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = scene.run("first", f"ray_address=127.0.0.1:{port}", ray=True)
    line = clear_error(run, 1, QUICK_ERROR_S + 60, match=rf"ray_address '127.0.0.1:{port}': nothing answers")
    took = time.monotonic() - run.started
    scene.notes.append(f"{took:.1f}s: {line[:160]}")
    if took > QUICK_ERROR_S + 10:
        raise Broken(f"refused only after {took:.0f}s")


def negative_step(out: Path) -> str:
    file = out / "checkpoint-4" / "trainer_state.json"
    state = json.loads(file.read_text())
    file.write_text(json.dumps({**state, "step": -1}))
    return "checkpoint-4's trainer_state.json says step -1"


def run_log_symlink(scene: Scene) -> None:
    """output_dir/run.log a symbolic link to a user's file: refused naming it, the file untouched."""
    scene.out.mkdir()
    mine = scene.work / "notes.txt"
    mine.write_text("a user's notes\n")
    (scene.out / "run.log").symlink_to(mine)
    line = clear_error(scene.run("first"), 1, RUN_TIMEOUT[False], match="run.log is a symbolic link")
    scene.notes.append(line[:160])
    if mine.read_text() != "a user's notes\n":
        raise Broken("rlcore wrote into the file run.log links to")


def run_record(out: Path) -> dict:
    """output_dir's rlcore_run.json ({} where there is none or it is not JSON)."""
    try:
        return json.loads((out / "rlcore_run.json").read_text())
    except (OSError, ValueError):
        return {}


def resume_of_a_finished_run(scene: Scene) -> None:
    """--resume of a run that reached max_steps trains nothing, says the run is finished and where its model is, and
    succeeds (a rerun of a finished job's command line is not an error); its rlcore_run.json stays byte for byte (it
    said "running" afterwards)."""
    scene.finished_run()
    before = (scene.out / "rlcore_run.json").read_bytes()
    run = scene.run("again", f"max_steps={BASE_STEPS}", resume=True)
    rc = run.wait(RUN_TIMEOUT[False])
    said = next((line for line in run.stderr.splitlines() if "is finished" in line), "")
    if rc != 0 or "Nothing to resume" not in said or "Traceback" in run.stderr:
        raise Broken(f"again: exit {rc}, expected 0 with 'is finished ... Nothing to resume': {tail(run.stderr)}")
    scene.notes.append(said[:160])
    if (scene.out / "rlcore_run.json").read_bytes() != before:
        raise Broken(f"the resume of a finished run changed rlcore_run.json to {run_record(scene.out)}")


def config_of_kind(kind: str) -> Callable[[Scene], None]:
    """`--config` naming a folder or a FIFO (a read of which would block): exit 2 in one line naming the kind."""

    def scenario(scene: Scene) -> None:
        path = scene.work / f"a-{kind}"
        path.mkdir() if kind == "folder" else os.mkfifo(path)
        quick_refusal(scene, scene.cli("cli", "config", "validate", "--plugin", "grpo", "--config", path.name),
                      match=rf"--config {path.name}: is a {kind}")

    return scenario


def broken_chat_template(scene: Scene) -> None:
    """A model whose chat template has a Jinja syntax error: run and validate refuse it in one line (a 49-line
    traceback from encode before)."""
    scene.finished_run()
    model = scene.work / "broken-model"
    shutil.copytree(scene.out / "final", model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }\n")
    shutil.rmtree(scene.out)
    quick_refusal(scene, scene.run("run", f"model={model}"), match="chat template is not valid Jinja")


def plot_on_a_full_disk(scene: Scene) -> None:
    """`rlcore plot` of a run onto a full disk (a file size limit): one line, exit 1, no torn PNG (a PIL traceback
    before)."""
    scene.finished_run()
    run = Run(scene.work, "plot", [], command=("plot", str(scene.out), "-o", "curves.png"), file_size_limit=3000)
    scene.runs.append(run)
    scene.notes.append(clear_error(run, 1, RUN_TIMEOUT[False], match="cannot write")[:160])
    if list(scene.work.glob("*curves.png*")):
        raise Broken(f"a torn PNG is left: {sorted(p.name for p in scene.work.glob('*curves.png*'))}")


def overwritten_engine_state(out: Path) -> str:
    file = sorted((out / "checkpoint-4").rglob("engine_state.pt"))[0]
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(range(64))
    file.write_bytes(bytes(data))
    return f"64 bytes overwritten in the middle of {file.relative_to(out)}"


LAUGHS = "".join([f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)])
BILLION_LAUGHS = "model: tiny\ntrain:\n  engine_kwargs:\n    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol]\n" + LAUGHS
SFT_CONFIG = {"c.yaml": "model: tiny\ndataset: tiny:sft\n", "a-file": "notes\n"}


OVERLAPPING = ("device_groups={nproc_per_node: 2, a: {device: GPU, ranks: [0, 1], workers: [train]}, "
               "b: {device: GPU, ranks: [1], workers: [rollout]}}")
TPU = "device_groups={nproc_per_node: 1, a: {device: TPU, ranks: [0], workers: [train, rollout]}}"
HUGE = "device_groups={nproc_per_node: 2, g: {device: GPU, ranks: 'range(0, 200000000)', workers: [train, rollout]}}"


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Scene], None]
    ray: bool = False
    in_tests: bool = True  # in test_faults.py; the report runs every scenario


SCENARIOS = [
    Scenario("SIGINT to the process group (Ctrl-C), local",
             signal_driver(signal.SIGINT, ray=False, group=True, save_steps=0)),
    Scenario("SIGTERM to the driver, local", signal_driver(signal.SIGTERM, ray=False, group=False, save_steps=1),
             in_tests=False),
    Scenario("SIGINT twice (stop at once), local", signal_twice, in_tests=False),
    Scenario("SIGTERM at startup, before step 1, local", signal_at_startup(ray=False)),
    Scenario("SIGKILL of the driver in a checkpoint write, local", kill_driver_in_checkpoint(ray=False)),
    Scenario("SIGHUP to the driver (a closed terminal), local",
             signal_driver(signal.SIGHUP, ray=False, group=False, save_steps=0)),
    Scenario("a reward that never returns, then SIGINT, local", hanging_reward_then_signal(ray=False), in_tests=False),
    Scenario("a reward that never returns, then SIGTERM, Ray", hanging_reward_then_signal(ray=True, sig=signal.SIGTERM),
             ray=True, in_tests=False),
    Scenario("a reward past reward_timeout_s=2", bad_reward("hangs", r"reward_timeout_s=2s", "reward_timeout_s=2"),
             in_tests=False),
    Scenario("a NaN reward for every completion", bad_reward("nan", "finite number"), in_tests=False),
    Scenario("a reward of 1e200 for every completion", bad_reward("huge", "finite number"), in_tests=False),
    Scenario("a reward function calling sys.exit(0)", bad_reward("leaves", "tried to end the process"), in_tests=False),
    Scenario("a constant reward under strict_rewards (nothing trained)",
             bad_reward("constant", "trained anything", "strict_rewards=true", "max_steps=2"), in_tests=False),
    Scenario("trainer_state.json with step -1 in the newest checkpoint", damaged(negative_step, r"checkpoint-4 is damaged"),
             in_tests=False),
    Scenario("output_dir/run.log a symbolic link to a user's file", run_log_symlink, in_tests=False),
    Scenario("truncated model .safetensors in the newest checkpoint",
             damaged(truncated_safetensors, r"checkpoint-4 is damaged.*resuming from checkpoint-3")),
    Scenario("truncated engine_state.pt in the newest checkpoint",
             damaged(truncated_engine_state, r"checkpoint-4 is damaged.*resuming from checkpoint-3"),
             in_tests=False),
    Scenario("trainer_state.json not JSON in the newest checkpoint",
             damaged(state_not_json, r"checkpoint-4 is damaged.*resuming from checkpoint-3")),
    Scenario("torn last line of metrics.jsonl", damaged(torn_metrics, r"torn")),
    Scenario("every checkpoint damaged", every_checkpoint_damaged, in_tests=False),
    Scenario("--resume with a changed num_generations", changed_on_resume, in_tests=False),
    Scenario("--resume with a changed learning_rate (applied)", changed_learning_rate),
    Scenario("a NaN loss in step 3 (the run stops)", nonfinite_step(skip=False)),
    Scenario("a NaN loss in step 3, on_nonfinite=skip", nonfinite_step(skip=True), in_tests=False),
    Scenario("stale lock, its pid reused by another process", stale_lock("other"), in_tests=False),
    Scenario("stale lock, its pid is the new driver's (restarted container)", stale_lock("self")),
    Scenario("stale lock of another host (a node that died)", stale_lock("host")),
    Scenario("disk full in a checkpoint write", disk_full),
    Scenario("two concurrent runs into one output_dir", concurrent_runs),
    Scenario("bad config: beta=true", bad_config("beta=true", match="beta")),
    Scenario("bad config: learning_rate=.inf", bad_config("learning_rate=.inf", match="learning_rate")),
    Scenario("bad config: a NaN in train.engine_kwargs",
             bad_config("train.engine_kwargs={adam_epsilon: .nan}", match="engine_kwargs"), in_tests=False),
    Scenario("bad config: ranks range(0, 200000000)",
bad_config(HUGE, match="ranks")),
    Scenario("bad config: overlapping ranks", bad_config(OVERLAPPING, match="both claim")),
    Scenario("bad config: device TPU", bad_config(TPU, match="TPU")),
    Scenario("bad config: unknown reward", bad_config("reward_funcs=[vowel_ratio]", match="vowel_ratio")),
    Scenario("bad config: missing model path", bad_config("model=./no-such-model", match="no-such-model")),
    Scenario("bad config: misspelled key", bad_config("num_generation=4", match="num_generations")),
    Scenario("bad config: num_generations does not divide the batch",
             bad_config("num_generations=5", match="num_generations")),
    Scenario("bad config: missing dataset", bad_config("dataset=./no-such.jsonl", match="no-such.jsonl")),
    Scenario("bad config: a !!python tag", bad_config("seed=!!python/object/apply:os.getpid []", match="seed|python")),
    Scenario("bad config: a key given twice in the YAML file",
             bad_config("--config", "./config.yaml", match="given twice, on line 1 and line 3",
                        config="learning_rate: 1e-3\nseed: 1\nlearning_rate: 2e-3\n")),
    Scenario("ray_address where nothing listens", nothing_at_ray_address, in_tests=False),
    Scenario("bad config: --config file missing", bad_config("--config", "./missing.yaml", match="missing.yaml")),
    Scenario("bad config: --config not YAML",
             bad_config("--config", "./config.yaml", match="config.yaml", config="learning_rate: [1e-3\nseed: 1\n")),
    Scenario("bad config: --resume into an empty dir",
             bad_config(match="no checkpoint", resume=True, existing_dir=True)),
    Scenario("bad config: --resume into a missing dir", bad_config(match="no checkpoint", resume=True)),
    Scenario("bad config: --config not UTF-8",
             bad_config("--config", "./config.yaml", match="UTF-8", config=b"seed: 1\n# caf\xe9\n")),
    Scenario("bad config: a .jsonl dataset not UTF-8",
             bad_config("dataset=./data.jsonl", match="UTF-8", files={"data.jsonl": NOT_UTF8})),
    Scenario("bad config: a .json dataset not UTF-8",
             bad_config("dataset=./data.json", match="UTF-8", files={"data.json": b"[" + NOT_UTF8.strip() + b"]"})),
    Scenario("bad config: output_dir is a file", bad_config("output_dir=./a-file", match="a-file",
                                                            files={"a-file": b"notes"})),
    Scenario("bad config: output_dir under a file", bad_config("output_dir=./a-file/run", match="a-file",
                                                               files={"a-file": b"notes"})),
    Scenario("bad config: output_dir read-only", read_only_output_dir),
    Scenario("bad config: config validate --plugin sft without TRL",
             refused_cli("config", "validate", "--plugin", "sft", "--config", "c.yaml", match=r"rlcore\[sft\]",
                         files={"c.yaml": "model: tiny\ndataset: tiny:sft\nseed: 1\n", **NO_TRL}, env={"PYTHONPATH": "no-trl"})),
    Scenario("bad config: a hub model id, the Hub unreachable",
             refused_cli("config", "validate", "--plugin", "grpo", "--config", "c.yaml", match="cannot be reached",
                         files={"c.yaml": "model: rlcore-fault/no-such-model\n"}, env=OFFLINE_HUB)),
    Scenario("bad config: a hub model id, HF_HUB_OFFLINE=1",
             refused_cli("config", "validate", "--plugin", "grpo", "--config", "c.yaml", match="HF_HUB_OFFLINE",
                         files={"c.yaml": "model: rlcore-fault/no-such-model\n"}, env={"HF_HUB_OFFLINE": "1"})),
    Scenario("config validate of a reward file.py:function runs none of it", validate_runs_no_code),
    Scenario("bad config: worker_timeout_s=1e300 (Ray's OverflowError)",
             bad_config("worker_timeout_s=1e300", match="worker_timeout_s"), in_tests=False),
    Scenario("bad config: seed=4294967296", bad_config("seed=4294967296", match="seed"), in_tests=False),
    Scenario("bad config: an integer of 5000 digits", bad_config("seed=" + "9" * 5000, match="5000 digits"),
             in_tests=False),
    Scenario("bad config: device_groups ranks 99999999999, rlcore plan",
             refused_cli("plan", "--plugin", "grpo", "--config", "c.yaml", match="device_groups.g.ranks",
                         files={"c.yaml": "model: tiny\ndevice_groups: {nproc_per_node: 8, g: {device: GPU, ranks: "
                                "99999999999, workers: [train, rollout]}}\n"}), in_tests=False),
    Scenario("bad config: a billion laughs in --config",
             bad_config("--config", "./config.yaml", match="aliases.*expand to more than", config=BILLION_LAUGHS),
             in_tests=False),
    Scenario("bad config: --config a folder", config_of_kind("folder"), in_tests=False),
    Scenario("bad config: --config a FIFO", config_of_kind("FIFO"), in_tests=False),
    Scenario("bad config: RLCORE_DATA_CACHE a file, sft",
             refused_cli("config", "validate", "--plugin", "sft", "--config", "c.yaml", match="RLCORE_DATA_CACHE",
                         files=SFT_CONFIG, env={"RLCORE_DATA_CACHE": "a-file"}), in_tests=False),
    Scenario("bad config: RLCORE_PLUGINS a file",
             refused_cli("config", "validate", "--plugin", "grpo", "--config", "c.yaml", match="RLCORE_PLUGINS",
                         files=SFT_CONFIG, env={"RLCORE_PLUGINS": "./a-file"}), in_tests=False),
    Scenario("bad config: a chat template with a Jinja syntax error", broken_chat_template, in_tests=False),
    Scenario("engine_state.pt overwritten mid-file in the newest checkpoint",
             damaged(overwritten_engine_state, r"checkpoint-4 is damaged.*resuming from checkpoint-3"), in_tests=False),
    Scenario("--resume of a finished run: nothing to do, rlcore_run.json as it was", resume_of_a_finished_run,
             in_tests=False),
    Scenario("rlcore plot onto a full disk", plot_on_a_full_disk, in_tests=False),
    Scenario("a user's folder named checkpoint-1 in output_dir", user_checkpoint_folder),
    Scenario("a second run (another seed) into one output_dir 1.6 s later", late_second_run(1.6)),
    Scenario("the distill api_key given on the command line, then --resume with another", distill_api_key),
    Scenario("SIGTERM to the driver, Ray", signal_driver(signal.SIGTERM, ray=True, group=False, save_steps=0),
             ray=True, in_tests=False),
    Scenario("SIGINT to the process group (Ctrl-C), Ray",
             signal_driver(signal.SIGINT, ray=True, group=True, save_steps=2), ray=True, in_tests=False),
    # Ray's DashboardAgent and RuntimeEnvAgent outlived the driver here until rlcore ended its Ray's process groups
    Scenario("SIGTERM at startup, before step 1, Ray", signal_at_startup(ray=True), ray=True),
    Scenario("SIGTERM to the process group (kill -TERM -PGID), Ray",
             signal_driver(signal.SIGTERM, ray=True, group=True, save_steps=0), ray=True),
    Scenario("SIGTERM to every process of the run (Slurm's scancel), Ray", sigterm_every_process, ray=True,
             in_tests=False),
    Scenario("SIGKILL of the rollout worker in generate()", kill_worker("rollout", "generate", after_step=2), ray=True,
             in_tests=False),
    Scenario("SIGKILL of the train worker twice, the rollout worker and the reward worker, max_restarts=2",
             survive_lost_workers, ray=True, in_tests=False),  # two Ray runs (77-200 s): the report runs it
    Scenario("SIGKILL of the rollout worker in update_weights()", kill_worker("rollout", "update_weights"),
             ray=True, in_tests=False),
    Scenario("SIGKILL of the train worker in train_step()", kill_worker("train", "train_step", after_step=2),
             ray=True, in_tests=False),
    Scenario("SIGKILL of the train worker in save() (checkpoint write)", kill_worker("train", "save", after_step=2),
             ray=True, in_tests=False),
    # 30 s, not 10: the timeout bounds every call, the workers' __init__ (a fresh Ray worker importing torch and
    # transformers) too, which took over 10 s on a busy 2-core machine and ended the run before the fault
    Scenario("SIGSTOP of the rollout worker in generate(), worker_timeout_s=30",
             kill_worker("rollout", "generate", signal.SIGSTOP, after_step=2, timeout_s=30), ray=True),
    Scenario("SIGSTOP of the train worker in train_step(), worker_timeout_s=10",
             kill_worker("train", "train_step", signal.SIGSTOP, after_step=2, timeout_s=10), ray=True, in_tests=False),
    Scenario("SIGSTOP of the rollout worker in update_weights(), worker_timeout_s=10",
             kill_worker("rollout", "update_weights", signal.SIGSTOP, after_step=2, timeout_s=10), ray=True,
             in_tests=False),
    Scenario("SIGKILL of the train worker in export_weights()", kill_worker("train", "export_weights", after_step=2),
             ray=True, in_tests=False),
    Scenario("SIGKILL of the raylet, Ray", kill_ray_process("raylet"), ray=True, in_tests=False),
    Scenario("SIGKILL of the GCS, Ray", kill_ray_process("gcs_server"), ray=True),
    Scenario("SIGSTOP of the raylet, worker_timeout_s=20, Ray", stop_raylet(timeout_s=20), ray=True, in_tests=False),
    # the one in CI: a stopped raylet and Ctrl-C with the default worker_timeout_s (1800 s) ended 72 s after the
    # signal, its message cut mid-word, until the wait for a worker's result after a signal probed Ray itself
    Scenario("SIGSTOP of the raylet, then SIGINT, Ray", stop_raylet(signals=1, sig=signal.SIGINT), ray=True),
    Scenario("SIGSTOP of the raylet, then SIGTERM, worker_timeout_s=20, Ray", stop_raylet(timeout_s=20, signals=1),
             ray=True, in_tests=False),
    Scenario("SIGSTOP of the raylet, then SIGTERM twice, Ray", stop_raylet(signals=2), ray=True, in_tests=False),
    Scenario("SIGKILL of the driver in a checkpoint write, Ray", kill_driver_in_checkpoint(ray=True), ray=True,
             in_tests=False),
]


def run_scenario(scenario: Scenario, keep: bool = False) -> Outcome:
    """Run one scenario in a fresh temp dir (removed afterwards unless `keep`) and say how it ended."""
    work = Path(tempfile.mkdtemp(prefix="rlcore-fault-"))
    scene = Scene(work)
    started = time.monotonic()
    survived, hang, detail = False, False, ""
    try:
        scenario.run(scene)
        survived = True
    except Hang as exc:
        hang, detail = True, f"hang: {exc}"
    except Broken as exc:
        detail = str(exc)
    finally:
        scene.close()
    lost = steps_lost(scene.out) if scene.resumed else 0
    if scene.resumed and lost:
        survived = False
        scene.notes.append(f"metrics.jsonl steps: {metrics_steps(scene.out)}")
    detail = "; ".join(filter(None, [detail, *scene.notes]))
    if keep:
        detail += f" [kept {work}]"
    else:
        shutil.rmtree(work, ignore_errors=True)
    return Outcome(scenario.name, survived, hang, lost, round(time.monotonic() - started, 1), detail)
