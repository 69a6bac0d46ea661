"""GRPO step time on the CPU: rlcore (local, Hugging Face engines) against TRL's GRPOTrainer (use_vllm=False).

Same tiny model (rlcore.plugins.hf.tiny), same toy task and reward, same batch: 8 prompts x 8 generations,
32 completion tokens, micro-batches of 32 with 2 accumulation steps (one optimizer step per generation),
beta 0, AdamW lr 1e-3, one torch thread count for both. The step time is the wall time between two
optimizer steps' ends, so it includes generation, rewards, log-probs and the update; the median is taken
over the steps after warm-up. Prints a table; `--json PATH` writes rlcore_step_s, trl_step_s and ratio.

    python benchmarks/grpo_cpu.py --json benchmarks/results/grpo_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPTS, GENERATIONS, TOKENS, MICRO, ACCUM, LR = 8, 8, 32, 32, 2, 1e-3


def rlcore_step_times(model: str, out: Path, steps: int) -> list[float]:
    from rlcore import hookimpl, load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    stamps: list[float] = []

    class Clock:
        @hookimpl
        def rlcore_step_end(self, trainer, step, metrics):
            stamps.append(time.perf_counter())

    plugins = load_plugins()
    plugins.register(Clock(), "clock")
    config = GRPOConfig(
        model=model, output_dir=str(out), max_steps=steps, learning_rate=LR, num_generations=GENERATIONS,
        max_completion_length=TOKENS, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        check_weight_sync=False, save_steps=10_000,
    )
    trainer = GRPOTrainer(config, plugins)
    stamps.append(time.perf_counter())
    trainer.fit()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def trl_step_times(model: str, out: Path, steps: int) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.plugins.grpo.toy import toy_dataset, toy_reward

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in toy_dataset()]
    args = GRPOConfig(
        output_dir=str(out), max_steps=steps, learning_rate=LR, num_generations=GENERATIONS,
        max_completion_length=TOKENS, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        beta=0.0, use_vllm=False, use_cpu=True, report_to=[], logging_steps=steps + 1, save_strategy="no",
        bf16=False, temperature=1.0, top_p=1.0, disable_tqdm=True, seed=42,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=toy_reward, args=args, train_dataset=Dataset.from_list(rows),
                          callbacks=[Clock()])
    trainer.train()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per framework")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from rlcore.plugins.hf.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "tiny"))
        ours = rlcore_step_times(model, Path(tmp) / "rlcore", args.steps)
        theirs = trl_step_times(model, Path(tmp) / "trl", args.steps)
    ours_s = statistics.median(ours[args.warmup :])
    trl_s = statistics.median(theirs[args.warmup :])
    result = {
        "rlcore_step_s": round(ours_s, 4),
        "trl_step_s": round(trl_s, 4),
        "ratio": round(ours_s / trl_s, 3),
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": f"{PROMPTS} prompts x {GENERATIONS} generations x {TOKENS} tokens",
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"\n{'':<10}{'median step (s)':>18}")
    print(f"{'rlcore':<10}{ours_s:>18.3f}")
    print(f"{'TRL':<10}{trl_s:>18.3f}")
    print(f"{'ratio':<10}{ours_s / trl_s:>18.3f}   (rlcore / TRL; target <= 1.0)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
