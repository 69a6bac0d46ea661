"""SFT on one GPU, side by side: rlcore (`rlcore run --plugin sft --use-ray`, 1 worker, TRL's SFTTrainer inside)
against TRL's SFTTrainer in one process, on the same work.

The same random-weight Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary 32000,
bf16, drawn on the GPU), the same synthetic chat rows of mixed lengths, and the same TRL settings on both sides
(`SAME`): packing (TRL's best-fit-decreasing) with `padding_free` set on both, max_length 2048, per-device batch
4, optimizer, schedule, seed, 25 steps. Both sides run TRL's own data pipeline, so step n trains the same
tokens on both.

Each side reports two measures, and the table gives both with what lies between them:
- the median step: the middle of each step's seconds (steps SKIP+1..N), insensitive to stalls;
- window throughput: tokens trained over the wall-clock seconds from step SKIP to the last step.
Tokens are counted identically on both sides: the deltas of TRL's own `num_tokens` log between step ends (the
tokens of each step's flattened batch), so a difference in tokens per step shows up as such; the steps slower
than 1.5 x the median (stalls: logging, data, allocator) are listed with their seconds. When tokens per step
agree, window throughput is what a user waits for; a ratio of medians that differs from the ratio of
throughputs is the stalls' share, printed.

    python benchmarks/sft_gpu.py                  # both sides, one GPU, about 3 minutes
    python benchmarks/sft_gpu.py --only trl       # one side (kept in the JSON)
    python benchmarks/sft_gpu.py --smoke          # a tiny model on the CPU, float32, 3 steps: the code paths only
    python benchmarks/sft_gpu.py --profile        # + one step of each side under torch's profiler (where the time goes)

Target (issue 24): rlcore's median step <= 1.0 x TRL's. Results (`--json PATH`, default
benchmarks/results/sft_gpu-<date>-<kind>.json, written after each side) with both sides' settings and the git
commit; a side that fails is recorded with its stderr's end and the other still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fair import build_model, chat_rows, failure, git_commit, host_info, results_path, write_json

SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=4096, dtype="bfloat16")
ROWS, STEPS, SKIP, MICRO = 2048, 25, 5, 4
# --smoke: a tiny model on the CPU, 64 rows, blocks of 256 tokens, float32, 3 steps with the first skipped
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, vocab_size=1024, max_position_embeddings=512)
SMOKE_ROWS, SMOKE_STEPS, SMOKE_SKIP = 64, 3, 1
SMOKE = dict(max_length=256, bf16=False)
# Keys TRL's SFTConfig and rlcore's SFTConfig spell the same way, set to the same values on both sides.
SAME: dict[str, Any] = dict(
    max_length=2048, packing=True, padding_free=True, per_device_train_batch_size=MICRO, gradient_accumulation_steps=1,
    learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
    bf16=True, gradient_checkpointing=False, seed=42, dataloader_num_workers=0,
)
TIMING = '''
"""Stamps each step's end on the driver, with TRL's cumulative token count, into {out}."""
import json, time
from rlcore import hookimpl

rows = []


@hookimpl
def rlcore_step_end(trainer, step, metrics):
    rows.append({{"step": step, "t": time.perf_counter(), "num_tokens": metrics.get("num_tokens")}})
    with open({out!r}, "w") as f:
        json.dump(rows, f)
'''


def measures(stamps: list[dict], skip: int) -> dict:
    """Both measures from the step-end stamps, and what lies between them (see the module docstring)."""
    window = stamps[skip - 1 :]
    seconds = [b["t"] - a["t"] for a, b in zip(window, window[1:])]
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip(window, window[1:])]
    median = statistics.median(seconds)
    stalls = [(window[i + 1]["step"], round(s, 3)) for i, s in enumerate(seconds) if s > 1.5 * median]
    return {"median_step_s": round(median, 4), "mean_step_s": round(statistics.fmean(seconds), 4),
            "tokens_per_s": round(sum(tokens) / sum(seconds), 1), "window_s": round(sum(seconds), 3),
            "window_tokens": sum(tokens), "median_tokens_per_step": statistics.median(tokens),
            "median_step_tokens_per_s": round(statistics.median(t / s for t, s in zip(tokens, seconds)), 1),
            "stalls": stalls, "stall_s": round(sum(s - median for _, s in stalls), 3), "steps": len(stamps),
            "per_step_s": [round(s, 4) for s in seconds], "per_step_tokens": tokens}


def run_rlcore(model: str, data: str, tmp: Path, steps: int, smoke: bool = False, profile: bool = False) -> dict:
    out, stamps, plugin = tmp / "rlcore", tmp / "rlcore.json", tmp / "timing_rlcore.py"
    plugin.write_text(TIMING.format(out=str(stamps)))
    same = {**SAME, **SMOKE} if smoke else SAME
    overrides = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in same.items()]
    device = ["default.gpus=0", "dtype=float32"] if smoke else ["default.gpus=1", "dtype=bfloat16"]
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", "sft", "--with", str(plugin), "--use-ray",
           f"model={model}", f"dataset={data}", f"output_dir={out}", f"max_steps={steps}", *device, "save_steps=0",
           "run_ahead=true", *overrides]
    extra, profiled = profile_env(tmp, "rlcore", steps) if profile else ({}, None)
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **extra})
    done.check_returncode()  # the CalledProcessError carries the child's stderr into the results row
    settings = {**same, "framework": "rlcore run --plugin sft --use-ray, 1 worker (TRL's SFTTrainer inside)",
                "stamped": "on the driver at each step's end (Ray's call inside)",
                "run_ahead": "each step begins while the driver logs the last (rlcore's default)"}
    return {"stamps": json.loads(stamps.read_text()), "wall_s": round(time.perf_counter() - started, 1),
            "cmd": " ".join(cmd[1:]), "settings": settings, "profile": profiled and read_profile(profiled)}


def run_trl(model: str, data: str, tmp: Path, steps: int, smoke: bool = False, profile: bool = False) -> dict:
    stamps = tmp / "trl.json"
    cmd = [sys.executable, __file__, "--trl-child", "--model", model, "--data", data, "--out", str(stamps),
           "--steps", str(steps), "--output-dir", str(tmp / "trl")] + (["--smoke"] if smoke else [])
    extra, profiled = profile_env(tmp, "trl", steps) if profile else ({}, None)
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **extra})
    done.check_returncode()  # the CalledProcessError carries the child's stderr into the results row
    result = json.loads(stamps.read_text())
    return {"stamps": result["stamps"], "wall_s": round(time.perf_counter() - started, 1), "cmd": " ".join(cmd[1:]),
            "settings": result["settings"], "profile": profiled and read_profile(profiled)}


def trl_child(model: str, data: str, out: str, steps: int, output_dir: str, smoke: bool = False) -> None:
    """TRL's SFTTrainer in this one process, as its documentation runs it; stamps at each step's log."""
    from datasets import load_dataset
    from fair import trl_args
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rows: list[dict] = []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                rows.append({"step": state.global_step, "t": time.perf_counter(), "num_tokens": logs["num_tokens"]})

    args = trl_args(SFTConfig, dict(SAME, output_dir=output_dir, max_steps=steps, logging_steps=1, save_strategy="no",
                                    report_to="none", disable_tqdm=True), dict(SMOKE, use_cpu=True) if smoke else None)
    dtype = "float32" if smoke else "bfloat16"
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=dtype), args=args,
                         train_dataset=load_dataset("json", data_files=data, split="train"),
                         processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Clock()])
    settings = {k: getattr(args, k) for k in SAME}
    settings.update(packing_strategy=args.packing_strategy, padding_free_in_effect=trainer.padding_free,
                    attn_implementation=trainer.model.config._attn_implementation,
                    framework="trl.SFTTrainer, one process", stamped="on_log at each step (logging_steps 1)")
    trainer.train()
    Path(out).write_text(json.dumps({"stamps": rows, "settings": settings}, default=str))


# --profile, both sides alike: a sitecustomize on the PYTHONPATH of a side's run (TRL's child; rlcore's driver and
# the Ray workers that inherit it) that wraps TRL's SFTTrainer.training_step as soon as trl.trainer.sft_trainer is
# imported, in whichever process trains, and writes the profiled step's table to {out}
PROFILE_SITE = '''
import importlib.abc, importlib.util, json, sys
sys.path.insert(0, {fair!r})


def _patch(module):
    from fair import profile_nth_call
    sink = {{}}
    profile_nth_call(module.SFTTrainer, "training_step", {nth}, sink)
    profiled = module.SFTTrainer.training_step

    def training_step(*args, **kwargs):
        out = profiled(*args, **kwargs)
        if "table" in sink and not sink.get("written"):
            sink["written"] = True
            with open({out!r}, "w") as f:
                json.dump({{k: v for k, v in sink.items() if k != "written"}}, f)
        return out

    module.SFTTrainer.training_step = training_step


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "trl.trainer.sft_trainer":
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


def profile_env(tmp: Path, side: str, steps: int) -> tuple[dict[str, str], Path]:
    """--profile: the environment that profiles TRL's training_step at the second-to-last step (0-based
    steps - 2) of `side`'s run, and the file its table goes to."""
    out, site = tmp / f"profile-{side}.json", tmp / f"site-{side}"
    site.mkdir()
    nth = max(0, steps - 2)
    (site / "sitecustomize.py").write_text(PROFILE_SITE.format(fair=str(Path(__file__).resolve().parent), nth=nth,
                                                               out=str(out)))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}, out


