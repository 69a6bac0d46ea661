"""SFT on two GPUs, side by side: rlcore on Ray (2 workers, one NCCL data-parallel world, TRL's SFTTrainer in
each) against `accelerate launch` of TRL's SFTTrainer on the same 2 GPUs, and rlcore on 1 GPU for scaling.

The same random-weight Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary 32000,
bf16), the same synthetic chat rows of mixed lengths, packing on, max_length 2048, the same per-device batch,
global batch, optimizer, schedule and steps (`SAME`). Tokens per second come from TRL's own `num_tokens` log
(the tokens of every process, gathered) between step SKIP and the last step, over the wall-clock time between
the two: for rlcore measured on the driver at each step's end (so Ray's calls are inside it), for TRL on rank
0 at each step's end.

    python benchmarks/sft_gpu.py                  # nvidia-h200-x2; --steps N --json PATH

Targets: rlcore on 2 GPUs >= 0.97x TRL's throughput (Ray costs next to nothing), and >= 1.8x rlcore on 1 GPU.
Results go to benchmarks/results/sft_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fair import chat_rows

SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=4096, dtype="bfloat16")
ROWS, STEPS, SKIP, MICRO = 8192, 30, 5, 4
# Keys TRL's SFTConfig and rlcore's SFTConfig spell the same way, set to the same values on every side.
SAME: dict[str, Any] = dict(
    max_length=2048, packing=True, per_device_train_batch_size=MICRO, gradient_accumulation_steps=1,
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


def throughput(stamps: list[dict], skip: int) -> dict:
    """Tokens per second between step `skip` and the last step, and the median step time."""
    first, last = stamps[skip - 1], stamps[-1]
    tokens = last["num_tokens"] - first["num_tokens"]
    seconds = last["t"] - first["t"]
    steps = sorted(b["t"] - a["t"] for a, b in zip(stamps[skip - 1 :], stamps[skip:]))
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "median_step_s": steps[len(steps) // 2], "steps": len(stamps)}


def run_rlcore(model: str, data: str, tmp: Path, gpus: int, steps: int) -> dict:
    out = tmp / f"rlcore-{gpus}gpu"
    stamps = tmp / f"rlcore-{gpus}gpu.json"
    plugin = tmp / f"timing_{gpus}.py"
    plugin.write_text(TIMING.format(out=str(stamps)))
    overrides = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in SAME.items()]
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", "sft", "--with", str(plugin), "--use-ray",
           f"model={model}", f"dataset={data}", f"output_dir={out}", f"max_steps={steps}", f"default.gpus={gpus}",
           "dtype=bfloat16", "save_steps=0", *overrides]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    if done.returncode:
        raise SystemExit(f"rlcore on {gpus} GPU(s) failed:\n{done.stderr[-4000:]}")
    return {"stamps": json.loads(stamps.read_text()), "wall_s": time.perf_counter() - started,
            "cmd": " ".join(cmd[1:])}


def run_trl(model: str, data: str, tmp: Path, steps: int) -> dict:
    stamps = tmp / "trl-2gpu.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "bf16", "--dynamo_backend", "no", __file__, "--trl-child", "--model", model,
           "--data", data, "--out", str(stamps), "--steps", str(steps), "--output-dir", str(tmp / "trl-2gpu")]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    if done.returncode:
        raise SystemExit(f"accelerate launch of TRL's SFTTrainer failed:\n{done.stderr[-4000:]}")
    return {"stamps": json.loads(stamps.read_text()), "wall_s": time.perf_counter() - started,
            "cmd": " ".join(cmd[1:])}


def trl_child(model: str, data: str, out: str, steps: int, output_dir: str) -> None:
    """One process of `accelerate launch`: TRL's SFTTrainer as its documentation runs it; rank 0 stamps."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rows: list[dict] = []

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "num_tokens" in logs:
                rows.append({"step": state.global_step, "t": time.perf_counter(), "num_tokens": logs["num_tokens"]})

    args = SFTConfig(**SAME, output_dir=output_dir, max_steps=steps, logging_steps=1, save_strategy="no",
                     report_to="none", disable_tqdm=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype="bfloat16"), args=args,
                         train_dataset=load_dataset("json", data_files=data, split="train"),
                         processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    if trainer.is_world_process_zero():
        Path(out).write_text(json.dumps(rows))


def print_table(results: dict[str, dict], ratios: dict[str, float]) -> None:
    print(f"\nSFT, Qwen2-0.5B shape (random bf16), packing, max_length {SAME['max_length']}, "
          f"per-device batch {MICRO}, steps {SKIP + 1}-{results['rlcore_2gpu']['steps']}")
    print(f"{'side':<34} {'GPUs':>4} {'global batch':>12} {'median step s':>13} {'tokens/s':>12}")
    for name, label, gpus in (("trl_2gpu", "TRL SFTTrainer, accelerate launch", 2),
                              ("rlcore_2gpu", "rlcore sft on Ray, 2 workers", 2), ("rlcore_1gpu", "rlcore sft on Ray, 1 worker", 1)):
        r = results[name]
        print(f"{label:<34} {gpus:>4} {MICRO * gpus:>12} {r['median_step_s']:>13.3f} {r['tokens_per_s']:>12,.0f}")
    print(f"rlcore 2 GPUs / TRL 2 GPUs:    {ratios['rlcore_vs_trl']:.3f}  (target >= 0.97)")
    print(f"rlcore 2 GPUs / rlcore 1 GPU:  {ratios['scaling']:.3f}  (target >= 1.8)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--json", default="benchmarks/results/sft_gpu.json")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--data", "--out", "--output-dir"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args.model, args.data, args.out, args.steps, args.output_dir)
        return
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"benchmarks/sft_gpu.py needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    from rlcore.testing import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="rlcore-sft-bench-"))
    try:
        model = str(build_tiny_model(tmp / "qwen2-0.5b-shape", **SHAPE))
        data = tmp / "chats.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(ROWS, question=(4, 60), answer=(8, 600))))
        raw = {"trl_2gpu": run_trl(model, str(data), tmp, args.steps),
               "rlcore_2gpu": run_rlcore(model, str(data), tmp, 2, args.steps),
               "rlcore_1gpu": run_rlcore(model, str(data), tmp, 1, args.steps)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {name: {**throughput(r["stamps"], SKIP), "wall_s": r["wall_s"], "cmd": r["cmd"]} for name, r in raw.items()}
    ratios = {"rlcore_vs_trl": results["rlcore_2gpu"]["tokens_per_s"] / results["trl_2gpu"]["tokens_per_s"],
              "scaling": results["rlcore_2gpu"]["tokens_per_s"] / results["rlcore_1gpu"]["tokens_per_s"]}
    print_table(results, ratios)
    out = {"benchmark": "sft_gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpus": torch.cuda.get_device_name(0),
           "shape": SHAPE, "same": SAME, "rows": ROWS, "skip": SKIP, "results": results, "ratios": ratios,
           "targets": {"rlcore_vs_trl": 0.97, "scaling": 1.8},
           "met": {"rlcore_vs_trl": ratios["rlcore_vs_trl"] >= 0.97, "scaling": ratios["scaling"] >= 1.8}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
