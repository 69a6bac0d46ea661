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

Target (issue 24): rlcore's median step <= 1.0 x TRL's. Results: benchmarks/results/sft_gpu-<date>-<kind>.json
with both sides' settings and the git commit.
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

from fair import build_on_gpu, chat_rows, git_commit

SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=4096, dtype="bfloat16")
ROWS, STEPS, SKIP, MICRO = 2048, 25, 5, 4
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


def run_rlcore(model: str, data: str, tmp: Path, steps: int) -> dict:
    out, stamps, plugin = tmp / "rlcore", tmp / "rlcore.json", tmp / "timing_rlcore.py"
    plugin.write_text(TIMING.format(out=str(stamps)))
    overrides = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in SAME.items()]
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", "sft", "--with", str(plugin), "--use-ray",
           f"model={model}", f"dataset={data}", f"output_dir={out}", f"max_steps={steps}", "default.gpus=1",
           "dtype=bfloat16", "save_steps=0", *overrides]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    if done.returncode:
        raise SystemExit(f"rlcore failed:\n{done.stderr[-4000:]}")
    settings = {**SAME, "framework": "rlcore run --plugin sft --use-ray, 1 worker (TRL's SFTTrainer inside)",
                "stamped": "on the driver at each step's end (Ray's call inside)"}
    return {"stamps": json.loads(stamps.read_text()), "wall_s": round(time.perf_counter() - started, 1),
            "cmd": " ".join(cmd[1:]), "settings": settings}


def run_trl(model: str, data: str, tmp: Path, steps: int) -> dict:
    stamps = tmp / "trl.json"
    cmd = [sys.executable, __file__, "--trl-child", "--model", model, "--data", data, "--out", str(stamps),
           "--steps", str(steps), "--output-dir", str(tmp / "trl")]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"TRL's SFTTrainer failed:\n{done.stderr[-4000:]}")
    result = json.loads(stamps.read_text())
    return {"stamps": result["stamps"], "wall_s": round(time.perf_counter() - started, 1), "cmd": " ".join(cmd[1:]),
            "settings": result["settings"]}


def trl_child(model: str, data: str, out: str, steps: int, output_dir: str) -> None:
    """TRL's SFTTrainer in this one process, as its documentation runs it; stamps at each step's log."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rows: list[dict] = []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                rows.append({"step": state.global_step, "t": time.perf_counter(), "num_tokens": logs["num_tokens"]})

    args = SFTConfig(**SAME, output_dir=output_dir, max_steps=steps, logging_steps=1, save_strategy="no",
                     report_to="none", disable_tqdm=True)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype="bfloat16"), args=args,
                         train_dataset=load_dataset("json", data_files=data, split="train"),
                         processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Clock()])
    settings = {k: getattr(args, k) for k in SAME}
    settings.update(packing_strategy=args.packing_strategy, padding_free_in_effect=trainer.padding_free,
                    attn_implementation=trainer.model.config._attn_implementation,
                    framework="trl.SFTTrainer, one process", stamped="on_log at each step (logging_steps 1)")
    trainer.train()
    Path(out).write_text(json.dumps({"stamps": rows, "settings": settings}, default=str))


def build(tmp: Path) -> tuple[str, str]:
    """The model (drawn on the GPU in a child: the parent holds no CUDA memory) and the chat rows."""
    model = build_on_gpu(tmp / "qwen2-0.5b-shape", SHAPE)
    data = tmp / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(ROWS, question=(4, 60), answer=(8, 600))))
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
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--only", choices=["rlcore", "trl"], help="run one side")
    parser.add_argument("--json", help="default benchmarks/results/sft_gpu-<date>-<kind>.json")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--data", "--out", "--output-dir"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args.model, args.data, args.out, args.steps, args.output_dir)
        return

    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="rlcore-sft-bench-"))
    try:
        model, data = build(tmp)
        runs = {"trl": run_trl, "rlcore": run_rlcore}
        raw = {name: run(model, data, tmp, args.steps) for name, run in runs.items() if args.only in (None, name)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sides = {name: measures(r["stamps"], SKIP) for name, r in raw.items()}
    for name, r in raw.items():
        r["commit"] = git_commit()
    path = Path(args.json or f"benchmarks/results/sft_gpu-{time.strftime('%Y-%m-%d')}-{args.kind}.json")
    if args.only and path.exists():  # sides run in calls of their own add up in one file
        kept = json.loads(path.read_text()).get("sides", {})
        for name, side in kept.items():
            if name not in sides:
                sides[name] = {k: v for k, v in side.items() if k not in ("settings", "wall_s", "cmd", "commit")}
                raw[name] = side
    print(f"\nSFT on one GPU, Qwen2-0.5B shape (random bf16), packing + padding_free, max_length {SAME['max_length']}, "
          f"per-device batch {MICRO}, steps {SKIP + 1}-{args.steps}")
    print(f"{'side':<26}{'median step s':>14}{'mean step s':>12}{'window tok/s':>14}{'tokens/step':>13}{'stall s':>9}")
    for name, m in sides.items():
        print(f"{name:<26}{m['median_step_s']:>14.3f}{m['mean_step_s']:>12.3f}{m['tokens_per_s']:>14,.0f}"
              f"{m['median_tokens_per_step']:>13,.0f}{m['stall_s']:>9.2f}")
    lines = explain(sides)
    print("\n".join(lines))
    result: dict[str, Any] = {"benchmark": "sft_gpu", "kind": args.kind, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "commit": git_commit(), "shape": SHAPE, "rows": ROWS, "skip": SKIP, "same": SAME,
                              "sides": {n: {**sides[n], "settings": raw[n]["settings"], "wall_s": raw[n]["wall_s"],
                                            "cmd": raw[n]["cmd"], "commit": raw[n]["commit"]} for n in sides},
                              "explanation": lines, "wall_s": round(time.perf_counter() - started, 1),
                              "target": "rlcore's median step <= 1.0 x TRL's"}
    if len(sides) == 2:
        ratio = sides["rlcore"]["median_step_s"] / sides["trl"]["median_step_s"]
        result.update(ratio_median_step=round(ratio, 3), met=ratio <= 1.0,
                      ratio_window_throughput=round(sides["rlcore"]["tokens_per_s"] / sides["trl"]["tokens_per_s"], 3))
        print(f"rlcore / TRL median step: {ratio:.3f} (target <= 1.0: {'met' if ratio <= 1.0 else 'NOT met'})")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
