"""The memory plan against one GPU: for each case, `rlcore plan`'s predicted peak per phase beside what the run
measured in that phase: torch's peak allocation in the run's process and the device's peak (NVML, sampled every
20 ms, which counts vLLM's pool, the CUDA context and the allocator's cache too).

Cases, each on one GPU with every role colocated, run without Ray (one process holds every role, so torch's
peaks are the run's own):
- grpo: the GRPO benchmark's config (`benchmarks/grpo_gpu.py`: examples/ray/grpo/colocate.yaml, a Qwen2-0.5B-shaped
  random model, vLLM);
- gkd: the GKD benchmark's (`benchmarks/gkd_gpu.py`: gkd/teacher_colocated.yaml, 0.5B student, 1.5B teacher, full
  vocabulary);
- sft: the SFT benchmark's (`benchmarks/sft_gpu.py`: sft/multi_node.yaml with the 0.5B shape);
- grpo-7b-lora: a Qwen2.5-7B shape with LoRA rank 16 on grpo/colocate.yaml, vLLM beside it;
- overflow: grpo-7b without LoRA, vLLM kept awake (sleep_level 0) and nothing offloaded, which the plan predicts
  will not fit: run once with memory_check=false to show it
  runs out of memory.

Phases are the trainer's own (`generate` -> generation; `train`, `logprobs`, `teacher` -> training; `sync` ->
weight sync), timed by a hook-only plugin given with --with (`PROBE`), which resets torch's peak at each phase's
start and reads it at its end; the device's samples are matched to the phases by time. SFT's steps run inside
TRL's loop: where its trainer times no phase, its whole run is one training phase.

    python benchmarks/memory_plan.py                 # every case (about 10 minutes on an H200)
    python benchmarks/memory_plan.py --only grpo sft
    python benchmarks/memory_plan.py --predict-only  # on the CPU: each case's prediction for an H200 (no run)

Target (issue 47): the prediction within 10% of the device's peak in each phase, and never under it by more than 5%.
Results: benchmarks/results/memory_plan-<date>-<kind>.json (`--json PATH`), with the prediction's components.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fair import build_model, chat_rows, git_commit, host_info, overrides_of, results_path, scaled, write_json

GiB = 1 << 30
HERE = Path(__file__).resolve().parent
QWEN_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab_size=151936,
                max_position_embeddings=4096, dtype="bfloat16")
QWEN_15B = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                vocab_size=151936, max_position_embeddings=4096, dtype="bfloat16", seed=1)
QWEN_7B = dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944, vocab_size=152064,
               max_position_embeddings=4096, dtype="bfloat16", arch="qwen2_untied")
# the trainers' timed phases -> the plan's: the train role's forward passes (GRPO's old log-probs, GKD's colocated
# teacher) are its training phase too
PHASES = {"generate": "generation", "train": "training", "logprobs": "training", "teacher": "training",
          "sync": "weight sync"}
GRPO_WORK = dict(reward_funcs=["toy"], num_generations=8, max_completion_length=256, per_device_train_batch_size=16,
                 gradient_accumulation_steps=4, max_steps=3)
CASES: dict[str, dict[str, Any]] = {
    "grpo": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_05B}, "data": "prompts",
             "keys": GRPO_WORK},
    "gkd": {"plugin": "gkd", "example": "gkd/teacher_colocated.yaml", "models": {"model": QWEN_05B,
            "teacher_model": QWEN_15B}, "data": "chats", "keys": dict(per_device_train_batch_size=8,
            gradient_accumulation_steps=8, max_completion_length=256, max_steps=3, lmbda=1.0)},
    "sft": {"plugin": "sft", "example": "sft/multi_node.yaml", "models": {"model": QWEN_05B}, "data": "chats",
            "keys": dict(max_length=2048, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=10)},
    "grpo-7b-lora": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_7B}, "data": "prompts",
                     "keys": {**GRPO_WORK, "train.lora_rank": 16, "per_device_train_batch_size": 4,
                              "gradient_accumulation_steps": 16, "rollout.vllm_gpu_memory_utilization": 0.35}},
    "overflow": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_7B}, "data": "prompts",
                 "keys": {**GRPO_WORK, "sleep_level": 0, "offload_optimizer": False, "offload_model": False,
                          "memory_check": False, "max_steps": 1}, "expect_oom": True},
}

# --with: the trainer's phases timed, torch's peak per phase (this process holds every role: no Ray)
PROBE = '''
import contextlib, json, time
import torch
from rlcore import hookimpl

OUT = {out!r}

class Probe:
    def __init__(self, timer):
        self.timer, self.rows = timer, []

    def __getattr__(self, name):
        return getattr(self.timer, name)

    @contextlib.contextmanager
    def __call__(self, phase):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.time()
        with self.timer(phase):
            yield
        torch.cuda.synchronize()
        self.rows.append({{"phase": phase, "start": start, "end": time.time(),
                           "torch_peak": torch.cuda.max_memory_allocated()}})
        with open(OUT, "w") as f:
            json.dump(self.rows, f)

@hookimpl
def rlcore_train_start(trainer):
    torch.cuda.reset_peak_memory_stats()
    trainer.timer = Probe(trainer.timer)
    trainer.memory_probe_start = time.time()

@hookimpl
def rlcore_train_end(trainer, metrics):
    rows = getattr(trainer.timer, "rows", [])
    if not rows:  # a loop of its own (SFT's TRL trainer): the whole run is its training phase
        rows.append({{"phase": "train", "start": trainer.memory_probe_start, "end": time.time(),
                      "torch_peak": torch.cuda.max_memory_allocated()}})
        with open(OUT, "w") as f:
            json.dump(rows, f)
'''

SAMPLER = '''
import sys, time, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(int(sys.argv[1]))
with open(sys.argv[2], "w", buffering=1) as f:
    while True:
        f.write(f"{{time.time()}} {{pynvml.nvmlDeviceGetMemoryInfo(handle).used}}\\n")
        time.sleep(0.02)
'''


def config_only(path: Path, shape: dict[str, Any]) -> str:
    """A model directory holding only the config.json of `shape` (what the plan reads), for --predict-only."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen2", "hidden_size": shape["hidden_size"], "num_hidden_layers": shape["num_layers"],
              "num_attention_heads": shape["num_heads"], "num_key_value_heads": shape["num_kv_heads"],
              "intermediate_size": shape["intermediate_size"], "vocab_size": shape["vocab_size"],
              "max_position_embeddings": shape["max_position_embeddings"], "torch_dtype": shape["dtype"],
              "tie_word_embeddings": shape.get("arch") != "qwen2_untied"}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def write_data(tmp: Path) -> dict[str, str]:
    from rlcore.testing import toy_dataset

    prompts, chats = tmp / "prompts.jsonl", tmp / "chats.jsonl"
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in toy_dataset()]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chats.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(1024, question=(4, 60), answer=(8, 600))))
    return {"prompts": str(prompts), "chats": str(chats)}


