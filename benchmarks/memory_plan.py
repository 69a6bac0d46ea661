"""The memory plan against one GPU, measured as users run: for each case, `rlcore plan`'s predicted peak per phase
and per role beside what NVML saw of the run in that phase: the device's peak and each role's process's peak.

Each case runs as a user runs it: `rlcore run --plugin P --use-ray --with PROBE --config examples/ray/<example>` with
the case's keys, every role on the one GPU (train.gpus=1, rollout.gpus=1, ...), colocated and with vLLM asleep or
awake as the example's `colocate_groups` and `sleep_level` say; Ray runs each role in a process of its own.
- grpo: the GRPO benchmark's config (`benchmarks/grpo_gpu.py`: grpo/colocate.yaml, a Qwen2-0.5B-shaped random model,
  vLLM sleeping at level 1 while the policy trains);
- gkd: the GKD benchmark's (`benchmarks/gkd_gpu.py`: gkd/teacher_colocated.yaml, 0.5B student, 1.5B teacher in the
  train process, full vocabulary);
- grpo-lora, grpo-megatron, grpo-megatron-lora: the grpo case with LoRA rank 16 (all-linear), on the megatron
  engine, and both;
- gkd-topk: the gkd case with the teacher's top-64 log-probs (gkd_logits_topk=64) in place of the full vocabulary;
- sft: the SFT benchmark's (`benchmarks/sft_gpu.py`: sft/multi_node.yaml with the 0.5B shape, one `default` worker);
- sampling: sample/sampling.yaml, a 0.5B sampler on vLLM (awake throughout: nothing trains), a 1.5B-shaped PRM (two
  labels) and the toy reward as the ORM, all on the one GPU;
- grpo-7b-lora: a Qwen2.5-7B shape with LoRA rank 16 on grpo/colocate.yaml, vLLM beside it;
- overflow: grpo-7b without LoRA, vLLM kept awake (sleep_level 0) and nothing offloaded, which the plan predicts
  will not fit: run once with memory_check=false to show it runs out of memory;
- fitted: the overflow case with `--fit` (and the check on): the run takes the first change the plan says fits, and
  must then run its step without running out of memory, its measured peak beside the fitted plan's.

What is measured (`memory_measure.py`): a sampler beside the run reads, every 20 ms, each GPU's used memory and
NVML's per-process figures (`nvmlDeviceGetComputeRunningProcesses`); a hook-only plugin in the driver (`PROBE`,
given with --with) writes the trainer's phases (`generate` -> generation; `score` -> scoring; `train`, `logprobs`,
`teacher` -> training; `sync` -> weight sync) with their start and end times, and each role's worker pids
(`RoleSession.processes()`). Each pid is its role's (or a child's of a role's worker); the samples inside a phase's
windows give that phase's peak per role and the device's peak, less what the GPU held before the run.

    python benchmarks/memory_plan.py                  # every case: estimated 18-22 minutes on an H200 (not yet timed)
    python benchmarks/memory_plan.py --only grpo gkd sft sampling --json R.json      # about 6-7 of those
    python benchmarks/memory_plan.py --only grpo-lora grpo-megatron grpo-megatron-lora gkd-topk --json R.json --merge
    python benchmarks/memory_plan.py --only grpo-7b-lora overflow fitted --json R.json --merge  # the rest, into R.json
    python benchmarks/memory_plan.py --predict-only   # on the CPU: each case's prediction for an H200 (no run)

A case's run is stopped (SIGTERM, then killed) after its `timeout_s` (420 s); what it sampled until then is kept.

Target (issue 52): the prediction within 10% of the measured peak in each phase (the device's; each role's is shown
beside it), and never under it by more than 5%. Results: benchmarks/results/memory_plan-<date>-<kind>.json
(`--json PATH`): per case, per GPU and phase, the device's predicted and measured peak and its error, and per role
the predicted peak with its components, the measured one and its error; the pids of each role.
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
from memory_measure import GiB, PROBE, SAMPLER, attribute, baseline_of, compare, met, read_samples, table

HERE = Path(__file__).resolve().parent
QWEN_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab_size=151936,
                max_position_embeddings=4096, dtype="bfloat16")
QWEN_15B = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                vocab_size=151936, max_position_embeddings=4096, dtype="bfloat16", seed=1)
QWEN_7B = dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944, vocab_size=152064,
               max_position_embeddings=4096, dtype="bfloat16", arch="qwen2_untied")
# two steps: each phase's peak comes in the first step (the second repeats it; one weight sync comes between them)
GRPO_WORK = dict(reward_funcs=["toy"], num_generations=8, max_completion_length=256, per_device_train_batch_size=16,
                 gradient_accumulation_steps=4, max_steps=2)
CASES: dict[str, dict[str, Any]] = {
    "grpo": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_05B}, "data": "prompts",
             "keys": GRPO_WORK},
    "gkd": {"plugin": "gkd", "example": "gkd/teacher_colocated.yaml", "models": {"model": QWEN_05B,
            "teacher_model": QWEN_15B}, "data": "chats", "keys": dict(per_device_train_batch_size=8,
            gradient_accumulation_steps=8, max_completion_length=256, max_steps=2, lmbda=1.0)},
    "grpo-lora": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_05B}, "data": "prompts",
                  "keys": {**GRPO_WORK, "train.lora_rank": 16}},
    "grpo-megatron": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_05B},
                      "data": "prompts", "keys": {**GRPO_WORK, "train.engine": "megatron"}},
    "grpo-megatron-lora": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_05B},
                           "data": "prompts", "keys": {**GRPO_WORK, "train.engine": "megatron", "train.lora_rank": 16}},
    "gkd-topk": {"plugin": "gkd", "example": "gkd/teacher_colocated.yaml", "models": {"model": QWEN_05B,
                 "teacher_model": QWEN_15B}, "data": "chats", "keys": dict(per_device_train_batch_size=8,
                 gradient_accumulation_steps=8, max_completion_length=256, max_steps=2, lmbda=1.0, gkd_logits_topk=64)},
    "sft": {"plugin": "sft", "example": "sft/multi_node.yaml", "models": {"model": QWEN_05B}, "data": "chats",
            "keys": dict(max_length=2048, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=4)},
    "sampling": {"plugin": "sample", "example": "sample/sampling.yaml", "models": {"model": QWEN_05B,
                 "prm_model": {**QWEN_15B, "num_labels": 2}}, "data": "prompts",
                 "keys": {"device_groups": {"nproc_per_node": 1, "one_gpu": {"device": "GPU", "ranks": [0],  # one group:
                                            "workers": ["sampler", "prm", "orm"]}},  # groups may not share a GPU
                          "orm_model": "toy", "prm_step_token": None, "prm.engine_kwargs": {}, "batch_size": 64,
                          "sampler.vllm_gpu_memory_utilization": 0.5, "max_prompt_length": 256, "max_new_tokens": 256}},
    "grpo-7b-lora": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_7B}, "data": "prompts",
                     "keys": {**GRPO_WORK, "train.lora_rank": 16, "per_device_train_batch_size": 4,  # a micro-batch
                              "gradient_accumulation_steps": 4, "rollout.vllm_gpu_memory_utilization": 0.35}},
    "overflow": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_7B}, "data": "prompts",
                 "keys": {**GRPO_WORK, "sleep_level": 0, "offload_optimizer": False, "offload_model": False,
                          "memory_check": False, "max_steps": 1}, "expect_oom": True},
    # the overflow case as a user would run it after the refusal: `--fit` applies the first change that fits
    "fitted": {"plugin": "grpo", "example": "grpo/colocate.yaml", "models": {"model": QWEN_7B}, "data": "prompts",
               "keys": {**GRPO_WORK, "sleep_level": 0, "offload_optimizer": False, "offload_model": False,
                        "max_steps": 1}, "flags": ["--fit"]},
}
TARGET = "|predicted / measured peak - 1| <= 10% per phase, never under by more than 5%"


def config_only(path: Path, shape: dict[str, Any]) -> str:
    """A model directory holding only the config.json of `shape` (what the plan reads), for --predict-only."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": shape["hidden_size"], "num_hidden_layers": shape["num_layers"],
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
    one_gpu = {} if "device_groups" in case["keys"] else scaled(case["example"], 1)  # the case's own layout
    return {**one_gpu, **{key: models[key] for key in case["models"]}, "dataset": data[case["data"]],
            **case["keys"], "output_dir": str(out)}


