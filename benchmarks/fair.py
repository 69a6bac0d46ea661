"""What the benchmarks share to make a comparison fair: rlcore's side run as a user runs it (`rlcore run` on a
shipped example YAML, scaled to the host, with only the keys both sides share set: `scaled`, `user_config`,
`rlcore_run`, `provenance`), the sides interleaved in rounds with each round's ratio, their median and range
(`interleave`, `spread`); the same step clock on both sides (a plugin given to `rlcore run` with --with; a
transformers TrainerCallback for TRL's), the same stop tokens, the same synthetic chat data, the same profiler
wrapper in whichever process trains; and what keeps a short GPU lease from being wasted: each benchmark's `--smoke`
(tiny models on the CPU, the GPU run's configs built and checked there too), results written after every side, a
failed side recorded beside the others. The scripts import it as `fair` (they run as `python
benchmarks/<name>.py`, with this folder on sys.path)."""

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
    """An rlcore plugin: `start()` just before `fit()`, then the time at every step's end (`stamps`; this process's
    CPU time in `cpu_stamps`) and the step's metrics (`rows`)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []
        self.rows: list[dict[str, Any]] = []

    def start(self) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        self.rows.append(dict(metrics))

    def step_s(self) -> list[float]:
        """Each step's seconds."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def step_cpu_s(self) -> list[float]:
        """Each step's CPU seconds in this process, all its threads: on a shared machine, less moved by the others'
        load than the wall time (work done in other processes, Ray workers', is not counted)."""
        return [b - a for a, b in zip(self.cpu_stamps, self.cpu_stamps[1:])]