def read_profile(out: Path) -> dict | None:
    """The profiled step ({seconds, self_cuda_s, self_cpu_s, table}), printed; None if it was not written."""
    if not out.is_file():
        return None
    found = json.loads(out.read_text())
    print(f"\n{out.stem}: one training_step under torch's profiler, {found['seconds']:.3f} s "
          f"(CUDA busy {found.get('self_cuda_s', 0):.3f} s, CPU {found['self_cpu_s']:.3f} s)\n{found['table']}")
    return found


def build(tmp: Path, smoke: bool = False) -> tuple[str, str]:
    """The model (drawn on the GPU in a child: the parent holds no CUDA memory; --smoke: a tiny one on the CPU)
    and the chat rows."""
    model = build_model(tmp / "qwen2-0.5b-shape", SHAPE, SMOKE_SHAPE if smoke else None)
    data = tmp / "chats.jsonl"
    rows = chat_rows(SMOKE_ROWS if smoke else ROWS, question=(4, 60), answer=(8, 600))
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, str(data)


def explain(sides: dict[str, dict]) -> list[str]:
    """Where the two measures part, in words."""
    lines = []
    for name, m in sides.items():
        lines.append(f"{name}: median step {m['median_step_s']:.3f} s, mean {m['mean_step_s']:.3f} s; "
                     f"{len(m['stalls'])} steps over 1.5x the median ({m['stall_s']:.2f} s above it): {m['stalls']}")
    if len(sides) == 2:
        r, t = sides["rlcore"], sides["trl"]
        lines.append(f"tokens per step (median): rlcore {r['median_tokens_per_step']:,.0f}, TRL {t['median_tokens_per_step']:,.0f}; "
                     f"window tokens: rlcore {r['window_tokens']:,}, TRL {t['window_tokens']:,}"
                     + ("" if r["window_tokens"] == t["window_tokens"] else "  <- the sides trained different tokens"))
        median_ratio = t["median_step_s"] / r["median_step_s"]
        window_ratio = r["tokens_per_s"] / t["tokens_per_s"]
        lines.append(f"rlcore's speed-up by median step {median_ratio:.3f}, by window throughput {window_ratio:.3f}: "
                     f"the difference is the steps off the median (stalls) and tokens per step")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default {STEPS}; --smoke {SMOKE_STEPS})")
    parser.add_argument("--only", choices=["rlcore", "trl"], help="run one side (kept in the JSON beside the other's)")
    parser.add_argument("--json", help="default benchmarks/results/sft_gpu-<date>-<kind>.json")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, float32, 3 steps: the code "
                        "paths only (TRL's GPU config is built there too)")
    parser.add_argument("--profile", action="store_true", help="each side's second-to-last training_step under "
                        "torch's profiler (the same wrapper on both; its table is printed and kept in the JSON; the "
                        "step times of such a run include it)")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--data", "--out", "--output-dir"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps, skip = (args.steps or SMOKE_STEPS, SMOKE_SKIP) if args.smoke else (args.steps or STEPS, SKIP)
    if args.trl_child:
        trl_child(args.model, args.data, args.out, steps, args.output_dir, args.smoke)
        return

    HOST.update(host_info())
    started = time.perf_counter()
    path = results_path(args.json, f"sft_gpu-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    kept = json.loads(path.read_text()).get("sides", {}) if args.only and path.exists() else {}
    sides: dict[str, dict] = {}  # sides run in calls of their own (--only) add up in one file
    tmp = Path(tempfile.mkdtemp(prefix="rlcore-sft-bench-"))
    try:
        model, data = build(tmp, args.smoke)
        for name, run in {"trl": run_trl, "rlcore": run_rlcore}.items():
            if args.only not in (None, name):
                continue
            try:
                raw = run(model, data, tmp, steps, args.smoke, args.profile)
                sides[name] = {**measures(raw["stamps"], skip), **{k: raw[k] for k in ("settings", "wall_s", "cmd")}}
                if args.profile:  # the profiled step is among those measured: a --profile run's times are not a result
                    sides[name]["profile"] = raw["profile"] or "not written (the profiled step did not run)"
            except Exception as error:  # noqa: BLE001 - the other side still runs
                sides[name] = failure(error)
            sides[name]["commit"] = git_commit()
            write_json(path, result({**kept, **sides}, args, steps, skip, started))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record = result({**kept, **sides}, args, steps, skip, started)
    write_json(path, record)
    print(f"\nSFT on one GPU, Qwen2-0.5B shape (random bf16), packing + padding_free, max_length {SAME['max_length']}, "
          f"per-device batch {MICRO}, steps {skip + 1}-{steps}")
    print(f"{'side':<26}{'median step s':>14}{'mean step s':>12}{'window tok/s':>14}{'tokens/step':>13}{'stall s':>9}")
    for name, m in record["sides"].items():
        if "failed" in m:
            print(f"{name:<26}FAILED: {m['failed']}")
            continue
        print(f"{name:<26}{m['median_step_s']:>14.3f}{m['mean_step_s']:>12.3f}{m['tokens_per_s']:>14,.0f}"
              f"{m['median_tokens_per_step']:>13,.0f}{m['stall_s']:>9.2f}")
    print("\n".join(record["explanation"]))
    if "ratio_median_step" in record:
        ratio = record["ratio_median_step"]
        print(f"rlcore / TRL median step: {ratio:.3f} (target <= 1.0: {'met' if record['met'] else 'NOT met'})")
    print(f"wrote {path}")
    failed = [name for name, side in sides.items() if "failed" in side]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


HOST: dict[str, Any] = {}  # host_info() of the machine this call ran on (main() measures it once)


def result(sides: dict[str, dict], args: argparse.Namespace, steps: int, skip: int, started: float) -> dict[str, Any]:
    """The results JSON: both sides' measures, settings and commits, what lies between the measures, the target."""
    measured = {name: side for name, side in sides.items() if "failed" not in side}
    record: dict[str, Any] = {"benchmark": "sft_gpu", "kind": args.kind, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "commit": git_commit(), "smoke": args.smoke, "host": HOST, "shape": SHAPE, "rows": ROWS,
                              "steps": steps,
                              "skip": skip, "same": SAME, "sides": sides, "explanation": explain(measured),
                              "wall_s": round(time.perf_counter() - started, 1),
                              "target": "rlcore's median step <= 1.0 x TRL's"}
    if len(measured) == 2:
        ratio = measured["rlcore"]["median_step_s"] / measured["trl"]["median_step_s"]
        record.update(ratio_median_step=round(ratio, 3), met=ratio <= 1.0,
                      ratio_window_throughput=round(measured["rlcore"]["tokens_per_s"] / measured["trl"]["tokens_per_s"], 3))
    return record

if __name__ == "__main__":
    main()
