"""GRPO step time on the CPU: rlcore (local, Hugging Face engines) against TRL's GRPOTrainer (use_vllm=False).

Same tiny model (rlcore.testing), same toy task and reward, same batch: 8 prompts x 8 generations,
32 completion tokens, micro-batches of 32 with 2 accumulation steps (one optimizer step per generation),
one torch thread count for both. Both sides get the same settings wherever TRL has one (`SAME`): loss,
clipping, beta, sampling, stop tokens, optimizer (torch AdamW, lr 1e-3, constant schedule), gradient
checkpointing off. The importance-sampling correction is off on both: TRL applies it only to vLLM's samples.
The step time is the wall time between two optimizer steps' ends, so it includes generation, rewards,
log-probs and the update; each run's median is taken over the steps after warm-up, and the result is the
median over `--repeats` rounds, each running every rlcore arm then TRL, beside each side's median completion
length (the work a step does) and its CPU seconds a step (this process's, all threads: on a machine others load,
less moved by their load than the wall time; `cpu_time_ratios`). rlcore's arms (`--arms`) are its train engine's packing settings: `default` (the
engine's choice; on the CPU it pads), `packed` (`padding_free: true`, the default before issue 51: one packed row
with a dense block-causal mask under sdpa) and `budget` (packed, `max_tokens_per_micro_batch: --budget`). Prints a
table with every compared setting; `--json PATH` writes rlcore_step_s (the default arm's), trl_step_s, ratio (the
default arm over TRL, with its per-round spread), ratios (every arm's), the lengths and the settings.

`--profile` measures nothing: it runs rlcore's default arm and TRL once each under torch's profiler at their third
generation and train calls (rlcore: `HFRolloutEngine.generate`, `HFTrainEngine.train_step`, a whole optimizer step;
TRL: `_generate_and_score_completions`, and `training_step` of a micro-batch without generation) and writes each
call's seconds and operator table: where the time goes.

    python benchmarks/grpo_cpu.py --json benchmarks/results/grpo_cpu.json
    python benchmarks/grpo_cpu.py --profile --json benchmarks/results/grpo_cpu-profile.json
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

from fair import git_commit, same_stop_tokens

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
# rlcore's arms: its train engine's packing keys (`--arms`; `budget` takes `--budget`)
ARMS: dict[str, dict[str, Any]] = {"default": {}, "packed": {"padding_free": True},
                                   "budget": {"padding_free": True, "max_tokens_per_micro_batch": None}}
ARM_LABELS = {"default": "rlcore default (the engine's choice)", "packed": "rlcore packed (padding_free: true)",
              "budget": "rlcore packed, token budget"}
TARGET = 0.8  # issue 51: rlcore's default at most 0.8x TRL's step on the CPU
# (row label, where rlcore keeps it, where TRL keeps it): read back from the configs each side ran with
COMPARED = [(key, key, key) for key in SAME] + [
    ("gradient_checkpointing", "train.gradient_checkpointing", "gradient_checkpointing"),  # TRL's default: on
]


def lookup(obj: Any, path: str) -> Any:
    """`a.b.c` through attributes and dict keys; '-' where the path does not exist."""
    for part in path.split("."):
        obj = obj.get(part, "-") if isinstance(obj, dict) else getattr(obj, part, "-")
    return obj.value if isinstance(obj, enum.Enum) else obj  # TRL keeps some choices as enums


def rlcore_step_times(model: str, out: Path, steps: int, arm: dict[str, Any] | None = None) -> tuple[list[float], list[float], list[float], dict[str, Any]]:
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
        train={"gradient_checkpointing": False, "engine_kwargs": dict(arm or {})},
    )
    trainer = GRPOTrainer(config, plugins)
    settings = {label: lookup(config, path) for label, path, _ in COMPARED}
    settings["stop_token_ids"] = lookup(trainer, "experience.stop_ids")
    clock.start()
    trainer.fit()
    return clock.step_s(), clock.step_cpu_s(), [r["completions/mean_length"] for r in clock.rows], settings


def trl_step_times(model: str, out: Path, steps: int) -> tuple[list[float], list[float], list[float], dict[str, Any]]:
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
    return clock.step_s(), clock.step_cpu_s(), [log["completions/mean_length"] for log in clock.logs], settings


# --profile: (label, module, class, method, call number) of each side's profiled calls
PROFILED = {
    "default": [("rlcore generate", "rlcore.plugins.hf.rollout", "HFRolloutEngine", "generate", 2),
                ("rlcore train_step (2 micro-batches + AdamW)", "rlcore.plugins.hf.train", "HFTrainEngine", "train_step", 2)],
    "trl": [("TRL _generate_and_score_completions", "trl", "GRPOTrainer", "_generate_and_score_completions", 2),
            ("TRL training_step (1 micro-batch, forward + backward)", "trl", "GRPOTrainer", "training_step", 5)],
}


def profile(model: str, tmp: Path, keys: dict[str, Any]) -> dict[str, Any]:
    """One run of rlcore's default arm and one of TRL, 3 steps each, with `PROFILED`'s calls under torch's profiler."""
    import importlib

    from fair import profile_nth_call

    out: dict[str, Any] = {}
    for side in ("default", "trl"):
        for label, module, cls, method, nth in PROFILED[side]:
            out[label] = {}
            owner = getattr(importlib.import_module(module), cls)
            original = getattr(owner, method)
            profile_nth_call(owner, method, nth, out[label], rows=25)
            try:
                if side == "trl":
                    trl_step_times(model, tmp / f"profile-{side}-{method}", 3)
                else:
                    rlcore_step_times(model, tmp / f"profile-{side}-{method}", 3, keys)
            finally:
                setattr(owner, method, original)
            print(f"\n{label}: {out[label].get('seconds', float('nan')):.3f} s\n{out[label].get('table', '')}")
    return out