def trainer_clock(log_key: str | None = None) -> Any:
    """A transformers TrainerCallback with the same `stamps` (train begin, then every step's end) and
    `step_s()`, keeping each log that has `log_key` in `logs`."""
    from transformers import TrainerCallback

    class TrainerClock(TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu_stamps: list[float] = []
            self.logs: list[dict[str, Any]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())
            self.cpu_stamps.append(time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())
            self.cpu_stamps.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if log_key is not None and logs and log_key in logs:
                self.logs.append(dict(logs))

        def step_s(self) -> list[float]:
            return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

        def step_cpu_s(self) -> list[float]:
            return [b - a for a, b in zip(self.cpu_stamps, self.cpu_stamps[1:])]

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


# -- mixed lengths and model-FLOP utilisation -----------------------------------------------------------------

H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA H200 SXM, dense bf16 tensor-core peak (no sparsity)


def nudge_to_stop(model: str, median: int, limit: int, device: str = "cpu", rows: int = 64, seed: int = 0) -> dict:
    """Make a random model's sampled completions stop after a long-tailed number of tokens, the same for every side
    (they all load this checkpoint): the output row of its first stop token becomes `alpha` x the mean direction u
    of its last hidden states, so the stop token's logit is alpha x (h . u), which varies with the context; alpha is
    found by bisection so that the median length is `median` of `limit`. The lengths are estimated on random
    continuations (a random model samples near-uniformly), teacher-forced: per position the stop probability
    sigmoid(alpha h.u - logsumexp of the other logits), per row the survival product. Returns the estimate (alpha,
    quantiles, the share reaching `limit`). Run it after `same_stop_tokens` and before any side loads the model."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    stop = GenerationConfig.from_pretrained(model).eos_token_id
    stop = [stop] if isinstance(stop, int) else list(stop)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    saved_dtype = json.loads((Path(model) / "config.json").read_text()).get("dtype", "float32")
    vocab = lm.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(vocab) if i not in set(stop)])
    ids = allowed[torch.randint(0, len(allowed), (rows, 16 + limit), generator=g)].to(device)
    with torch.no_grad():
        hidden = lm.model(input_ids=ids).last_hidden_state[:, 15:15 + limit].float()  # predicting completion token t
        logits = lm.get_output_embeddings()(hidden)
        logits[..., stop] = -torch.inf
        others = torch.logsumexp(logits, dim=-1)
        del logits
        u = hidden.mean(dim=(0, 1))
        u = u / u.norm()
        score = hidden @ u  # [rows, limit]

    def lengths(alpha: float) -> torch.Tensor:
        hazard = torch.sigmoid(alpha * score - others)
        survive = torch.cumprod(1 - hazard, dim=1)  # P(no stop through token t)
        return survive.mean(dim=0)  # over rows: P(length > t)

    def median_of(alpha: float) -> int:
        below = (lengths(alpha) < 0.5).nonzero()
        return int(below[0]) + 1 if len(below) else limit

    low, high = 0.0, 1.0
    while median_of(high) > median and high < 1e6:
        high *= 2
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if median_of(mid) > median else (low, mid)
    alpha = high
    survive = lengths(alpha).cpu()
    with torch.no_grad():
        lm.get_output_embeddings().weight[stop[0]] = (alpha * u).to(lm.get_output_embeddings().weight.dtype)
    lm.to(getattr(torch, saved_dtype)).save_pretrained(model)

    def quantile(q: float) -> int:
        below = (survive < 1 - q).nonzero()
        return int(below[0]) + 1 if len(below) else limit

    return {"alpha": round(alpha, 4), "stop_token": stop[0], "median_tokens": median_of(alpha), "limit": limit,
            "p10": quantile(0.1), "p90": quantile(0.9), "p99": quantile(0.99),
            "reach_limit": round(float(survive[-1]), 4), "mean_tokens": round(float(survive.sum()) + 0.0, 1),
            "how": "the stop token's output row = alpha x the mean direction of the last hidden states; lengths "
                   "estimated on random continuations, teacher-forced"}


def nudge_on(device: str, model: str, median: int, limit: int) -> dict:
    """`nudge_to_stop` in a child process on `device` (the parent keeps no CUDA memory); its estimate."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from fair import nudge_to_stop; "
            "print(json.dumps(nudge_to_stop(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), model, str(median), str(limit), device],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_flops_per_token(model: str, context: float, forward_only: bool = False) -> float:
    """Model FLOPs of one token through `model`'s train phase: 6 x its matmul weights (every linear layer and the LM
    head, not the input embedding: forward 2, backward 4) plus attention's scores and values over `context`
    positions (the mean a token attends to: half its sequence, causal), 12 x layers x attention width x context;
    `forward_only` (a teacher): a third of that. Padding is not counted: what a side computes on pads is its waste."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    weights = sum(m.weight.numel() for m in lm.modules() if isinstance(m, torch.nn.Linear))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = text.num_attention_heads * (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    flops = 6 * weights + 12 * text.num_hidden_layers * width * context
    return flops / 3 if forward_only else flops


def mfu(tokens: float, flops_per_token: float, seconds: float, peak: float = H200_BF16_DENSE_FLOPS) -> float:
    """Model-FLOP utilisation: the useful FLOPs of `tokens` in `seconds` over the device's peak."""
    return tokens * flops_per_token / seconds / peak if seconds > 0 else float("nan")


def train_phase_clock(trainer: Any) -> Any:
    """TRL's train phase per optimizer step: the seconds in `training_step` less those in `_prepare_inputs` (TRL's
    GRPO and distillation trainers generate and score there), the device synchronised at each end; a
    TrainerCallback whose `seconds` holds one value a step (the optimizer's step itself is not in it; rlcore's
    time/train holds it)."""
    import torch
    from transformers import TrainerCallback

    class TrainPhase(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.step = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(self.step)
            self.step = 0.0

    phase = TrainPhase()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(method: Any, sign: float) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                sync()
                phase.step += sign * (time.perf_counter() - start)
        return wrapper

    trainer.training_step = timed(trainer.training_step, 1.0)
    trainer._prepare_inputs = timed(trainer._prepare_inputs, -1.0)
    trainer.add_callback(phase)
    return phase


def prompt_tokens(model: str, prompts: list[Any]) -> float:
    """The mean length in tokens of `prompts` (chat messages through the model's chat template, or text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
               if isinstance(p, list) else len(tokenizer(p)["input_ids"]) for p in prompts]
    return sum(lengths) / max(len(lengths), 1)


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


# A sitecustomize on the PYTHONPATH of a side's run (its driver, the Ray workers that inherit the environment, a
# TRL child) that wraps {cls}.{method} as soon as {module} is imported, in whichever process calls it, profiles its
# call number {nth} (0-based) with `profile_nth_call` and writes the table to {out}.
PROFILE_SITE = '''
import importlib.abc, importlib.util, json, sys
sys.path.insert(0, {fair!r})


def _patch(module):
    from fair import profile_nth_call
    owner, sink = getattr(module, {cls!r}), {{}}
    profile_nth_call(owner, {method!r}, {nth}, sink)
    profiled = getattr(owner, {method!r})

    def wrapped(*args, **kwargs):
        out = profiled(*args, **kwargs)
        if "table" in sink and not sink.get("written"):
            sink["written"] = True
            with open({out!r}, "w") as f:
                json.dump({{k: v for k, v in sink.items() if k != "written"}}, f)
        return out

    setattr(owner, {method!r}, wrapped)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != {module!r}:
            return None
        sys.meta_path.remove(self)  # once: the real spec, its loader patching the module after it runs
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


def profile_env(tmp: Path, side: str, nth: int, target: tuple[str, str, str]) -> tuple[dict[str, str], Path]:
    """The environment that profiles call `nth` (0-based) of `target` (module, class, method) in whichever process of
    `side`'s run makes it, and the file its table goes to (`read_profile`)."""
    module, cls, method = target
    out, site = tmp / f"profile-{side}.json", tmp / f"site-{side}"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(PROFILE_SITE.format(fair=str(Path(__file__).resolve().parent), module=module,
                                                               cls=cls, method=method, nth=nth, out=str(out)))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}, out


def read_profile(out: Path, what: str = "training_step") -> dict | None:
    """The profiled call ({seconds, self_cuda_s, self_cpu_s, table}), printed; None if it was not written."""
    if not out.is_file():
        return None
    found = json.loads(out.read_text())
    print(f"\n{out.stem}: one {what} under torch's profiler, {found['seconds']:.3f} s "
          f"(CUDA busy {found.get('self_cuda_s', 0):.3f} s, CPU {found['self_cpu_s']:.3f} s)\n{found['table']}")
    return found


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


def run_child(cmd: list[str], env: dict[str, str] | None = None, stdout: Any = None) -> None:
    """Run `cmd` with its output passed through as it comes (its stdout to `stdout` where given); on a non-zero exit,
    a CalledProcessError that carries the end of the child's stderr (its traceback), for the side's results row."""
    tail: collections.deque[str] = collections.deque(maxlen=400)
    with subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace") as child:
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


# -- rlcore's side as a user runs it: a shipped example YAML, scaled to this host, the shared keys set ------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "ray"

# The step clock of a side run through `rlcore run`: a plugin file given with --with, loaded in the driver, that
# writes the training's start, each step's end time and numeric metrics to {out} after every step.
CLOCK_PLUGIN = '''
"""The benchmark's step clock: when training starts (workers and engines up), each step's end (perf_counter) and
numeric metrics, written to {out}."""
import json, time
from rlcore import hookimpl

LOADED, clock = time.perf_counter(), {{"rows": [], "start": None, "setup_s": None}}


def _write():
    with open({out!r}, "w") as f:
        json.dump(clock, f)


_write()  # an algorithm without steps (sample) leaves it so


@hookimpl
def rlcore_train_start(trainer):
    clock["setup_s"], clock["start"] = time.perf_counter() - LOADED, time.perf_counter()
    _write()


@hookimpl
def rlcore_step_end(trainer, step, metrics):
    numbers = {{k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}}
    clock["rows"].append({{"step": step, "t": time.perf_counter(), "metrics": numbers}})
    _write()
'''


def override(key: str, value: Any) -> str:
    """`key=value` as `rlcore run` takes it, the value written as YAML (JSON is YAML; floats keep their exponent)."""
    return f"{key}={json.dumps(value)}"


def overrides_of(keys: dict[str, Any]) -> list[str]:
    return [override(key, value) for key, value in keys.items()]


def example_path(example: str) -> Path:
    """A shipped example, `examples/ray/<example>`."""
    path = EXAMPLES / example
    if not path.is_file():
        raise SystemExit(f"the example {path} does not exist; the benchmark runs the shipped examples")
    return path


def scaled(example: str, gpus: int) -> dict[str, Any]:
    """The keys that put every role of `example` on `gpus` GPUs of this host, all sharing them (colocated): each
    role section's `gpus`, and in the device_groups form `nproc_per_node` and each group's ranks. `gpus=0` is the
    CPU (--smoke): each role on the CPU, a device group a CPU group of one process, no colocation (GPU roles only)."""
    from rlcore.config import read_config_data

    data = read_config_data(example_path(example))[0]
    keys: dict[str, Any] = {}
    for name, section in data.items():
        if isinstance(section, dict) and "gpus" in section:
            keys[f"{name}.gpus"] = gpus
    if data.get("colocate_groups") and gpus == 0:
        keys["colocate_groups"] = []
    if "nnodes" in data:
        keys["nnodes"] = 1
    if "nproc_per_node" in data:
        keys["nproc_per_node"] = max(gpus, 1)
    if data.get("ray_address"):
        keys["ray_address"] = None  # a cluster's address: this host starts its own
    groups = data.get("device_groups") or {}
    if groups:
        keys["device_groups.nproc_per_node"] = max(gpus, 1)
    for name, group in groups.items():
        if isinstance(group, dict) and "ranks" in group:
            if gpus:
                keys[f"device_groups.{name}.ranks"] = list(range(gpus))
            else:
                keys[f"device_groups.{name}.device"], keys[f"device_groups.{name}.ranks"] = "CPU", 1
    return keys


def user_config(algorithm: str, example: str, keys: dict[str, Any]) -> Any:
    """rlcore's config of `rlcore run --plugin ALGORITHM --config examples/ray/EXAMPLE KEY=VALUE...`, loaded and
    checked as `rlcore config validate` does (the CLI's loader, the plugins' `rlcore_configure`, the trainer's
    checks of plan, data and model): a GPU run's config fails here, on the CPU, before a GPU is taken."""
    import argparse

    from rlcore.cli import _configured
    from rlcore.extras import check_run

    args = argparse.Namespace(plugin=[algorithm], config=str(example_path(example)), overrides=overrides_of(keys),
                              use_ray=True, from_ms_swift=None)
    plugins, algorithm, config = _configured(args)
    check_run(plugins, algorithm, config, engines=False)
    check = getattr(plugins.algorithms.get(algorithm).trainer, "check", None)
    if check is not None:
        check(config, plugins)
    return config


def rlcore_run(algorithm: str, example: str, keys: dict[str, Any], tmp: Path, name: str, use_ray: bool = True,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `rlcore run --plugin ALGORITHM [--use-ray] --config examples/ray/EXAMPLE KEY=VALUE...` in a process of its
    own, with the step clock (`CLOCK_PLUGIN`) given by --with: {step_s, rows (each step's metrics), setup_s (the CLI's
    start to the first step: config, Ray, workers, engines), wall_s, cmd}."""
    out, plugin = tmp / f"clock-{name}.json", tmp / f"clock_{name.replace('-', '_')}.py"
    out.unlink(missing_ok=True)
    plugin.write_text(CLOCK_PLUGIN.format(out=str(out)))
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", algorithm, "--with", str(plugin),
           *(["--use-ray"] if use_ray else []), "--config", str(example_path(example)), *overrides_of(keys)]
    started = time.perf_counter()
    # the run's final metrics line goes to stderr: the benchmark's stdout is its own rows and table
    run_child(cmd, {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}, stdout=sys.stderr)
    clock = json.loads(out.read_text())
    stamps = [clock["start"]] + [row["t"] for row in clock["rows"]] if clock["start"] is not None else []
    return {"step_s": [b - a for a, b in zip(stamps, stamps[1:])], "rows": [row["metrics"] for row in clock["rows"]],
            "setup_s": clock["setup_s"] and round(clock["setup_s"], 1), "wall_s": round(time.perf_counter() - started, 1),
            "cmd": " ".join(["rlcore", *cmd[3:]])}


def provenance(example: str, shared: dict[str, Any], scale: dict[str, Any], extra: dict[str, Any] | None = None,
               use_ray: bool = True) -> dict[str, Any]:
    """What the table says of rlcore's side: the example, the keys set on top (shared with the peer; the scaling to
    this host; any others, e.g. a side's variant) and the command."""
    keys = {**scale, **shared, **(extra or {})}
    return {"example": f"examples/ray/{example}", "use_ray": use_ray, "shared_keys": overrides_of(shared),
            "scaling_keys": overrides_of(scale), "other_keys": overrides_of(extra or {}),
            "command": " ".join(["rlcore run", *(["--use-ray"] if use_ray else []), f"--config examples/ray/{example}",
                                 *overrides_of(keys)])}


def print_provenance(record: dict[str, Any]) -> None:
    """The example and the keys set on it, under the table."""
    for label, used in (record.get("rlcore_runs") or {}).items():
        print(f"\n{label}: examples' defaults except these keys ({used['example']}, "
              f"{'--use-ray' if used['use_ray'] else 'one process'})")
        print("  shared with the peer: " + " ".join(used["shared_keys"]))
        print("  scaled to this host:  " + (" ".join(used["scaling_keys"]) or "-"))
        if used["other_keys"]:
            print("  this side's own:      " + " ".join(used["other_keys"]))


# -- rounds: the sides interleaved in one call (A, B, A, B), a ratio per round ----------------------------------


def interleave(sides: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, side) in the order they run: every side once per round, the rounds one after another, so a drift of
    the machine's speed during the call shows in the spread of the per-round ratios, not as one side's advantage."""
    return [(r, side) for r in range(rounds) for side in sides]


def spread(values: list[float]) -> dict[str, Any]:
    """The per-round values, their median and their range (min, max)."""
    import statistics

    if not values:
        return {}
    return {"per_round": [round(v, 4) for v in values], "median": round(statistics.median(values), 4),
            "min": round(min(values), 4), "max": round(max(values), 4), "rounds": len(values)}


def spread_text(s: dict[str, Any]) -> str:
    """'1.234 (1.200-1.260 over 2 rounds: 1.2, 1.26)'."""
    if not s:
        return "-"
    each = ", ".join(f"{v:.3f}" for v in s["per_round"])
    return f"{s['median']:.3f} (range {s['min']:.3f}-{s['max']:.3f} over {s['rounds']} rounds: {each})"
