"""What the benchmarks share to make a comparison fair: the same step clock on both sides (one for an rlcore
trainer, a plugin; one for a transformers Trainer, TRL's), the same stop tokens, the same synthetic chat
data. The scripts import it as `fair` (they run as `python benchmarks/<name>.py`, with this folder on
sys.path)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
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
    """The checkout's commit, for a results JSON ("unknown" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build_on_gpu(path: Path, shape: dict[str, Any]) -> str:
    """A random model of `shape` at `path`, drawn on the GPU in a child process (seconds; the parent keeps no
    CUDA memory)."""
    code = ("import sys; from rlcore.testing import build_tiny_model; "
            f"build_tiny_model(sys.argv[1], device='cuda', **{shape!r})")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    return str(path)
