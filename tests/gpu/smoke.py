"""The one-GPU smoke run: every algorithm with each train engine, from the command line, in a few minutes.

    source .gpu/stage/install.sh && bash tests/gpu/run.sh smoke [--out DIR] [ROW ...]   # one H200
    bash tests/gpu/run.sh smoke --cpu                                                  # no CUDA, no vLLM

Each row is one `rlcore run ...` in a subprocess, as a user types it, with a timeout of its own; a row that
fails or hangs does not stop the others. On the GPU: GRPO with the hf and the megatron train engine
(examples/ray/grpo colocate.yaml and colocate_device_groups.yaml on Ray: vLLM sleeps, the policy offloads),
GKD with each engine (teacher_colocated.yaml: a colocated, offloaded teacher), SFT full and LoRA
(examples/ray/sft), best-of-N sampling with a vLLM sampler, and distill against a `vllm serve` this script
starts on 127.0.0.1 and stops after, serving the `final/` folder an earlier row exported (grpo-megatron's, whose
weights went megatron -> Hugging Face names), so vLLM loading what `rlcore run` writes is checked too. `--cpu` (or RLCORE_SMOKE_CPU=1) runs the same rows on the CPU, in one
process each (no Ray), with the hf rollout and sampler engines, and distill against a stand-in for `vllm serve`
(the hf engine behind the same two endpoints): the plumbing, not vLLM.

The models are tiny random Qwen2s (a student and a wider teacher) with the tiny builder's tokenizer grown to a
32k vocabulary, built once on the GPU into a temp dir and shared by every row. Every row checks what it must
have produced beyond its exit status: the steps in metrics.jsonl with a finite loss and the number that
should move (reward, JSD, loss) logged every step, or the rows of samples.jsonl.

Prints one line per row (name, PASS or FAIL, seconds, what it saw or the log's last lines; the model build is
the first row) and writes DIR/<row>.log (the run's stdout and stderr), DIR/<row>.metrics.jsonl (and
.samples.jsonl) and DIR/summary.json; DIR is --out, else $OUT, else a new temp dir. `--timeout-scale 2` doubles
every row's timeout, for a slower machine.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "ray"
STEPS = 3
TAIL_LINES = 25  # of a failed row's log, printed under its line
BUDGET_S = 480  # the default rows, on one H200 once the packages are installed
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
       "DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "RLCORE_DEBUG": "1"}

# Every vLLM engine of the smoke takes a fixed KV cache instead of sizing one from the memory it sees free: vLLM 0.26
# then skips its memory profile, so two vLLM rows can share the GPU (a profile beside another process's allocations
# counts them as its own); 1 GiB holds about 500k tokens of the student. FlashInfer's autotune (about 20 s at a
# first start, up to 70 s for `vllm serve`) tunes kernels for tiny models that nothing here times.
KV_CACHE_BYTES = 1 << 30
VLLM_KWARGS = f"{{kv_cache_memory_bytes: {KV_CACHE_BYTES}, enable_flashinfer_autotune: false}}"
# `vllm serve` warms its kernels up with max-num-seqs requests at once (1024 by default on an H200); distill.yaml
# sends at most 32 at a time (max_concurrency).
SERVE_FLAGS = ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--no-enable-flashinfer-autotune",
               "--max-num-seqs", "32"]

# head_dim 64: vLLM 0.26's warm-up hit an illegal memory access at head_dim 16 (tests/gpu/test_gkd_gpu.py)
GPU_SHAPES = {
    "student": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                    vocab_size=32000, dtype="bfloat16"),
    "teacher": dict(hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2, intermediate_size=768,
                    vocab_size=32000, dtype="bfloat16", seed=3),
    "moe": dict(arch="qwen3_moe", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                vocab_size=32000, dtype="bfloat16", seed=5),
}
CPU_SHAPES = {  # the tiny builder's default size: seconds a step on two shared cores
    "student": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "teacher": dict(hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192, seed=3),
    "moe": dict(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                seed=5),
}


class Failed(Exception):
    """A row's run finished but did not produce what it must."""


def expect(condition: object, message: str) -> None:
    if not condition:
        raise Failed(message)


