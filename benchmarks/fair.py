"""What the benchmarks share to make a comparison fair: the same step clock on both sides (one for an rlcore
trainer, a plugin; one for a transformers Trainer, TRL's), the same stop tokens, the same synthetic chat
data; and what keeps a short GPU lease from being wasted: each benchmark's `--smoke` (tiny models on the CPU,
TRL's GPU config built there too), results written after every side, a failed side recorded beside the others.
The scripts import it as `fair` (they run as `python benchmarks/<name>.py`, with this folder on sys.path)."""

from __future__ import annotations

import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from rlcore import hookimpl


class StepClock:
    """An rlcore plugin: `start()` just before `fit()`, then the time at every step's end (`stamps`) and the
    step's metrics (`rows`)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.rows: list[dict[str, Any]] = []

    def start(self) -> None:
        self.stamps.append(time.perf_counter())

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        self.stamps.append(time.perf_counter())
        self.rows.append(dict(metrics))

    def step_s(self) -> list[float]:
        """Each step's seconds."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def trainer_clock(log_key: str | None = None) -> Any:
    """A transformers TrainerCallback with the same `stamps` (train begin, then every step's end) and
    `step_s()`, keeping each log that has `log_key` in `logs`."""
    from transformers import TrainerCallback

    class TrainerClock(TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.logs: list[dict[str, Any]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if log_key is not None and logs and log_key in logs:
                self.logs.append(dict(logs))

        def step_s(self) -> list[float]:
            return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    return TrainerClock()


def same_stop_tokens(model: str) -> list[int]:
    """Make TRL stop where rlcore does: rlcore stops at the tokenizer's eos and pad tokens (and the model's
    generation_config eos); TRL (generate and vLLM) at the model's generation_config eos ids, and masks after
    the first. Those become the same list, written into the model directory."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    stop = sorted({i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None})
    generation = GenerationConfig.from_pretrained(model)
    generation.eos_token_id = stop
    generation.save_pretrained(model)
    return stop


WORDS = ("the a model learns to answer questions about numbers words tables lists code and text with "
         "care every day in many ways").split()


def chat_rows(n: int, question: tuple[int, int], answer: tuple[int, int], seed: int = 0) -> list[dict]:
    """Synthetic conversations of mixed lengths: a question and an answer of between `question` and `answer`
    (low, high) words."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        asked = " ".join(rng.choices(WORDS, k=rng.randint(*question)))
        answered = " ".join(rng.choices(WORDS, k=rng.randint(*answer)))
        rows.append({"messages": [{"role": "user", "content": f"{i}: {asked}?"},
                                  {"role": "assistant", "content": answered}]})
    return rows


def profile_nth_call(owner: Any, name: str, nth: int, sink: dict[str, Any], rows: int = 30) -> None:
    """Wrap `owner.name` (a method, e.g. `HFTrainEngine.train_step`) so that its `nth` call (0-based) runs under
    torch's profiler; `sink` then holds the call's seconds and the operators that took its time (CUDA and CPU),
    as torch's table. The other calls run as they are."""
    import torch

    original, calls = getattr(owner, name), [0]

    def profiled(*args: Any, **kwargs: Any) -> Any:
        index, calls[0] = calls[0], calls[0] + 1
        if index != nth:
            return original(*args, **kwargs)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            out = original(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        sink["seconds"] = time.perf_counter() - started
        events = prof.key_averages()
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        sink["table"] = events.table(sort_by=sort, row_limit=rows)
        sink["self_cpu_s"] = sum(e.self_cpu_time_total for e in events) / 1e6
        if torch.cuda.is_available():
            sink["self_cuda_s"] = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
        return out

    setattr(owner, name, profiled)


def git_commit() -> str:
    """The checkout's commit, for a results JSON: `RLCORE_COMMIT` where set (a copy of the working tree, as the GPU
    machine gets, may have no .git or a stale one), else git's HEAD ("unknown" outside a git checkout)."""
    if os.environ.get("RLCORE_COMMIT"):
        return os.environ["RLCORE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build_model(path: Path, shape: dict[str, Any], smoke: dict[str, Any] | None = None) -> str:
    """The benchmark's random model of `shape`, drawn on the GPU (`build_on_gpu`); with `smoke` (a tiny shape), that
    tiny model on the CPU instead, in this process."""
    if smoke is None:
        return build_on_gpu(path, shape)
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(path, **smoke))


def build_on_gpu(path: Path, shape: dict[str, Any]) -> str:
    """A random model of `shape` at `path`, drawn on the GPU in a child process (seconds; the parent keeps no
    CUDA memory)."""
    code = ("import sys; from rlcore.testing import build_tiny_model; "
            f"build_tiny_model(sys.argv[1], device='cuda', **{shape!r})")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    return str(path)


def trl_args(cls: type, kwargs: dict[str, Any], smoke: dict[str, Any] | None = None) -> Any:
    """TRL's config `cls` (a `TrainingArguments` dataclass) from the GPU run's `kwargs`. With `smoke` (the CPU
    run's replacements, e.g. `use_vllm=False, bf16=False, use_cpu=True`), the GPU run's config is built first on
    the CPU (`use_cpu` added), so a field that the installed TRL lacks, or a value it refuses, fails there; then
    the config with the replacements is returned."""
    if smoke is None:
        return cls(**kwargs)
    cls(**{**kwargs, "use_cpu": True})
    return cls(**{**kwargs, **smoke})


def results_path(given: str | None, default: str, smoke: bool) -> Path:
    """Where a benchmark writes its results JSON: `--json` where given; else `default` under benchmarks/results,
    or, for `--smoke`, the same name in the system's temporary folder (a dry run's numbers are not results)."""
    if given:
        return Path(given)
    if smoke:
        return Path(tempfile.gettempdir()) / default.replace(".json", "-smoke.json")
    return Path(__file__).parent / "results" / default


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Write `record` at `path` (after every side, so a run cut short keeps the sides it finished)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def host_info() -> dict[str, Any]:
    """The machine a result came from, for comparing runs across leases: machines lent under one kind differed by
    about 1.5x in generation and step time, and both sides of these benchmarks are partly bound by Python's speed.
    The CPU's model and count, the GPUs nvidia-smi lists, and `python_loop_s`: the seconds one thread takes for a
    fixed loop of a million iterations (no CUDA is touched, so the parent of the measured runs holds no context)."""
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        models = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")]
        info["cpu"] = models[0] if models else None
    except OSError:
        info["cpu"] = None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.max.sm,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        info["gpus"] = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        info["gpus"] = []
    best = float("inf")
    for _ in range(3):
        start, total = time.perf_counter(), 0
        for i in range(1_000_000):
            total += i
        best = min(best, time.perf_counter() - start)
    info["python_loop_s"] = round(best, 4)
    return info


def free_port() -> int:
    """A TCP port free on this host now, for a child's torch.distributed rendezvous (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Run `cmd` with its output passed through as it comes; on a non-zero exit, a CalledProcessError that carries
    the end of the child's stderr (its traceback), for the side's results row."""
    tail: collections.deque[str] = collections.deque(maxlen=400)
    with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace") as child:
        for line in child.stderr:
            sys.stderr.write(line)
            tail.append(line)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, cmd, stderr="".join(tail))


def failure(error: BaseException) -> dict[str, Any]:
    """A side that failed, as its results row, so one side's crash leaves the others' results: what was raised
    and the end of its traceback, or of a failed child's stderr where the error carries it (a child whose output
    was not captured printed its own traceback in the log)."""
    if isinstance(error, subprocess.CalledProcessError):
        row: dict[str, Any] = {"failed": f"the child process exited with status {error.returncode}"}
    else:
        row = {"failed": f"{type(error).__name__}: {str(error)[:300]}"}
    tail = getattr(error, "stderr", None)
    if isinstance(tail, bytes):
        tail = tail.decode(errors="replace")
    if not tail and not isinstance(error, subprocess.CalledProcessError):
        tail = "".join(traceback.format_exception(error))
    if tail:
        row["error_tail"] = tail[-3000:]
    return row
