"""GRPO step time on the CPU: rlcore (local, Hugging Face engines) against TRL's GRPOTrainer (use_vllm=False).

Same tiny model (rlcore.testing), same toy task and reward, same batch: 8 prompts x 8 generations,
32 completion tokens, micro-batches of 32 with 2 accumulation steps (one optimizer step per generation),
one torch thread count for both. Both sides get the same settings wherever TRL has one (`SAME`): loss,
clipping, beta, sampling, stop tokens, optimizer (torch AdamW, lr 1e-3, constant schedule), gradient
checkpointing off. The importance-sampling correction is off on both: TRL applies it only to vLLM's samples.
The step time is the wall time between two optimizer steps' ends, so it includes generation, rewards,
log-probs and the update; each run's median is taken over the steps after warm-up, and the result is the
median over `--repeats` runs that alternate rlcore and TRL, beside each side's median completion length
(the work a step does). Prints a table with every compared setting; `--json PATH` writes
rlcore_step_s, trl_step_s, ratio, the lengths and the settings.

    python benchmarks/grpo_cpu.py --json benchmarks/results/grpo_cpu.json
"""

from __future__ import annotations

import argparse
import enum
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fair import same_stop_tokens

PROMPTS, GENERATIONS, TOKENS, MICRO, ACCUM = 8, 8, 32, 32, 2
# Keys both GRPOConfigs spell the same way, set to the same values (TRL's defaults where they differ from rlcore's
# are named in the comments).
SAME: dict[str, Any] = dict(
    learning_rate=1e-3, lr_scheduler_type="constant",  # TRL: linear
    weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
    loss_type="dapo",  # rlcore: grpo
    scale_rewards="group", importance_sampling_level="token", num_iterations=1, mask_truncated_completions=False,
    temperature=1.0, top_p=1.0, top_k=0, num_generations=GENERATIONS, max_completion_length=TOKENS,
    per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, seed=42,
    vllm_importance_sampling_correction=False,  # TRL: on, but it corrects vLLM's samples only (use_vllm=False here)
)
# (row label, where rlcore keeps it, where TRL keeps it): read back from the configs each side ran with
COMPARED = [(key, key, key) for key in SAME] + [
    ("gradient_checkpointing", "train.gradient_checkpointing", "gradient_checkpointing"),  # TRL's default: on
]


def lookup(obj: Any, path: str) -> Any:
    """`a.b.c` through attributes and dict keys; '-' where the path does not exist."""
    for part in path.split("."):
        obj = obj.get(part, "-") if isinstance(obj, dict) else getattr(obj, part, "-")
    return obj.value if isinstance(obj, enum.Enum) else obj  # TRL keeps some choices as enums


def rlcore_step_times(model: str, out: Path, steps: int) -> tuple[list[float], list[float], dict[str, Any]]:
    from fair import StepClock

    from rlcore import load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    missing = [k for k in SAME if k not in GRPOConfig.model_fields]
    if missing:
        raise SystemExit(f"rlcore's GRPOConfig has no {', '.join(missing)}: this comparison needs them on both sides")
    clock = StepClock()
    plugins = load_plugins()
    plugins.register(clock, "clock")
    config = GRPOConfig(
        **SAME, model=model, output_dir=str(out), max_steps=steps, check_weight_sync=False, save_steps=10_000,
        train={"gradient_checkpointing": False},
    )
    trainer = GRPOTrainer(config, plugins)
    settings = {label: lookup(config, path) for label, path, _ in COMPARED}
    settings["stop_token_ids"] = lookup(trainer, "experience.stop_ids")
    clock.start()
    trainer.fit()
    return clock.step_s(), [r["completions/mean_length"] for r in clock.rows], settings


def trl_step_times(model: str, out: Path, steps: int) -> tuple[list[float], list[float], dict[str, Any]]:
    from fair import trainer_clock
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.testing import toy_dataset, toy_reward

    clock = trainer_clock("completions/mean_length")
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in toy_dataset()]
    args = GRPOConfig(
        **SAME, output_dir=str(out), max_steps=steps, gradient_checkpointing=False,
        optim="adamw_torch",  # rlcore's torch.optim.AdamW
        use_vllm=False, use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=toy_reward, args=args, train_dataset=Dataset.from_list(rows),
                          callbacks=[clock])
    settings = {label: lookup(args, path) for label, _, path in COMPARED}
    settings["stop_token_ids"] = sorted(trainer.eos_token_ids)
    trainer.train()
    return clock.step_s(), [log["completions/mean_length"] for log in clock.logs], settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per framework")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per framework, alternating rlcore and TRL (a shared machine's load hits both)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from rlcore.testing import build_tiny_model

    runs: dict[str, list[tuple[float, float]]] = {"rlcore": [], "trl": []}  # (median step s, median length) per run
    settings: dict[str, dict[str, Any]] = {}  # what each side ran with
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "tiny"))
        same_stop_tokens(model)
        for r in range(args.repeats):
            for name, measure in (("rlcore", rlcore_step_times), ("trl", trl_step_times)):
                steps, lengths, settings[name] = measure(model, Path(tmp) / f"{name}-{r}", args.steps)
                runs[name].append((statistics.median(steps[args.warmup :]), statistics.median(lengths[args.warmup :])))
    ours_settings, trl_settings = settings["rlcore"], settings["trl"]
    ours_s, ours_len = (statistics.median(v) for v in zip(*runs["rlcore"]))
    trl_s, trl_len = (statistics.median(v) for v in zip(*runs["trl"]))
    differs = [k for k, v in ours_settings.items() if trl_settings.get(k, "-") != v]
    result = {
        "rlcore_step_s": round(ours_s, 4),
        "trl_step_s": round(trl_s, 4),
        "ratio": round(ours_s / trl_s, 3),
        "rlcore_mean_length": round(ours_len, 2),
        "trl_mean_length": round(trl_len, 2),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "per_run_step_s": {name: [round(step, 4) for step, _ in v] for name, v in runs.items()},
        "batch": f"{PROMPTS} prompts x {GENERATIONS} generations x {TOKENS} tokens",
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "settings": {"rlcore": ours_settings, "trl": trl_settings, "differ": differs},
    }
    print(f"\n{'':<10}{'median step (s)':>18}{'completion tokens':>20}   (median of {args.repeats} alternating runs)")
    print(f"{'rlcore':<10}{ours_s:>18.3f}{ours_len:>20.1f}")
    print(f"{'TRL':<10}{trl_s:>18.3f}{trl_len:>20.1f}")
    print(f"{'ratio':<10}{ours_s / trl_s:>18.3f}   (rlcore / TRL; target <= 1.0)")
    print(f"\n{'setting':<34}{'rlcore':>16}{'TRL':>16}")
    for key, value in ours_settings.items():
        other = trl_settings.get(key, "-")
        print(f"{key:<34}{str(value):>16}{str(other):>16}{'   DIFFERS' if key in differs else ''}")
    print("IS correction off on both: TRL corrects only vLLM's samples (use_vllm=False here)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
