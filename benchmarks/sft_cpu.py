"""SFT step time on the CPU: rlcore's `sft` (one process, no Ray) against TRL's SFTTrainer used directly.

rlcore's `sft` runs TRL's SFTTrainer itself (plugins/sft/build.py), paused after every optimizer step by a callback
so that rlcore's driver moves it one step at a time (plugins/sft/worker.py: the trainer's loop in a thread, two
queues), with rlcore's metrics.jsonl, hooks and progress bar around it. This measures what that plumbing costs:
the same tiny random-weight Qwen2-style model (rlcore.testing, `SHAPE`), the same synthetic chat rows of
mixed lengths (one JSONL file), and the same arguments wherever both spell them (`SAME`: global batch, max_length,
packing, optimizer, schedule, gradient checkpointing off, bf16 off, seed), one torch thread count for both. The
TRL side is built as its documentation builds it, with the arguments rlcore sets itself copied (log every step,
no tqdm, no checkpoints, no per-step log printing); every field of the two SFTConfig objects is read back after
the run and the ones that differ are listed. Same seed, same data order: both sides train on the same batches,
and the table shows that (tokens per step and the loss of the last step on each side).

A step's time is the wall time between two consecutive steps' logs: for rlcore on the driver at the step-end
hook (so the driver's queue round trip, metrics.jsonl and the bar are inside it), for TRL in `on_log`. The median
over the steps after `--warmup`, and tokens/s (TRL's own `num_tokens` count) over the same steps; the runs
alternate rlcore and TRL, and the result is the median over `--repeats` runs. Since step i is the same batch on
both sides, the table also gives the paired ratio: the median over all runs of rlcore's step i / TRL's step i.
"1st step end" is the time from building the trainer (rlcore: its config checks, reading the rows, the session;
TRL: SFTConfig, model, load_dataset) to the end of step 1; each run tokenises afresh (its own dataset caches).

`--ray` adds rlcore on Ray with CPU workers (gloo): 1 worker with the whole global batch, then 2 workers of half
of it. This machine has 2 cores, so the 2-worker row is two processes sharing them, not a scaling figure.

    OMP_NUM_THREADS=1 python benchmarks/sft_cpu.py --ray --json benchmarks/results/sft_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fair import chat_rows

SHAPE = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
             max_position_embeddings=1024)
ROWS, MICRO = 2000, 8
# Keys TRL's SFTConfig and rlcore's SFTConfig spell the same way, set to the same values on both sides.
SAME: dict[str, Any] = dict(
    max_length=256, packing=True, per_device_train_batch_size=MICRO, gradient_accumulation_steps=1,
    learning_rate=1e-4, lr_scheduler_type="constant",  # both default to linear
    warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999,
    bf16=False,  # TRL's default on a CPU: None, which TRL turns into bf16 autocast
    gradient_checkpointing=False,  # TRL's default: on
    seed=42, dataloader_num_workers=0,
)
# SFTConfig fields whose difference says nothing about the work done (paths, names)
IGNORED = {"output_dir", "logging_dir", "run_name", "hub_model_id", "accelerator_config", "deepspeed_plugin",
           "distributed_state", "_n_gpu", "__cached__setup_devices"}
# the rows of the settings table: fields of TRL's SFTConfig, read back from each side's trainer
SHOWN = ("max_length", "packing", "packing_strategy", "padding_free", "per_device_train_batch_size",
         "gradient_accumulation_steps", "optim", "learning_rate", "lr_scheduler_type", "weight_decay", "max_grad_norm",
         "bf16", "activation_checkpointing", "gradient_checkpointing", "seed", "logging_steps", "use_cpu",
         "dataloader_num_workers", "completion_only_loss", "assistant_only_loss", "loss_type")


def hf_arguments(same: dict[str, Any]) -> dict[str, Any]:
    """`same` as TRL's SFTConfig takes it: transformers 5 calls gradient checkpointing activation_checkpointing
    (rlcore renames it the same way, plugins/sft/build.py)."""
    from trl import SFTConfig

    out = dict(same)
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(SFTConfig)}:
        out["activation_checkpointing"] = out.pop("gradient_checkpointing")
    return out


def arguments_of(args: Any) -> dict[str, Any]:
    """Every field of a TrainingArguments, as a JSON-friendly value."""
    out = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name, None)
        value = getattr(value, "value", value)  # enums
        out[f.name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
    return out


def summarise(stamps: list[dict], warmup: int, started: float) -> dict[str, Any]:
    """Median step time and tokens/s over the steps after `warmup` (stamps: one per step, in order)."""
    if warmup < 1 or len(stamps) <= warmup + 1:
        raise SystemExit(f"{len(stamps)} steps logged, warm-up {warmup}: need 1 <= --warmup < --steps - 1")
    first, last = stamps[warmup - 1], stamps[-1]
    steps = [b["t"] - a["t"] for a, b in zip(stamps[warmup - 1 :], stamps[warmup:])]
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip(stamps, stamps[1:])]
    return {
        "median_step_s": statistics.median(steps),
        "step_s": steps,
        "tokens_per_s": (last["num_tokens"] - first["num_tokens"]) / (last["t"] - first["t"]),
        "timed_steps": len(steps),
        "first_step_end_s": stamps[0]["t"] - started,  # from building the trainer to the end of step 1
        "tokens_per_step": [stamps[0]["num_tokens"]] + tokens,
        "losses": [s["loss"] for s in stamps],
    }


def run_rlcore(model: str, data: str, tmp: Path, name: str, steps: int, *, ray_workers: int = 0,
               **extra: Any) -> dict[str, Any]:
    from rlcore import hookimpl, load_plugins
    from rlcore.plugins.sft.config import SFTConfig
    from rlcore.plugins.sft.trainer import SFTTrainer

    stamps: list[dict] = []
    seen: dict[str, Any] = {}

    class Clock:
        @hookimpl
        def rlcore_step_end(self, trainer, step, metrics):
            stamps.append({"t": time.perf_counter(), "num_tokens": metrics.get("num_tokens"), "loss": metrics.get("loss")})
            if step == 1 and not trainer.use_ray:  # the worker is in this process: read its trainer's arguments
                seen["args"] = arguments_of(trainer.session["default"].runner.trainer.args)

    plugins = load_plugins()
    plugins.register(Clock(), "clock")
    same = dict(SAME)
    if ray_workers:
        same["per_device_train_batch_size"] = MICRO // ray_workers  # the same global batch
    config = SFTConfig(**same, model=model, dataset=data, output_dir=str(tmp / name), max_steps=steps, save_steps=0,
                       dataset_cache_dir=str(tmp / f"{name}-data-cache"),
                       **({"default": {"cpus": ray_workers}} if ray_workers else {}), **extra)
    started = time.perf_counter()
    trainer = SFTTrainer(config, plugins, use_ray=bool(ray_workers))
    trainer.fit()
    out = {"stamps": stamps, "started": started, "args": seen.get("args")}
    if ray_workers:
        out["shape"] = trainer.shape
    return out


def run_trl(model: str, data: str, tmp: Path, name: str, steps: int) -> dict[str, Any]:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    stamps: list[dict] = []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                stamps.append({"t": time.perf_counter(), "num_tokens": logs["num_tokens"], "loss": logs.get("loss")})

    started = time.perf_counter()
    args = SFTConfig(**hf_arguments(SAME), output_dir=str(tmp / name), max_steps=steps, logging_strategy="steps",
                     logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), args=args,
                         train_dataset=load_dataset("json", data_files=data, split="train",
                                                     cache_dir=str(tmp / f"{name}-hf-cache")),
                         processing_class=tokenizer, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # as rlcore does: no dict printed per step
    trainer.train()
    return {"stamps": stamps, "started": started, "args": arguments_of(trainer.args)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=23, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=5, help="runs per side, alternating rlcore and TRL")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1),
                        help="torch threads, both sides (and each Ray worker's OMP_NUM_THREADS)")
    parser.add_argument("--ray", action="store_true", help="add rlcore on Ray: 1 CPU worker, then 2 (gloo)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch is imported; Ray workers inherit it
        os.environ[var] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    import trl

    from rlcore.testing import build_tiny_model

    load_before = os.getloadavg()  # other work on the machine shows here
    runs: dict[str, list[dict]] = {"rlcore": [], "trl": []}
    args_seen: dict[str, dict] = {}
    ray_rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlcore-sft-cpu-") as tmp_dir:
        tmp = Path(tmp_dir)
        model = str(build_tiny_model(tmp / "tiny", **SHAPE))
        data = tmp / "chats.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(ROWS, question=(4, 30), answer=(4, 120))))
        for r in range(args.repeats):
            for side, run in (("rlcore", run_rlcore), ("trl", run_trl)):
                raw = run(model, str(data), tmp, f"{side}-{r}", args.steps)
                runs[side].append(summarise(raw["stamps"], args.warmup, raw["started"]))
                args_seen[side] = raw["args"]
                print(f"run {r + 1}/{args.repeats} {side}: median step {runs[side][-1]['median_step_s']:.4f} s",
                      file=sys.stderr, flush=True)
        if args.ray:
            from rlcore.runtime import cluster

            cluster.init("local", num_cpus=2)
            try:
                for workers in (1, 2):
                    raw = run_rlcore(model, str(data), tmp, f"ray-{workers}", args.steps, ray_workers=workers)
                    ray_rows[f"rlcore_ray_{workers}"] = {**summarise(raw["stamps"], args.warmup, raw["started"]),
                                                          "shape": raw["shape"]}
            finally:
                cluster.shutdown()

    def median_of(side: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[side])

    ours, theirs = args_seen["rlcore"], args_seen["trl"]
    differs = {k: {"rlcore": ours.get(k), "trl": theirs.get(k)} for k in sorted(set(ours) | set(theirs))
               if k not in IGNORED and ours.get(k) != theirs.get(k)}
    same_batches = runs["rlcore"][0]["tokens_per_step"] == runs["trl"][0]["tokens_per_step"]
    # Both sides train on the same batch at step i: the ratio of their times step by step, over every run's pair
    paired = statistics.median(a / b for ours_run, trl_run in zip(runs["rlcore"], runs["trl"])
                               for a, b in zip(ours_run["step_s"], trl_run["step_s"]))
    result: dict[str, Any] = {
        "benchmark": "sft_cpu",
        "rlcore_step_s": round(median_of("rlcore", "median_step_s"), 4),
        "trl_step_s": round(median_of("trl", "median_step_s"), 4),
        "ratio_step": round(median_of("rlcore", "median_step_s") / median_of("trl", "median_step_s"), 3),
        "rlcore_tokens_per_s": round(median_of("rlcore", "tokens_per_s"), 1),
        "trl_tokens_per_s": round(median_of("trl", "tokens_per_s"), 1),
        "ratio_tokens_per_s": round(median_of("rlcore", "tokens_per_s") / median_of("trl", "tokens_per_s"), 3),
        "ratio_paired_steps": round(paired, 3),
        "rlcore_first_step_end_s": round(median_of("rlcore", "first_step_end_s"), 2),
        "trl_first_step_end_s": round(median_of("trl", "first_step_end_s"), 2),
        "per_run": {side: [{k: round(v, 4) for k, v in run.items() if isinstance(v, float)} for run in rs]
                    for side, rs in runs.items()},
        "step_s": {side: [[round(x, 4) for x in run["step_s"]] for run in rs] for side, rs in runs.items()},
        "same_batches": same_batches,
        "tokens_per_step": {side: rs[0]["tokens_per_step"] for side, rs in runs.items()},
        "losses": {side: [round(x, 4) for x in rs[0]["losses"]] for side, rs in runs.items()},
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "model": {**SHAPE, "vocab": "tiny byte-level tokenizer (267 ids)", "dtype": "float32"},
        "data": f"{ROWS} synthetic chat rows, question 4-30 words, answer 4-120 words",
        "same": SAME, "global_batch": MICRO,
        "settings": {"rlcore": {k: ours.get(k) for k in SHOWN}, "trl": {k: theirs.get(k) for k in SHOWN},
                     "differ": differs},
        "torch_threads": args.threads,
        "load_average_1_5_15min": {"before": [round(x, 2) for x in load_before],
                                   "after": [round(x, 2) for x in os.getloadavg()]},
        "environment": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if ray_rows:
        result["ray"] = {name: {**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                                   if k not in ("tokens_per_step", "losses", "step_s")},
                                "same_batches_as_one_process": row["tokens_per_step"] == runs["rlcore"][0]["tokens_per_step"],
                                "last_loss": round(row["losses"][-1], 4)}
                         for name, row in ray_rows.items()}
        result["ray"]["note"] = (f"rlcore on a local Ray with 2 CPUs: 1 worker of batch {MICRO}, then 2 workers (gloo) "
                                 f"of batch {MICRO // 2} each; {os.cpu_count()} cores shared by the workers and the "
                                 "driver, so not a scaling figure")

    print(f"\nSFT on the CPU, {args.threads} torch thread(s) per process; tiny Qwen2 shape {SHAPE['num_layers']} layers "
          f"x hidden {SHAPE['hidden_size']}, float32; packing {SAME['packing']}, max_length {SAME['max_length']}, "
          f"global batch {MICRO}; median over steps {args.warmup + 1}-{args.steps} of {args.repeats} alternating runs")
    print(f"{'side':<42}{'median step s':>14}{'tokens/s':>11}{'1st step end s':>16}")
    rows = [("rlcore sft, one process (no Ray)", "rlcore"), ("TRL SFTTrainer, directly", "trl")]
    for label, side in rows:
        print(f"{label:<42}{median_of(side, 'median_step_s'):>14.4f}{median_of(side, 'tokens_per_s'):>11.0f}"
              f"{median_of(side, 'first_step_end_s'):>16.2f}")
    print(f"{'ratio rlcore / TRL':<42}{result['ratio_step']:>14.3f}{result['ratio_tokens_per_s']:>11.3f}"
          "   (step time: lower is better; tokens/s: higher)")
    print(f"{'  paired: median of step i / step i':<42}{paired:>14.3f}   (the same batch on both sides)")
    for name, row in ray_rows.items():
        workers = name.rsplit("_", 1)[1]
        label = f"rlcore sft on Ray, {workers} CPU worker{'s' if workers != '1' else ''}" + (" *" if workers == "2" else "")
        print(f"{label:<42}{row['median_step_s']:>14.4f}{row['tokens_per_s']:>11.0f}{row['first_step_end_s']:>16.2f}")
    if ray_rows:
        print(f"  * 2 workers of batch {MICRO // 2} (gloo) on the machine's {os.cpu_count()} cores, shared with the "
              "driver: not a scaling claim")
    print(f"same batches on both sides (tokens per step equal): {same_batches}; last loss rlcore "
          f"{runs['rlcore'][0]['losses'][-1]:.4f}, TRL {runs['trl'][0]['losses'][-1]:.4f}"
          + "".join(f"; Ray {n[-1]} worker(s): same batches {r['same_batches_as_one_process']}, last loss "
                    f"{r['last_loss']:.4f}" for n, r in result.get("ray", {}).items() if n != "note"))
    print(f"\n{'SFTConfig field (read back)':<34}{'rlcore':>22}{'TRL':>22}")
    for key in SHOWN:
        a, b = ours.get(key), theirs.get(key)
        print(f"{key:<34}{str(a):>22}{str(b):>22}{'   DIFFERS' if a != b else ''}")
    others = [k for k in differs if k not in SHOWN]
    print("other fields that differ: " + (", ".join(f"{k} ({differs[k]['rlcore']!r} vs {differs[k]['trl']!r})"
                                                    for k in others) or "none"))
    print("TRL side: PrinterCallback removed, as rlcore removes it (no log dict printed per step)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
