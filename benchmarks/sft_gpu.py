"""SFT on one GPU, side by side: rlcore as a user runs it (`rlcore run --plugin sft --use-ray --config
examples/ray/sft/multi_node.yaml`, scaled to one GPU: 1 worker, TRL's SFTTrainer inside) against TRL's SFTTrainer in
one process, on the same work, interleaved in rounds.

rlcore's side keeps the example's settings (packing, gradient checkpointing, bf16, the optimizer and its cosine
schedule with warmup, dtype auto) except the keys both sides must share: the model, the data, the batch, the
length and the steps (`SHARED`); TRL gets the values rlcore's run resolved for every key both spell the same way
(`PEER`), so a slow default shows in the ratio. The table says which keys were set.

The same random-weight Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary 32000, bf16
checkpoint, drawn on the GPU once), the same synthetic chat rows of mixed lengths, max_length 2048, per-device batch
4, 25 steps. Both sides run TRL's own data pipeline, so step n trains the same tokens on both. The sides run TRL,
rlcore, TRL, rlcore (`--rounds`, default 2), each in a fresh process; the table gives each round's ratio, their
median and range.

Each side reports two measures, and the table gives both with what lies between them:
- the median step: the middle of each step's seconds (steps SKIP+1..N), insensitive to stalls;
- window throughput: tokens trained over the wall-clock seconds from step SKIP to the last step.
Tokens are counted identically on both sides: the deltas of TRL's own `num_tokens` log between step ends (the
tokens of each step's flattened batch), so a difference in tokens per step shows up as such; the steps slower
than 1.5 x the median (stalls: logging, data, allocator) are listed with their seconds. When tokens per step
agree, window throughput is what a user waits for; a ratio of medians that differs from the ratio of
throughputs is the stalls' share, printed.

    python benchmarks/sft_gpu.py                  # both sides, one GPU, 2 rounds: about 5 minutes
    python benchmarks/sft_gpu.py --only trl       # one side (kept in the JSON)
    python benchmarks/sft_gpu.py --smoke --rounds 1   # a tiny model on the CPU, float32, 3 steps: the code paths only
    python benchmarks/sft_gpu.py --profile        # + one step of each side under torch's profiler (where the time goes)

Target (issue 24): rlcore's median step <= 1.0 x TRL's, by the median over the rounds. Results (`--json PATH`,
default benchmarks/results/sft_gpu-<date>-<kind>.json, written after each side) with both sides' settings, the
example and the keys set on it, and the git commit; a side that fails is recorded with its stderr's end and the
other still runs.
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

from fair import (build_model, chat_rows, failure, git_commit, host_info, interleave, print_provenance, profile_env,
                  provenance, read_profile, results_path, rlcore_run, scaled, spread, spread_text, user_config,
                  write_json)

SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=4096, dtype="bfloat16")
ROWS, STEPS, SKIP, MICRO = 2048, 25, 5, 4
# --smoke: a tiny model on the CPU, 64 rows, blocks of 256 tokens, float32, 3 steps with the first skipped
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, vocab_size=1024, max_position_embeddings=4096)
SMOKE_ROWS, SMOKE_STEPS, SMOKE_SKIP = 64, 3, 1
EXAMPLE = "sft/multi_node.yaml"
# The keys set on rlcore's example, and given to TRL alike (with the model, the data and the steps)
SHARED: dict[str, Any] = dict(max_length=2048, per_device_train_batch_size=MICRO, gradient_accumulation_steps=1)
SMOKE = dict(max_length=256, bf16=False)  # --smoke, both sides: the CPU has no bf16 autocast to count on
# Keys TRL's SFTConfig and rlcore's SFTConfig spell the same way: TRL gets rlcore's resolved values
PEER = ("max_length", "packing", "padding_free", "per_device_train_batch_size", "gradient_accumulation_steps",
        "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "bf16",
        "gradient_checkpointing", "seed", "dataloader_num_workers")


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


def rlcore_keys(model: str, data: str, tmp: Path, steps: int, gpu: bool) -> tuple[dict, dict, dict]:
    """(shared, scaling, own) keys of rlcore's run: the GPU run's (`gpu`), or --smoke's on the CPU."""
    shared = {"model": model, "dataset": data, "max_steps": steps, **SHARED, **({} if gpu else SMOKE)}
    return shared, {**scaled(EXAMPLE, 1 if gpu else 0), "output_dir": str(tmp / "rlcore")}, {}