# -- models and data --------------------------------------------------------------------------------------

def build_models(root: str, device: str, shapes: dict[str, dict]) -> dict[str, str]:
    """Each shape as a tiny model directory under `root`, its weights initialised on `device`."""
    import torch

    from rlcore.testing import build_tiny_model

    with torch.device(device):
        return {name: str(build_tiny_model(Path(root) / name, **shape)) for name, shape in shapes.items()}


def write_data(root: Path) -> dict[str, str]:
    """The rows' datasets: sums to answer (GRPO; sample and distill take 16 of them), prompt + completion
    pairs (GKD, SFT LoRA) and conversations (SFT)."""
    sums = [{"prompt": f"What is {a} + {b}?", "solution": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
    words = "the a model learns to answer questions about numbers and words with care".split()
    chats = [{"messages": [{"role": "user", "content": f"{i}: " + " ".join(words[i % 5:i % 5 + 6]) + "?"},
                           {"role": "assistant", "content": " ".join(words[::1 + i % 3] * (1 + i % 4))}]}
             for i in range(128)]
    pairs = [{"prompt": f"Say {i}:", "completion": f"number {i}"} for i in range(64)]
    files = {"sums": sums, "sums16": sums[:16], "chats": chats, "pairs": pairs}
    for name, rows in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {name: str(root / f"{name}.jsonl") for name in files}


# -- what a row checks ------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    expect(path.is_file(), f"no {path.name} in {path.parent}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def summary_line(log: str) -> dict:
    """The run's summary, the last JSON line it printed on stdout."""
    lines = [line for line in log.splitlines() if line.startswith('{"algorithm"')]
    expect(lines, "no summary line (the JSON `rlcore run` prints last)")
    return json.loads(lines[-1])


def trained(out: Path, log: str, moving: str, positive: tuple[str, ...] = ()) -> list[dict]:
    """metrics.jsonl has steps 1..STEPS, each with a finite loss and a finite `moving`, and `positive` keys > 0;
    the summary says the last step."""
    rows = read_jsonl(out / "metrics.jsonl")
    expect([r.get("step") for r in rows] == list(range(1, STEPS + 1)),
           f"metrics.jsonl steps {[r.get('step') for r in rows]}, expected 1..{STEPS}")
    for key in ("loss", moving, *positive):
        values = [r.get(key) for r in rows]
        expect(all(finite(v) for v in values), f"{key} not finite every step: {values}")
    for key in positive:
        expect(all(r[key] > 0 for r in rows), f"{key} not > 0 every step: {[r[key] for r in rows]}")
    expect(summary_line(log).get("step") == STEPS, f"the summary's step is not {STEPS}")
    return rows


def moved(rows: list[dict], key: str) -> str:
    return f"{key} {rows[0][key]:.4g} -> {rows[-1][key]:.4g}"


def check_grpo(placed: str) -> Callable[[Path, str], str]:
    """Trained and synced, with megatron-core's warnings in run.log, not on the console (vLLM loading the run's
    output_dir/final is the distill row's: see `served_model`)."""
    def check(out: Path, log: str) -> str:
        rows = trained(out, log, "reward", positive=("grad_norm",))
        expect(f"rlcore: {placed}" in log.splitlines(), f"no placement line 'rlcore: {placed}'")
        synced = [r.get("weight_sync/seconds") for r in rows[:-1]]  # the last step ends without a sync
        expect(all(finite(s) and s > 0 for s in synced), f"weight_sync/seconds after steps 1..{STEPS - 1}: {synced}")
        expect(all(0 < r["completions/mean_length"] for r in rows), "an empty round of completions")
        return f"{moved(rows, 'reward')}, {moved(rows, 'loss')}{library_warnings(out, log)}"
    return check


def library_warnings(out: Path, log: str) -> str:
    """A library's Python warnings (megatron-core's "Transformer Engine and Apex are not installed", from the
    train workers on Ray) are in run.log, not on the console."""
    expect("Transformer Engine and Apex are not installed" not in log, "megatron-core's TE/Apex warning on the console")
    logged = (out / "run.log").read_text(errors="replace").count("WARNING rlcore.warnings: ")
    return f", {logged} library warnings in run.log only" if logged else ""


def check_gkd(placed: str) -> Callable[[Path, str], str]:
    def check(out: Path, log: str) -> str:
        rows = trained(out, log, "jsd", positive=("jsd", "grad_norm", "time/teacher"))
        expect(f"rlcore: {placed}" in log.splitlines(), f"no placement line 'rlcore: {placed}'")
        expect(all(r.get("on_policy") == 1.0 for r in rows), "lmbda 1 but a step was not on-policy")
        return moved(rows, "jsd")
    return check


def check_sft(lora: bool) -> Callable[[Path, str], str]:
    """Full: the loss falls over the steps. LoRA: the checkpoint holds an adapter and no full model, and the
    adapter's B matrices (initialised to zero) moved; a falling loss over 3 LoRA steps is too weak to require."""
    def check(out: Path, log: str) -> str:
        rows = trained(out, log, "loss", positive=("grad_norm",))
        model = out / f"checkpoint-{STEPS}" / "model"
        expect(model.is_dir(), f"no checkpoint-{STEPS}/model")
        if not lora:
            expect(rows[-1]["loss"] < rows[0]["loss"], f"the loss did not fall: {[r['loss'] for r in rows]}")
            return moved(rows, "loss")
        from safetensors import safe_open

        adapter = model / "adapter_model.safetensors"
        expect(adapter.is_file() and not (model / "model.safetensors").exists(),
               f"checkpoint-{STEPS}/model holds {sorted(p.name for p in model.iterdir())}, not an adapter alone")
        with safe_open(str(adapter), "pt") as tensors:
            b = max(float(tensors.get_tensor(k).abs().max()) for k in tensors.keys() if "lora_B" in k)
        expect(b > 0, "the adapter's lora_B weights are still zero: the adapter did not train")
        return f"{moved(rows, 'loss')}, max |lora_B| {b:.2g}"
    return check


def check_samples(expected: int, rejected: bool) -> Callable[[Path, str], str]:
    """samples.jsonl has `expected` rows, each a dataset prompt answered by the assistant (a random model may
    answer with nothing but its stop token), with a rejected partner when candidates were scored."""
    def check(out: Path, log: str) -> str:
        rows = read_jsonl(out / "samples.jsonl")
        expect(len(rows) == expected, f"samples.jsonl has {len(rows)} rows, expected {expected}")
        expect(summary_line(log).get("rows") == expected, f"the summary's rows are not {expected}")
        for r in rows:
            first, last = r["messages"][0], r["messages"][-1]
            expect(first["content"].startswith("What is") and last["role"] == "assistant"
                   and isinstance(last["content"], str), f"a row that is not prompt + answer: {r}")
            expect(not rejected or "rejected_response" in r, f"a row without a rejected_response: {r}")
        answered = sum(bool(r["messages"][-1]["content"]) for r in rows)
        return f"{len(rows)} rows, {answered} with a non-empty answer"
    return check


# -- the rows ---------------------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    args: list[str]  # after `rlcore run`; output_dir is added
    check: Callable[[Path, str], str]  # (output_dir, log) -> what it saw; raises Failed
    timeout_s: float
    serve: bool = False  # a `vllm serve` of the student on 127.0.0.1 for the row's duration (api_base is added)
    vllm: bool = True  # starts a vLLM engine in its run: goes in one of the vLLM lanes (see `lanes`)
    lane: int = 0  # the vLLM lane (0 or 1) the row runs in beside the others
    after: tuple[str, ...] = ()  # rows (of those run) that must have ended before this one starts
    default: bool = True  # run when no rows are named
    output_key: str = "output_dir"  # where the row's run directory is given


def ms_swift_files(models: dict[str, str], data: dict[str, str], root: Path) -> dict[str, str]:
    """ms-swift-shaped YAMLs (tests/core/test_ms_swift.py's, as ms-swift's examples/ray publishes them: GRPO
    colocated, GKD with a colocated teacher), with only the model and dataset paths filled in."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ms_swift_yamls", ROOT / "tests" / "core" / "test_ms_swift.py")
    yamls = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(yamls)
    (root / "system.txt").write_text("Think step by step.")
    paths = {"out": root / "ms-swift-out", "system": root / "system.txt"}
    grpo = yamls.GRPO.format(model=models["student"], prompts=data["sums"], placement=yamls.COLOCATE, **paths)
    teacher, section = (part.format(teacher_path=models["teacher"]) for part in yamls.COLOCATED_TEACHER)
    gkd = yamls.GKD.format(student=models["student"], chats=data["chats"], teacher_model=teacher,
                           teacher_section=section, **paths)
    (root / "ms-swift-grpo.yaml").write_text(grpo)
    (root / "ms-swift-gkd.yaml").write_text(gkd)
    return {"grpo": str(root / "ms-swift-grpo.yaml"), "gkd": str(root / "ms-swift-gkd.yaml")}


def check_ms_swift(moving: str) -> Callable[[Path, str], str]:
    def check(out: Path, log: str) -> str:
        rows = trained(out, log, moving, positive=("grad_norm",))
        expect("ms-swift" in log, "no line saying the file was read as ms-swift's")
        return moved(rows, moving)
    return check


def check_moving(moving: str) -> Callable[[Path, str], str]:
    def check(out: Path, log: str) -> str:
        return moved(trained(out, log, moving, positive=("grad_norm", "time/teacher")), moving)
    return check


def make_rows(models: dict[str, str], data: dict[str, str], gpu: bool) -> list[Row]:
    """The rows, scaled to one GPU (gpu) or to the CPU. The examples' own settings stay (colocation, offload,
    sleep_level 1); the overrides only shrink them and, on the CPU, swap vLLM for the hf engines."""
    student, teacher = models["student"], models["teacher"]
    ray = ["--use-ray"] if gpu else []
    vllm = ["vllm_gpu_memory_utilization=0.3", "vllm_enforce_eager=true", "vllm_max_model_len=512",
            f"vllm_engine_kwargs={VLLM_KWARGS}"]
    # GRPO and GKD keep the GPU's placement on the CPU (one process: nothing checks it against a cluster) and
    # put the engines on the CPU with their `device` option
    # every dtype is the default, auto: the bf16 checkpoints' bfloat16 on the GPU, float32 on the CPU
    rollout = ([f"rollout.{k}" for k in vllm] if gpu else
               ["rollout.engine=hf", "train.engine_kwargs={device: cpu}", "rollout.engine_kwargs={device: cpu}"])
    one_group = ["device_groups.nproc_per_node=1", "device_groups.policy_group.ranks=[0]"]
    per_role = ["train.gpus=1", "rollout.gpus=1"]
    grpo = ["--plugin", "grpo", *ray, f"model={student}", f"dataset={data['sums']}", f"max_steps={STEPS}",
            "num_generations=4", "per_device_train_batch_size=8", "max_completion_length=32", "learning_rate=5e-3",
            "reward_funcs=[toy,format]", *rollout]
    gkd = ["--plugin", "gkd", *ray, "--config", str(EXAMPLES / "gkd" / "teacher_colocated.yaml"),
           f"model={student}", f"teacher_model={teacher}", f"dataset={data['pairs']}", f"max_steps={STEPS}",
           "max_completion_length=32", "learning_rate=1e-3", *per_role, *rollout]
    sft_gpu = ["bf16=true"] if gpu else ["bf16=false"]
    sft = [f"model={student}", f"max_steps={STEPS}", "learning_rate=1e-3", "lr_scheduler_type=constant",
           "warmup_steps=0", "per_device_train_batch_size=4", "gradient_accumulation_steps=1", "save_steps=0",
           "max_length=256", *sft_gpu]
    # the toy reward as the ORM: spread scores from a random model (accuracy gives it all zeros), no math-verify
    sample = ["--plugin", "sample", *ray, "--config", str(EXAMPLES / "sample" / "sampling.yaml"),
              f"model={student}", f"dataset={data['sums16']}", "prm_model=null", "orm_model=toy",
              "orm_threshold=-1", "num_return_sequences=4", "n_best_to_keep=1", "max_new_tokens=32", "batch_size=8",
              "max_prompt_length=512",  # the tiny models hold 1024 positions
              "device_groups.nproc_per_node=1", "device_groups.sample_group.ranks=[0]",
              "device_groups.rm_group.device=CPU", "device_groups.rm_group.ranks=1",
              "device_groups.rm_group.workers=[orm]"]
    sample += ([f"sampler.{k}" for k in vllm] if gpu else
               ["sampler_engine=hf", "sampler.engine_kwargs={device: cpu}"])
    distill = ["--plugin", "distill", "--config", str(EXAMPLES / "sample" / "distill.yaml"), f"model={student}",
               f"dataset={data['sums16']}", "max_new_tokens=32", "num_return_sequences=2", "batch_size=8"]

    swift = ms_swift_files(models, data, Path(data["sums"]).parent)
    swift_scale = [f"train_iters={STEPS}", "max_completion_length=32", "max_length=256",
                   *(["train.gpus=1", "rollout.gpus=1", *(f"rollout.{k}" for k in vllm)] if gpu else
                     ["use_vllm=false", "train.gpus=0", "rollout.gpus=0", "colocate_groups=[]"])]

    def placed(engine: str) -> str:  # the placement `rlcore run` prints for the train role, colocated with rollout
        return (f"train: 1 worker, {'GPU 0' if gpu else 'in this process'} (shared with rollout), engine {engine}, "
                f"{'bfloat16' if gpu else 'float32'}")  # dtype auto

    return [
        Row("grpo-hf", [*grpo, "--config", str(EXAMPLES / "grpo" / "colocate.yaml"), *per_role],
            check_grpo(placed("hf")), 180),  # the first row: Ray's and vLLM's first start on the machine (cold)
        Row("grpo-megatron", [*grpo, "--config", str(EXAMPLES / "grpo" / "colocate_device_groups.yaml"), *one_group,
                              "train.engine=megatron"], check_grpo(placed("megatron")), 180, lane=1),  # cold too, beside grpo-hf
        # megatron with LoRA adapters (merged for the weight sync), and a routed-experts model through megatron-core's
        # MoE layer, both from the per-group example
        Row("grpo-megatron-lora", [*grpo, "--config", str(EXAMPLES / "grpo" / "colocate_device_groups.yaml"), *one_group,
                                   "train.engine=megatron", "train.lora_rank=8", "train.lora_alpha=16"],
            check_grpo(placed("megatron")), 180, lane=1),
        Row("grpo-megatron-moe", [*grpo, "--config", str(EXAMPLES / "grpo" / "colocate_device_groups.yaml"), *one_group,
                                  "train.engine=megatron", f"model={models['moe']}"],
            check_grpo(placed("megatron")), 180),
        Row("gkd-hf", gkd, check_gkd(placed("hf")), 120),
        Row("gkd-megatron", [*gkd, "train.engine=megatron"], check_gkd(placed("megatron")), 150, lane=1),
        Row("sft-full", ["--plugin", "sft", *ray, "--config", str(EXAMPLES / "sft" / "multi_node.yaml"), *sft,
                         f"dataset={data['chats']}", "device_groups.nproc_per_node=1", "device_groups.nnodes=1",
                         "gradient_checkpointing=false", "ray_address=null",
                         *(["device_groups.default.ranks=[0]"] if gpu else  # a CPU group's ranks: a process count
                           ["device_groups.default.device=CPU", "device_groups.default.ranks=1"])],
            check_sft(lora=False), 90, vllm=False),
        Row("sft-lora", ["--plugin", "sft", *ray, "--config", str(EXAMPLES / "sft" / "lora.yaml"), *sft,
                         f"dataset={data['pairs']}", f"default.gpus={int(gpu)}"], check_sft(lora=True), 90, vllm=False),
        Row("sample", sample, check_samples(16, rejected=True), 120),
        # beside the SFT rows, once grpo-megatron's final/ is written: a first `vllm serve` on a machine stalled more
        # than 120 s (silent) in vLLM's kernel warm-up on the H200, so it must not hold up a vLLM lane
        Row("distill", distill, check_samples(32, rejected=False), 240, serve=True, vllm=False, after=FINAL_SERVED),
        # not in the default run (the 8 minutes): GKD with a vLLM teacher group sharing the GPU (two vLLM engines
        # taking turns beside megatron), and ms-swift's own YAML shapes, read without --plugin
        Row("gkd-shared-megatron", ["--plugin", "gkd", *ray, "--config", str(EXAMPLES / "gkd" / "teacher_shared.yaml"),
                                    f"model={student}", f"teacher.model={teacher}", f"dataset={data['pairs']}",
                                    f"max_steps={STEPS}", "max_completion_length=32", "learning_rate=1e-3",
                                    "gkd_logits_topk=8", "device_groups.nproc_per_node=1",
                                    "device_groups.shared_group.ranks=[0]", "train.engine=megatron", *rollout,
                                    *([f"teacher.{k}" for k in vllm] + ["teacher.vllm_gpu_memory_utilization=0.2"]
                                      if gpu else ["teacher.engine=hf", "teacher.engine_kwargs={device: cpu}"])],
            check_moving("jsd"), 240, default=False),
        Row("ms-swift-grpo", [*ray, "--config", swift["grpo"], *swift_scale, "num_generations=4",
                              "steps_per_generation=1", "global_batch_size=8", "micro_batch_size=4",
                              "reward_funcs=[toy,format]"],
            check_ms_swift("reward"), 180, default=False, output_key="train.output_dir"),
        Row("ms-swift-gkd", [*ray, "--config", swift["gkd"], *swift_scale, "global_batch_size=4",
                             "micro_batch_size=2", "train.tensor_model_parallel_size=1",
                             # the YAML's recompute_granularity: full is megatron's recomputation, which needs CUDA
                             *([] if gpu else ["recompute_granularity=none"])],
            check_ms_swift("jsd"), 180, default=False, output_key="train.output_dir"),
    ]


# -- running a row ----------------------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    status: str  # PASS or FAIL
    seconds: float
    detail: str = ""  # what a passing row saw, or why it failed
    command: list[str] = field(default_factory=list)


def stop(proc: subprocess.Popen) -> None:
    """End a timed-out run and its process group: SIGTERM twice (the second stops rlcore at once, after which it
    tears its local Ray down), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGTERM, 25), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def dump_stacks(proc: subprocess.Popen) -> None:
    """Have every process of a stalled server's group write its Python threads' stacks into the row's log (they run
    with PYTHONFAULTHANDLER=1, whose handler answers SIGABRT), so a silent start shows where it waits."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, gpu: bool, log, deadline: float, name: str) -> tuple[subprocess.Popen, str]:
    """`vllm serve MODEL --served-model-name NAME` on a free port of 127.0.0.1 (the `vllm` console script's entry
    point, through this interpreter), or on the CPU this module's stand-in for it; returns the server once
    /v1/models answers, with its base URL."""
    port = free_port()
    if gpu:
        cli = "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"
        cmd = [sys.executable, "-c", cli, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype",
               "bfloat16", "--gpu-memory-utilization", "0.3", "--max-model-len", "512", "--enforce-eager",
               "--served-model-name", name, *SERVE_FLAGS]
    else:
        cmd = [sys.executable, __file__, STAND_IN, model, str(port), name]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, **ENV, "PYTHONFAULTHANDLER": "1"})
    while True:
        if server.poll() is not None:
            raise Failed(f"the server exited {server.returncode} before answering")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return server, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if time.monotonic() > deadline:
                dump_stacks(server)
                stop(server)
                raise Failed("the server did not answer before the row's timeout (its processes' stacks are in "
                             "the row's log)") from None
            time.sleep(1)


STAND_IN = "--serve-on-cpu"


def serve_on_cpu(model: str, port: str, name: str) -> None:
    """A stand-in for `vllm serve` on the CPU: GET /v1/models and POST /v1/chat/completions, answered by the hf
    rollout engine, so that --cpu runs the distill row's client, server start and teardown too."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from transformers import AutoTokenizer

    from rlcore import SamplingParams
    from rlcore.plugins.hf.rollout import HFRolloutEngine

    engine, tokenizer, lock = HFRolloutEngine(model), AutoTokenizer.from_pretrained(model), threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self.reply({"object": "list", "data": [{"id": name, "object": "model"}]})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            params = SamplingParams(n=request.get("n", 1), max_tokens=request["max_tokens"],
                                    temperature=request.get("temperature", 1.0), seed=request.get("seed"))
            with lock:
                generations = engine.generate([list(ids)], params)
            choices = [{"index": i, "message": {"role": "assistant", "content": g.text}, "finish_reason": "stop"}
                       for i, g in enumerate(generations)]
            self.reply({"id": "smoke", "object": "chat.completion", "created": 0, "model": model, "choices": choices,
                        "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}})

    ThreadingHTTPServer(("127.0.0.1", int(port)), Handler).serve_forever()


FINAL_SERVED = ("grpo-megatron", "grpo-hf", "sft-full")  # rows whose exported model the served row prefers


def served_model(work: Path, student: str) -> str:
    """What a row that serves starts `vllm serve` on: the `final/` folder an earlier row of this run exported
    (megatron's weights mapped back to Hugging Face names first), so that vLLM loading what rlcore writes is
    checked too; the student when no such row ran."""
    for name in FINAL_SERVED:
        final = work / name / "run" / "final"
        if (final / "config.json").is_file():
            return str(final)
    return student


def run_row(row: Row, work: Path, out: Path, student: str, gpu: bool) -> Result:
    """Run one row with its timeout; never raises."""
    run_dir = work / row.name
    run_dir.mkdir(parents=True)
    log_path = out / f"{row.name}.log"
    start = time.monotonic()
    deadline = start + row.timeout_s
    cmd = [sys.executable, "-m", "rlcore", "run", *row.args, f"{row.output_key}={run_dir / 'run'}"]
    server = None
    with open(log_path, "w") as log:
        try:
            if row.serve:
                served = served_model(work, student)
                server, api_base = serve(served, gpu, log, deadline, name=student)
                cmd.append(f"api_base={api_base}")
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **ENV})
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop(proc)
                raise Failed(f"timed out after {row.timeout_s:.0f} s") from None
            expect(code == 0, f"rlcore run exited {code}")
            log.flush()
            detail = row.check(run_dir / "run", log_path.read_text(errors="replace"))
            if row.serve and served != student:
                detail += f"; served {Path(served).relative_to(work)} (what `rlcore run` exported)"
            status = "PASS"
        except Failed as exc:
            status, detail = "FAIL", str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken check is this row's failure, not the run's
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
        finally:
            if server is not None:
                stop(server)
    for name in ("metrics.jsonl", "samples.jsonl"):
        if (run_dir / "run" / name).is_file():
            shutil.copy(run_dir / "run" / name, out / f"{row.name}.{name}")
    return Result(row.name, status, time.monotonic() - start, detail, cmd)