def main() -> None:
    from fair import spread

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per framework")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds, each running every rlcore arm then TRL (a shared machine's load hits all)")
    parser.add_argument("--arms", default="default,packed", help=f"rlcore's arms, of {', '.join(ARMS)}")
    parser.add_argument("--budget", type=int, default=1024, help="the budget arm's max_tokens_per_micro_batch")
    parser.add_argument("--notes", default="", help="what the JSON should say about this run (the machine's load)")
    parser.add_argument("--profile", action="store_true", help="profile rlcore's default arm and TRL (no timing)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from rlcore.testing import build_tiny_model

    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "default" not in arms:
        parser.error(f"--arms: {', '.join(unknown) or 'default missing'}; the arms are {', '.join(ARMS)}, with default")
    keys = {arm: {k: args.budget if v is None else v for k, v in ARMS[arm].items()} for arm in arms}
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            model = str(build_tiny_model(Path(tmp) / "tiny"))
            same_stop_tokens(model)
            result = {"profile": profile(model, Path(tmp), keys["default"]), "date": time.strftime("%Y-%m-%d"),
                      "commit": git_commit(),
                      "batch": f"{PROMPTS} prompts x {GENERATIONS} generations x {TOKENS} tokens",
                      "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}",
                      "notes": args.notes}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return
    sides = [*arms, "trl"]
    runs: dict[str, list[tuple[float, float, float]]] = {side: [] for side in sides}  # median step s, CPU s, length
    settings: dict[str, dict[str, Any]] = {}  # what each side ran with
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "tiny"))
        same_stop_tokens(model)
        for r in range(args.repeats):
            for side in sides:
                out = Path(tmp) / f"{side}-{r}"
                if side == "trl":
                    steps, cpu, lengths, settings[side] = trl_step_times(model, out, args.steps)
                else:
                    steps, cpu, lengths, settings[side] = rlcore_step_times(model, out, args.steps, keys[side])
                runs[side].append(tuple(statistics.median(v[args.warmup :]) for v in (steps, cpu, lengths)))
    median = {side: tuple(statistics.median(v) for v in zip(*runs[side])) for side in sides}
    trl_s, trl_cpu, trl_len = median["trl"]
    ours_s, ours_cpu, ours_len = median["default"]
    ours_settings, trl_settings = settings["default"], settings["trl"]
    differs = [k for k, v in ours_settings.items() if trl_settings.get(k, "-") != v]
    per_round = {arm: [ours[0] / theirs[0] for ours, theirs in zip(runs[arm], runs["trl"])] for arm in arms}
    ratio = spread(per_round["default"])
    per_round_cpu = {arm: [ours[1] / theirs[1] for ours, theirs in zip(runs[arm], runs["trl"])] for arm in arms}
    result = {
        "rlcore_step_s": round(ours_s, 4),
        "trl_step_s": round(trl_s, 4),
        "ratio": ratio,
        "ratios": {ARM_LABELS[arm]: spread(per_round[arm]) for arm in arms},
        "cpu_time_ratios": {ARM_LABELS[arm]: spread(per_round_cpu[arm]) for arm in arms},
        "target": f"ratio <= {TARGET} (rlcore default / TRL step time)",
        "met": ratio["median"] <= TARGET,
        "rlcore_mean_length": round(ours_len, 2),
        "trl_mean_length": round(trl_len, 2),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "per_run_step_s": {side: [round(step, 4) for step, _, _ in v] for side, v in runs.items()},
        "per_run_cpu_s": {side: [round(cpu, 4) for _, cpu, _ in v] for side, v in runs.items()},
        "arms": {ARM_LABELS[arm]: {"keys": keys[arm], "step_s": round(median[arm][0], 4),
                                   "cpu_s": round(median[arm][1], 4), "mean_length": round(median[arm][2], 2)}
                 for arm in arms},
        "batch": f"{PROMPTS} prompts x {GENERATIONS} generations x {TOKENS} tokens",
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "notes": args.notes,
        "settings": {"rlcore": ours_settings, "trl": trl_settings, "differ": differs,
                     **{f"rlcore {arm}": settings[arm] for arm in arms if arm != "default"}},
    }
    print(f"\n{'':<40}{'median step (s)':>18}{'CPU s':>8}{'completion tokens':>20}{'ratio to TRL':>14}{'CPU ratio':>11}"
          f"   (median of {args.repeats} interleaved rounds)")
    for arm in arms:
        print(f"{ARM_LABELS[arm]:<40}{median[arm][0]:>18.3f}{median[arm][1]:>8.3f}{median[arm][2]:>20.1f}"
              f"{statistics.median(per_round[arm]):>14.3f}{statistics.median(per_round_cpu[arm]):>11.3f}")
    print(f"{'TRL':<40}{trl_s:>18.3f}{trl_cpu:>8.3f}{trl_len:>20.1f}")
    print(f"ratio, default arm: {ratio['median']:.3f} (range {ratio['min']:.3f}-{ratio['max']:.3f}); target <= {TARGET}: "
          f"{'met' if result['met'] else 'NOT met'}")
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