def flat(parts: tuple[dict, ...]) -> dict[str, Any]:
    return {k: v for part in parts for k, v in part.items()}


def run_rlcore(keys: dict[str, Any], tmp: Path, steps: int, profile: bool = False) -> dict:
    """rlcore's side, one round: `rlcore run --plugin sft --use-ray` on the example; the stamps carry TRL's token
    count (its `num_tokens` metric)."""
    env, profiled = profile_env(tmp, "rlcore", max(0, steps - 2), TRAINING_STEP) if profile else ({}, None)
    run = rlcore_run("sft", EXAMPLE, keys, tmp, "rlcore", use_ray=True, env=env)
    starts = [0.0]
    for s in run["step_s"]:
        starts.append(starts[-1] + s)
    stamps = [{"step": i + 1, "t": t, "num_tokens": row.get("num_tokens")}
              for i, (t, row) in enumerate(zip(starts[1:], run["rows"]))]
    settings = {"framework": "rlcore run --plugin sft --use-ray, 1 worker (TRL's SFTTrainer inside)",
                "stamped": "on the driver at each step's end (Ray's call inside)"}
    return {"stamps": stamps, "wall_s": run["wall_s"], "cmd": run["cmd"], "settings": settings,
            "profile": profiled and read_profile(profiled)}


def run_trl(model: str, data: str, tmp: Path, steps: int, smoke: bool = False, profile: bool = False) -> dict:
    stamps = tmp / "trl.json"
    cmd = [sys.executable, __file__, "--trl-child", "--model", model, "--data", data, "--out", str(stamps),
           "--steps", str(steps), "--output-dir", str(tmp / "trl"), "--peer", str(tmp / "peer.json")]
    cmd += ["--smoke"] if smoke else []
    extra, profiled = profile_env(tmp, "trl", max(0, steps - 2), TRAINING_STEP) if profile else ({}, None)
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **extra})
    done.check_returncode()  # the CalledProcessError carries the child's stderr into the results row
    result = json.loads(stamps.read_text())
    return {"stamps": result["stamps"], "wall_s": round(time.perf_counter() - started, 1), "cmd": " ".join(cmd[1:]),
            "settings": result["settings"], "profile": profiled and read_profile(profiled)}


def trl_child(model: str, data: str, out: str, steps: int, output_dir: str, peer: dict[str, dict[str, Any]],
              smoke: bool = False) -> None:
    """TRL's SFTTrainer in this one process, as its documentation runs it, with rlcore's values of the keys both
    spell alike (`peer`: the GPU run's, and --smoke's on the CPU); stamps at each step's log."""
    from datasets import load_dataset
    from fair import trl_args
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rows: list[dict] = []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                rows.append({"step": state.global_step, "t": time.perf_counter(), "num_tokens": logs["num_tokens"]})

    args = trl_args(SFTConfig, dict(peer["gpu"], output_dir=output_dir, max_steps=steps, logging_steps=1,
                                    save_strategy="no", report_to="none", disable_tqdm=True),
                    dict(peer["run"], use_cpu=True) if smoke else None)
    dtype = "float32" if smoke else "bfloat16"
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=dtype), args=args,
                         train_dataset=load_dataset("json", data_files=data, split="train"),
                         processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Clock()])
    settings = {k: getattr(args, k) for k in PEER}
    settings.update(packing_strategy=args.packing_strategy, padding_free_in_effect=trainer.padding_free,
                    attn_implementation=trainer.model.config._attn_implementation,
                    framework="trl.SFTTrainer, one process", stamped="on_log at each step (logging_steps 1)")
    trainer.train()
    Path(out).write_text(json.dumps({"stamps": rows, "settings": settings}, default=str))