def predict(case: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    """`rlcore plan --json` of the case (the GPU's memory read from nvidia-smi)."""
    cmd = [sys.executable, "-m", "rlcore", "plan", "--plugin", case["plugin"], "--use-ray", *case.get("flags", []),
           "--config", str(HERE.parent / "examples" / "ray" / case["example"]), *overrides_of(keys), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)  # exit 2 where it will not fit: the JSON is printed first
    if not done.stdout.startswith("{"):  # refused before it planned (the config): no JSON to read
        raise SystemExit(f"`rlcore plan` of the case failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    if "\n--fit: " in done.stdout:  # the refused plan, `--fit: CHANGES`, then the plan of the fitted config
        changes, fitted = done.stdout.split("\n--fit: ", 1)[1].split("\n", 1)
        return {**json.loads(fitted), "fit_changes": changes.split()}
    return json.loads(done.stdout)


def measure(case: dict[str, Any], keys: dict[str, Any], tmp: Path, name: str, gpus: list[int]) -> dict[str, Any]:
    """Run the case as a user does (`rlcore run --use-ray` on its example) with the probe and the NVML sampler; the
    peaks per phase, GPU and role."""
    probe_out, samples = tmp / f"probe-{name}.json", tmp / f"nvml-{name}.jsonl"
    plugin = tmp / f"probe_{name.replace('-', '_')}.py"
    plugin.write_text(PROBE.format(out=str(probe_out)))
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, str(samples), *map(str, gpus)])
    deadline = time.time() + 30
    while not (samples.exists() and samples.stat().st_size) and sampler.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # the baseline is read before the run starts
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", case["plugin"], "--use-ray", "--with", str(plugin),
           *case.get("flags", []), "--config", str(HERE.parent / "examples" / "ray" / case["example"]), *overrides_of(keys)]
    log = tmp / f"run-{name}.log"
    started = time.time()
    with log.open("w") as err:
        run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        late = ""
        try:
            run.wait(timeout=case.get("timeout_s", 420))
        except subprocess.TimeoutExpired as exc:  # SIGTERM: rlcore stops after the step and ends its local Ray
            late = f"did not finish in {exc.timeout:.0f} s\n"
            run.terminate()
            try:
                run.wait(timeout=90)
            except subprocess.TimeoutExpired:
                run.kill()
                run.wait()
        finally:
            sampler_rc = sampler.poll()  # None: it sampled the whole run
            sampler.terminate()
            sampler.wait()
    text = log.read_text(errors="replace")
    returncode, tail = (None if late else run.returncode), late + text[-1500:]
    rows, parents = read_samples(samples)
    baseline = baseline_of(rows, started)
    probe = json.loads(probe_out.read_text()) if probe_out.exists() else {}
    seen = attribute(rows, parents, probe, baseline)
    if sampler_rc is not None:
        seen["note"] = f"the NVML sampler exited with {sampler_rc} before the run ended (its error is in the output)"
    return {"returncode": returncode, **seen,
            "roles_pids": probe.get("roles", {}), "out_of_memory": "out of memory" in text.lower(),
            "stderr_tail": tail if returncode else "",
            "device_peak_run_gib": {str(gpu): round(max((r["used"] - baseline.get(gpu, 0) for r in rows if r["gpu"] == gpu),
                                                        default=0) / GiB, 2) for gpu in gpus}}