def case_keys(case: dict[str, Any], models: dict[str, str], data: dict[str, str], out: Path) -> dict[str, Any]:
    return {**scaled(case["example"], 1), **{key: models[key] for key in case["models"]}, "dataset": data[case["data"]],
            **case["keys"], "output_dir": str(out)}


def predict(case: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    """`rlcore plan --json` of the case (the GPU's memory read from nvidia-smi)."""
    cmd = [sys.executable, "-m", "rlcore", "plan", "--plugin", case["plugin"], "--config",
           str(HERE.parent / "examples" / "ray" / case["example"]), *overrides_of(keys), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)  # exit 2 where it will not fit: the JSON is printed first
    return json.loads(done.stdout)


def measure(case: dict[str, Any], keys: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    """Run the case once with the probe and the device sampler; the peaks per phase."""
    probe_out, samples = tmp / f"probe-{name}.json", tmp / f"nvml-{name}.txt"
    plugin = tmp / f"probe_{name.replace('-', '_')}.py"
    plugin.write_text(PROBE.format(out=str(probe_out)))
    device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER.format(), device if device.isdigit() else "0", str(samples)])
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", case["plugin"], "--with", str(plugin), "--config",
           str(HERE.parent / "examples" / "ray" / case["example"]), *overrides_of(keys)]
    started = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    finally:
        sampler.terminate()
        sampler.wait()
    points = [tuple(map(float, line.split())) for line in samples.read_text().splitlines() if len(line.split()) == 2]
    baseline = min((used for t, used in points if t < started + 0.5), default=0.0)  # other processes' memory
    phases: dict[str, dict[str, float]] = {}
    for row in json.loads(probe_out.read_text()) if probe_out.exists() else []:
        phase = PHASES.get(row["phase"])
        if phase is None:
            continue
        device_peak = max((used for t, used in points if row["start"] <= t <= row["end"]), default=0.0) - baseline
        seen = phases.setdefault(phase, {"torch_peak": 0, "device_peak": 0})
        seen["torch_peak"] = max(seen["torch_peak"], row["torch_peak"])
        seen["device_peak"] = max(seen["device_peak"], device_peak)
    tail = (done.stderr or "")[-1500:]
    return {"returncode": done.returncode, "phases": phases, "out_of_memory": "out of memory" in tail.lower(),
            "stderr_tail": tail if done.returncode else "",
            "device_peak_run": max((u for _, u in points), default=0) - baseline}


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for plan_row in predicted.get("rows", []):
        if 0 not in plan_row["gpus"]:
            continue
        seen = measured["phases"].get(plan_row["phase"])
        row = {"phase": plan_row["phase"], "predicted_gib": round(plan_row["peak_bytes"] / GiB, 2),
               "components": {f"{t['role']} {t['component']}": round((t["bytes"] or 0) / GiB, 2) for t in plan_row["terms"]}}
        if seen:
            device, torch_peak = seen["device_peak"], seen["torch_peak"]
            row.update(torch_peak_gib=round(torch_peak / GiB, 2), device_peak_gib=round(device / GiB, 2))
            if device:
                error = plan_row["peak_bytes"] / device - 1
                row.update(error=round(error, 3), meets_target=abs(error) <= 0.10 and error >= -0.05)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(CASES), help="run only these cases")
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--predict-only", action="store_true", help="each case's prediction for an H200 (140 GiB), "
                        "from config.json alone, on any machine; nothing runs")
    args = parser.parse_args()
    if args.predict_only:
        return predict_only(args)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("memory_plan.py measures a GPU: no CUDA device here")
    kind = torch.cuda.get_device_name(0).lower().replace(" ", "-")
    path = results_path(args.json, f"memory_plan-{time.strftime('%Y-%m-%d')}-{kind}.json", smoke=False)
    record: dict[str, Any] = {"benchmark": "memory_plan", "host": host_info(), "commit": git_commit(),
                              "gpu_bytes": torch.cuda.get_device_properties(0).total_memory, "cases": {},
                              "target": "|predicted / device peak - 1| <= 10% per phase, never under by more than 5%"}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        data = write_data(tmp)
        built: dict[str, str] = {}
        for name in args.only or list(CASES):
            case = CASES[name]
            models = {}
            for key, shape in case["models"].items():
                label = f"{shape['hidden_size']}x{shape['num_layers']}"
                if label not in built:
                    built[label] = build_model(tmp / f"model-{label}", shape)
                models[key] = built[label]
            keys = case_keys(case, models, data, tmp / f"out-{name}")
            predicted = predict(case, keys)
            measured = measure(case, keys, tmp, name)
            rows = compare(predicted, measured)
            record["cases"][name] = {"example": case["example"], "keys": overrides_of(case["keys"]),
                                     "predicted_fits": predicted.get("fits"), "rows": rows, **measured}
            if case.get("expect_oom"):
                record["cases"][name]["overflow_shown"] = not predicted.get("fits") and measured["out_of_memory"]
            write_json(path, record)
    print(f"{'case':<14} {'phase':<12} {'predicted':>10} {'torch peak':>11} {'device peak':>12} {'error':>7}  target")
    for name, case in record["cases"].items():
        for row in case["rows"]:
            print(f"{name:<14} {row['phase']:<12} {row['predicted_gib']:>9.1f}G {row.get('torch_peak_gib', '-'):>10}G "
                  f"{row.get('device_peak_gib', '-'):>11}G {row.get('error', '-'):>7}  {row.get('meets_target', '-')}")
        if "overflow_shown" in case:
            print(f"{name:<14} predicted to overflow: {not case['predicted_fits']}; "
                  f"ran out of memory: {case['out_of_memory']}")
    print(f"results: {path}")
    return 0