TRAINING_STEP = ("trl.trainer.sft_trainer", "SFTTrainer", "training_step")  # --profile's, on both sides alike


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
    parser.add_argument("--rounds", type=int, default=2, help="rounds of TRL, rlcore (default 2)")
    parser.add_argument("--json", help="default benchmarks/results/sft_gpu-<date>-<kind>.json")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, float32, 3 steps: the code "
                        "paths only (rlcore's and TRL's GPU configs are built there too)")
    parser.add_argument("--profile", action="store_true", help="each side's second-to-last training_step under "
                        "torch's profiler (the same wrapper on both; its table is printed and kept in the JSON; the "
                        "step times of such a run include it)")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--data", "--out", "--output-dir", "--peer"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps, skip = (args.steps or SMOKE_STEPS, SMOKE_SKIP) if args.smoke else (args.steps or STEPS, SKIP)
    if args.trl_child:
        trl_child(args.model, args.data, args.out, steps, args.output_dir, json.loads(Path(args.peer).read_text()),
                  args.smoke)
        return

    HOST.update(host_info())
    started = time.perf_counter()
    path = results_path(args.json, f"sft_gpu-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    kept = json.loads(path.read_text()).get("sides", {}) if args.only and path.exists() else {}
    sides: dict[str, dict] = {}  # sides run in calls of their own (--only) add up in one file
    rounds: list[dict[str, dict]] = []
    tmp = Path(tempfile.mkdtemp(prefix="rlcore-sft-bench-"))
    try:
        model, data = build(tmp, args.smoke)
        # the GPU run's config, loaded and checked as `rlcore config validate` does (on the CPU too, under --smoke)
        gpu = rlcore_keys(model, data, tmp, steps, gpu=True)
        gpu_config = user_config("sft", EXAMPLE, flat(gpu))
        keys = rlcore_keys(model, data, tmp, steps, gpu=not args.smoke)
        config = user_config("sft", EXAMPLE, flat(keys)) if args.smoke else gpu_config
        peer = {"gpu": {k: getattr(gpu_config, k) for k in PEER}, "run": {k: getattr(config, k) for k in PEER}}
        (tmp / "peer.json").write_text(json.dumps(peer))
        RUN.update(provenance(EXAMPLE, *keys))
        from rlcore.engine_checks import resolve_dtype

        rlcore_settings = {**peer["run"], "dtype": f"{config.dtype} -> {resolve_dtype(config.dtype, model, not args.smoke)}",
                           "run_ahead": config.run_ahead}
        for index, name in interleave(["trl", "rlcore"] if args.only is None else [args.only], args.rounds):
            while len(rounds) <= index:
                rounds.append({})
            try:
                if name == "rlcore":
                    out = {"output_dir": str(tmp / f"rlcore-{index + 1}")}  # fresh each round: a used one holds checkpoints
                    raw = run_rlcore({**flat(keys), **out}, tmp, steps, args.profile)
                    raw["settings"] = {**rlcore_settings, **raw["settings"]}
                else:
                    raw = run_trl(model, data, tmp, steps, args.smoke, args.profile)
                row = {**measures(raw["stamps"], skip), **{k: raw[k] for k in ("settings", "wall_s", "cmd")}}
                if args.profile:  # the profiled step is among those measured: a --profile run's times are not a result
                    row["profile"] = raw["profile"] or "not written (the profiled step did not run)"
            except Exception as error:  # noqa: BLE001 - the other side still runs
                row = failure(error)
            row["commit"] = git_commit()
            rounds[index][name] = row
            sides[name] = {**row, "rounds": [r[name] for r in rounds if name in r]}
            write_json(path, result({**kept, **sides}, rounds, args, steps, skip, started))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record = result({**kept, **sides}, rounds, args, steps, skip, started)
    write_json(path, record)
    print(f"\nSFT on one GPU, Qwen2-0.5B shape (random bf16 checkpoint), max_length {config.max_length}, per-device "
          f"batch {MICRO}, steps {skip + 1}-{steps}")
    print(f"{'side':<20}{'round':>6}{'median step s':>14}{'mean step s':>12}{'window tok/s':>14}{'tokens/step':>13}"
          f"{'stall s':>9}")
    for index, done in enumerate(rounds):
        for name, m in done.items():
            if "failed" in m:
                print(f"{name:<20}{index + 1:>6}  FAILED: {m['failed']}")
                continue
            print(f"{name:<20}{index + 1:>6}{m['median_step_s']:>14.3f}{m['mean_step_s']:>12.3f}{m['tokens_per_s']:>14,.0f}"
                  f"{m['median_tokens_per_step']:>13,.0f}{m['stall_s']:>9.2f}")
    print("\n".join(record["explanation"]))
    if "ratio" in record:
        print(f"rlcore / TRL median step, by round: {spread_text(record['ratio'])} (target <= 1.0 by the median: "
              f"{'met' if record['met'] else 'NOT met'})")
    print_provenance({"rlcore_runs": {"rlcore": RUN}})
    rl, trl = sides.get("rlcore", {}).get("settings", {}), sides.get("trl", {}).get("settings", {})
    print(f"\n{'setting':<30}{'rlcore':>28}{'TRL':>28}")
    for key in dict.fromkeys([*rl, *trl]):
        value, other = rl.get(key, "-"), trl.get(key, "-")
        print(f"{key:<30}{str(value):>28}{str(other):>28}{'' if value == other else '   DIFFERS'}")
    print(f"wrote {path}")
    failed = sorted({name for done in rounds for name, side in done.items() if "failed" in side})
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


HOST: dict[str, Any] = {}  # host_info() of the machine this call ran on (main() measures it once)
RUN: dict[str, Any] = {}  # rlcore's example and the keys set on it


def result(sides: dict[str, dict], rounds: list[dict[str, dict]], args: argparse.Namespace, steps: int, skip: int,
           started: float) -> dict[str, Any]:
    """The results JSON: both sides' measures (the last round's, each round's under `rounds`), settings and commits,
    rlcore's example and keys, what lies between the measures, the per-round ratio and the target."""
    measured = {name: side for name, side in sides.items() if "failed" not in side}
    record: dict[str, Any] = {"benchmark": "sft_gpu", "kind": args.kind, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "commit": git_commit(), "smoke": args.smoke, "host": HOST, "shape": SHAPE, "rows": ROWS,
                              "steps": steps, "skip": skip, "shared": SHARED, "rlcore_runs": {"rlcore": RUN},
                              "sides": sides, "explanation": explain(measured),
                              "wall_s": round(time.perf_counter() - started, 1),
                              "target": "rlcore's median step <= 1.0 x TRL's, the median over the rounds"}
    pairs = [(r["rlcore"], r["trl"]) for r in rounds
             if "median_step_s" in r.get("rlcore", {}) and "median_step_s" in r.get("trl", {})]
    if pairs:
        ratios = [ours["median_step_s"] / theirs["median_step_s"] for ours, theirs in pairs]
        windows = [ours["tokens_per_s"] / theirs["tokens_per_s"] for ours, theirs in pairs]
        record.update(ratio=spread(ratios), ratio_median_step=round(statistics.median(ratios), 3),
                      met=statistics.median(ratios) <= 1.0, ratio_window_throughput=spread(windows))
    return record

if __name__ == "__main__":
    main()
