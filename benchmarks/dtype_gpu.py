"""The user's GRPO path on one GPU, with every role's default dtype against float32: `rlcore run --plugin grpo
--use-ray --config examples/ray/grpo/colocate.yaml`, scaled to one GPU, on a random Qwen2-0.5B-shaped bf16
checkpoint, as a user runs it (a subprocess each, Ray, vLLM colocated and sleeping, offload on).

    python benchmarks/dtype_gpu.py                 # auto, float32, auto, float32 (--rounds 2), one H200
    python benchmarks/dtype_gpu.py --smoke         # a tiny model on the CPU, hf rollout: the code path only

Side A is the example as it is (dtype `auto` for both roles); side B adds `train.dtype=float32
rollout.dtype=float32`, the defaults before `auto`. The sides alternate (A, B, A, B) so that a machine whose
speed drifts between runs shows as spread, not as a difference. Each run's placement lines (which give each
role's dtype) are checked and kept. The table gives each run's median step time (steps after the first two),
the per-round ratio A / B, its median and spread. `--json PATH` (default benchmarks/results/dtype_gpu-<date>-
<kind>.json) is written after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fair import build_model, git_commit, results_path, write_json

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ray" / "grpo" / "colocate.yaml"
SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, vocab_size=1024)
STEPS, SKIP = 6, 2
# what the run sets beside the example: one GPU, the data, the work's size, and the toy reward (a random model
# scores 0 on accuracy, so its groups would give no gradient)
SCALE = ["train.gpus=1", "rollout.gpus=1", "num_generations=8", "per_device_train_batch_size=16",
         "gradient_accumulation_steps=4", "max_completion_length=256", "reward_funcs=[toy,format]",
         "rollout.vllm_max_model_len=1024"]
SMOKE_SCALE = ["train.gpus=0", "rollout.gpus=0", "colocate_groups=[]", "rollout.engine=hf", "num_generations=4",
               "per_device_train_batch_size=4", "gradient_accumulation_steps=2", "max_completion_length=8",
               "reward_funcs=[toy,format]"]
SIDES = {"auto": [], "float32": ["train.dtype=float32", "rollout.dtype=float32"]}
STAMPS = '''
import json, os, time
from rlcore import hookimpl

@hookimpl
def rlcore_step_end(trainer, step, metrics):
    with open(os.environ["RLCORE_BENCH_STAMPS"], "a") as f:
        f.write(json.dumps({"step": step, "t": time.perf_counter()}) + "\\n")
'''


def run(side: str, model: str, data: Path, work: Path, smoke: bool) -> dict:
    out, stamps = work / f"{side}-{time.time_ns()}", work / f"stamps-{time.time_ns()}.jsonl"
    (work / "stamps.py").write_text(STAMPS)
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "--with", str(work / "stamps.py"),
           *([] if smoke else ["--use-ray"]), "--config", str(EXAMPLE), f"model={model}", f"dataset={data}",
           f"output_dir={out}", f"max_steps={2 if smoke else STEPS}", "save_steps=0", "logging_steps=1",
           *(SMOKE_SCALE if smoke else SCALE), *SIDES[side]]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RLCORE_BENCH_STAMPS": str(stamps)},
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{side}: exit {done.returncode}: {done.stderr[-1500:]}")
    times = [json.loads(line)["t"] for line in stamps.read_text().splitlines()]
    steps = [b - a for a, b in zip(times, times[1:])]
    placement = [line for line in done.stderr.splitlines() if line.startswith(("rlcore: train:", "rlcore: rollout:"))]
    measured = steps[SKIP - 1:] if not smoke else steps
    return {"step_s": round(statistics.median(measured), 4) if measured else None, "steps_s": [round(s, 3) for s in steps],
            "placement": placement, "wall_s": round(time.perf_counter() - started, 1), "command": cmd[3:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="A, B pairs, alternating")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, hf rollout, no Ray")
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"))
    args = parser.parse_args()
    path = results_path(args.json, f"dtype_gpu-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    record: dict = {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                    "example": str(EXAMPLE.relative_to(ROOT)), "overrides": SMOKE_SCALE if args.smoke else SCALE,
                    "sides": SIDES, "runs": []}
    with tempfile.TemporaryDirectory() as tmp_dir:
        work = Path(tmp_dir)
        model = build_model(work / "model", SHAPE, SMOKE_SHAPE if args.smoke else None)
        data = work / "sums.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "solution": str(a + b)}) + "\n"
                                for a in range(1, 9) for b in range(1, 9)))
        for round_ in range(args.rounds):
            for side in SIDES:
                result = run(side, model, data, work, args.smoke)
                record["runs"].append({"round": round_, "side": side, **result})
                write_json(path, record)
                print(f"round {round_} {side:8s} step {result['step_s']} s  {'; '.join(result['placement'])}", flush=True)
    by = {side: [r["step_s"] for r in record["runs"] if r["side"] == side] for side in SIDES}
    ratios = [a / b for a, b in zip(by["auto"], by["float32"]) if a and b]
    if ratios:
        record.update(ratio_auto_over_float32=[round(r, 3) for r in ratios], median_ratio=round(statistics.median(ratios), 3),
                      spread=[round(min(ratios), 3), round(max(ratios), 3)])
        write_json(path, record)
    print(f"\n{'side':<10}{'median step (s)':>18}   runs")
    for side, steps in by.items():
        print(f"{side:<10}{statistics.median(steps):>18.3f}   {steps}")
    if ratios:
        print(f"ratio auto / float32: median {record['median_ratio']:.3f}, spread {record['spread']}, per round {record['ratio_auto_over_float32']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