def predict_only(args: argparse.Namespace) -> int:
    """Each case's plan on a 140 GiB GPU, printed and written to --json (a temporary file by default)."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        data = {"prompts": str(tmp / "prompts.jsonl"), "chats": str(tmp / "chats.jsonl")}  # the plan reads no data
        for name in args.only or list(CASES):
            case = CASES[name]
            models = {key: config_only(tmp / f"model-{shape['hidden_size']}x{shape['num_layers']}", shape)
                      for key, shape in case["models"].items()}
            predicted = predict(case, {**case_keys(case, models, data, tmp / f"out-{name}"), "gpu_memory_gib": 140})
            out[name] = {"fits": predicted["fits"], "peaks_gib": {r["phase"]: round(r["peak_bytes"] / GiB, 1)
                                                                  for r in predicted["rows"] if 0 in r["gpus"]}}
            print(f"{name:<14} fits on 140 GiB: {predicted['fits']!s:<5} " + "  ".join(
                f"{phase} {peak:.1f} GiB" for phase, peak in out[name]["peaks_gib"].items()))
    path = Path(args.json) if args.json else Path(tempfile.gettempdir()) / "memory_plan-predicted.json"
    write_json(path, {"benchmark": "memory_plan", "predict_only": True, "gpu_gib": 140, "cases": out})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