def lanes(rows: list[Row], run: Callable[[Row], Result], out: Path, parallel: bool) -> dict[str, Result]:
    """Run the rows, reporting each as it ends; a row waits for its `after` rows. With `parallel`, three lanes share
    the GPU: two of rows that start a vLLM engine in-process (each row's `lane`; every engine takes a fixed KV cache,
    so none sizes its cache from memory another row holds), and beside them the other rows (SFT, then distill's
    `vllm serve`). Without, the rows run in their order, which puts each `after` row first."""
    done: dict[str, Result] = {}
    ended = {row.name: threading.Event() for row in rows}

    def lane(part: list[Row]) -> None:
        for row in part:
            later = {r.name for r in part[part.index(row):]}  # in this lane's order, not waited for (never ends)
            for name in row.after:
                if name in ended and name not in later:
                    ended[name].wait()
            try:
                done[row.name] = run(row)
                report(done[row.name], out)
            finally:
                ended[row.name].set()

    parts = ([[r for r in rows if r.vllm and r.lane == 0], [r for r in rows if r.vllm and r.lane == 1],
              [r for r in rows if not r.vllm]] if parallel else [rows])
    threads = [threading.Thread(target=lane, args=(part,), daemon=True) for part in parts if part]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done


def build(models: dict[str, str], shapes: dict[str, dict], device: str, out: Path) -> Result:
    """The models, built in a process of its own (so that this one holds no CUDA context while the rows run);
    a failure's traceback goes to out/models.log."""
    start = time.monotonic()
    root = str(Path(next(iter(models.values()))).parent)
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            built = pool.submit(build_models, root, device, shapes).result()
        expect(built == models, f"built {built}, expected {models}")
    except Exception as exc:  # noqa: BLE001 - reported as the first row; nothing else can run
        (out / "models.log").write_text(traceback.format_exc())
        return Result("models", "FAIL", time.monotonic() - start, f"{type(exc).__name__}: {exc}")
    return Result("models", "PASS", time.monotonic() - start, f"{', '.join(models)} built on {device}")