def gpu_of_host() -> tuple[list[int], str, int]:
    """The NVML indices of this run's GPUs (CUDA_VISIBLE_DEVICES's order, else all), the first one's kind as a file
    name word (`nvidia-h200`) and its memory; read through NVML, so this process makes no CUDA context."""
    import pynvml

    pynvml.nvmlInit()
    visible = [i.strip() for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.strip()]
    if visible and all(i.isdigit() for i in visible):
        gpus = [int(i) for i in visible]
    elif visible and all(i.startswith(("GPU-", "MIG-")) for i in visible):  # by UUID
        gpus = [pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(i)) for i in visible]
    else:
        gpus = list(range(pynvml.nvmlDeviceGetCount()))
    if not gpus:
        raise SystemExit("memory_plan.py measures a GPU: NVML lists none here")
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpus[0])
    name = pynvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else name
    return gpus, name.lower().replace(" ", "-"), pynvml.nvmlDeviceGetMemoryInfo(handle).total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(CASES), help="run only these cases")
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--merge", action="store_true", help="keep the cases the --json file holds from an earlier "
                        "call of the same commit, adding these (a lease's calls split the cases)")
    parser.add_argument("--predict-only", action="store_true", help="each case's prediction for an H200 (140 GiB), "
                        "from config.json alone, on any machine; nothing runs")
    args = parser.parse_args()
    if args.predict_only:
        return predict_only(args)
    try:
        gpus, kind, gpu_bytes = gpu_of_host()
    except (ImportError, OSError) as exc:
        raise SystemExit(f"memory_plan.py measures a GPU through NVML (pynvml): {exc}") from None
    except Exception as exc:  # pynvml's NVMLError: no driver here
        raise SystemExit(f"memory_plan.py measures a GPU: NVML found none ({exc})") from None
    path = results_path(args.json, f"memory_plan-{time.strftime('%Y-%m-%d')}-{kind}.json", smoke=False)
    record: dict[str, Any] = {"benchmark": "memory_plan", "host": host_info(), "commit": git_commit(),
                              "gpu_bytes": gpu_bytes, "cases": {}, "target": TARGET, "met": {},
                              "what": "each case by `rlcore run --use-ray` on its example, one GPU; NVML's memory per "
                                      "process and phase, each process named by its role"}
    if args.merge and path.exists():
        earlier = json.loads(path.read_text())
        if earlier.get("commit") != record["commit"]:
            raise SystemExit(f"--merge: {path} is of commit {earlier.get('commit')}, this checkout is "
                             f"{record['commit']}; give another --json")
        record["cases"] = earlier.get("cases", {})
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        data = write_data(tmp)
        built: dict[str, str] = {}
        for name in args.only or list(CASES):
            case = CASES[name]
            models = {}
            for key, shape in case["models"].items():
                label = f"{shape['hidden_size']}x{shape['num_layers']}" + (f"-{shape['num_labels']}" if "num_labels" in shape else "")
                if label not in built:
                    built[label] = build_model(tmp / f"model-{label}", shape)
                models[key] = built[label]
            keys = case_keys(case, models, data, tmp / f"out-{name}")
            predicted = predict(case, keys)
            measured = measure(case, keys, tmp, name, gpus)
            record["cases"][name] = {"example": case["example"], "keys": overrides_of(case["keys"]),
                                     "predicted_fits": predicted.get("fits"),
                                     "rows": compare(predicted, measured, gpus), **measured}
            if case.get("expect_oom"):
                record["cases"][name]["overflow_shown"] = not predicted.get("fits") and measured["out_of_memory"]
            if "fit_changes" in predicted:  # the fitted config's plan fits, and its run finished within the GPU
                record["cases"][name]["fit_changes"] = predicted["fit_changes"]
                record["cases"][name]["fit_shown"] = bool(predicted.get("fits")) and measured["returncode"] == 0 \
                    and not measured["out_of_memory"]
            record["met"] = met(record["cases"])
            write_json(path, record)
    print("\n".join(table(record["cases"])))
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
            fitted = f" (--fit: {' '.join(predicted['fit_changes'])})" if "fit_changes" in predicted else ""
            if fitted:
                out[name]["fit_changes"] = predicted["fit_changes"]
            print(f"{name:<18} fits on 140 GiB: {predicted['fits']!s:<5} " + "  ".join(
                f"{phase} {peak:.1f} GiB" for phase, peak in out[name]["peaks_gib"].items()) + fitted)
    path = Path(args.json) if args.json else Path(tempfile.gettempdir()) / "memory_plan-predicted.json"
    write_json(path, {"benchmark": "memory_plan", "predict_only": True, "gpu_gib": 140, "cases": out})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