def tail(path: Path, n: int = TAIL_LINES) -> str:
    """The log's last `n` lines, after the run's last `rlcore: error:` line when that is further up (Ray's and
    vLLM's shutdown can print more than `n` lines after it)."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    errors = [i for i, line in enumerate(lines) if line.startswith("rlcore: error:")]
    shown = lines[-n:]
    if errors and errors[-1] < len(lines) - n:
        shown = [lines[errors[-1]], "...", *shown]
    return "\n".join("    | " + line[:240] for line in shown)


PRINTING = threading.Lock()  # the lanes report


def report(result: Result, out: Path) -> None:
    with PRINTING:
        print(f"{result.name:14s} {result.status:4s} {result.seconds:6.1f}s  {result.detail}", flush=True)
        if result.status == "FAIL":
            print(tail(out / f"{result.name}.log"), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash tests/gpu/run.sh smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help="rows to run (default: all)")
    parser.add_argument("--cpu", action="store_true", default=os.environ.get("RLCORE_SMOKE_CPU", "") not in ("", "0"),
                        help="run on the CPU: hf rollout and sampler engines, no Ray, no vLLM (RLCORE_SMOKE_CPU=1)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where logs and summary.json go (default: $OUT)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every row's timeout")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir of models and runs")
    parser.add_argument("--serial", action="store_true", help="on the GPU too, one row at a time")
    args = parser.parse_args(argv)
    gpu = not args.cpu
    if gpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device; run on the GPU machine, or pass --cpu for the rows that run on the CPU")
    work = Path(tempfile.mkdtemp(prefix="rlcore-smoke-"))
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    models = {name: str(work / "models" / name) for name in shapes}  # where build_models writes them
    rows = make_rows(models, write_data(work), gpu)
    unknown = set(args.rows) - {r.name for r in rows}
    if unknown:
        shutil.rmtree(work)
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join(r.name for r in rows)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="rlcore-smoke-out-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    print(f"rlcore smoke on {'the GPU' if gpu else 'the CPU'}: logs in {out}", flush=True)
    try:
        results = [build(models, shapes, "cuda" if gpu else "cpu", out)]
        report(results[0], out)
        if results[0].status == "PASS":
            chosen = [r for r in rows if r.name in args.rows or (not args.rows and r.default)]
            for row in chosen:
                row.timeout_s *= args.timeout_scale
            done = lanes(chosen, lambda row: run_row(row, work, out, models["student"], gpu), out,
                         parallel=gpu and not args.serial)
            results += [done[r.name] for r in chosen]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - began
    failed = [r.name for r in results if r.status == "FAIL"]
    summary = {"device": "cuda" if gpu else "cpu", "total_s": round(total, 1), "budget_s": BUDGET_S,
               "passed": sum(r.status == "PASS" for r in results), "failed": failed,
               "rows": [{"name": r.name, "status": r.status, "seconds": round(r.seconds, 1), "detail": r.detail,
                         "log": f"{r.name}.log", "command": r.command} for r in results]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    over = f" (over the {BUDGET_S} s budget)" if gpu and total > BUDGET_S else ""
    print(f"{'total':14s} {'FAIL' if failed else 'PASS':4s} {total:6.1f}s  {summary['passed']} passed, "
          f"{len(failed)} failed{over}; {out / 'summary.json'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [STAND_IN]:
        serve_on_cpu(*sys.argv[2:5])
    else:
        sys.exit(main())
