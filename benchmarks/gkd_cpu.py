"""GKD step time on the CPU, side by side: rlcore's `gkd` (one process, no Ray, Hugging Face engines) against
TRL 1.16's GKDTrainer (`trl.experimental.gkd`).

The same work on both sides: a tiny random-weight student (hidden 128, 4 layers) distils a different, larger
tiny teacher (hidden 256, 4 layers), both from `rlcore.testing.build_tiny_model` with one tokenizer
(vocabulary 4,096), float32; every step on-policy (lmbda 1: the student generates on the CPU), beta 0.5,
temperature 1, the full vocabulary; 16 completions of up to 32 tokens a step (micro-batches of 8, 2
accumulation steps, one optimizer step), torch AdamW lr 1e-4 with a constant schedule, max_grad_norm 1,
the same prompts and stop tokens, gradient checkpointing off, one torch thread count for both (`--threads`).
Both sides get the same value wherever TRL has the setting (`SAME`); the table prints every compared setting
read back from the configs each side ran with, and what cannot be made equal is listed below it
("what differs between the sides"). About 3 minutes on 2 cores.
A third row runs rlcore with `gkd_logits_topk` (the teacher's top-16 only): a setting TRL does not have.

Each run is a process of its own (so peak RSS is that side's: ru_maxrss, imports included); runs alternate
rlcore, TRL, rlcore top-k `--repeats` times. The step time is the wall time between two optimizer steps'
ends (generation, weight sync, teacher, forward/backward and the update); a run's figure is the median over
the steps after `--warmup`, a side's the median over its runs. Completion tokens/s is the median tokens a
step generated over the median step time.

    flock /tmp/rlcore-bench.lock python benchmarks/gkd_cpu.py --json benchmarks/results/gkd_cpu.json
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fair import same_stop_tokens

MICRO, ACCUM, TOKENS, VOCAB, TOPK = 8, 2, 32, 4096, 16
STUDENT = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384, vocab_size=VOCAB)
TEACHER = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=768, vocab_size=VOCAB,
               seed=1)
# Keys both GKDConfigs spell the same way, set to the same values (TRL's defaults where they differ are named).
SAME: dict[str, Any] = dict(
    beta=0.5, lmbda=1.0,  # both default 0.5
    temperature=1.0,  # both default 0.9
    learning_rate=1e-4, lr_scheduler_type="constant",  # TRL: linear
    warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
    per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, seed=42,
)
PROMPTS = ["Write a short story about a robot.", "Explain why the sky is blue.", "List three prime numbers.",
           "What is the capital of France?", "Describe a sunset.", "Give me a recipe for bread.",
           "How do airplanes fly?", "Summarise the water cycle."]
ROWS = 256
SIDES = ("rlcore", "trl", "topk")
LABELS = {"rlcore": "rlcore gkd, full vocab", "trl": "TRL GKDTrainer", "topk": f"rlcore gkd, top-{TOPK} *"}


def lookup(obj: Any, path: str) -> Any:
    """`a.b.c` through attributes and dict keys; '-' where the path does not exist."""
    for part in path.split("."):
        obj = obj.get(part, "-") if isinstance(obj, dict) else getattr(obj, part, "-")
    return obj.value if isinstance(obj, enum.Enum) else obj


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# -- the shared inputs ------------------------------------------------------------------------------


def answer_of_length(model: str) -> tuple[str, int]:
    """The dataset's assistant answer, sized so that TRL's collator labels TOKENS completion tokens per row.

    TRL's Trainer counts the batch's label tokens (`num_items_in_batch`, the loss's divisor) before GKD
    replaces the dataset completion with the generated one; rlcore divides by the generated tokens. Random
    models almost never stop early, so a dataset completion of TOKENS labelled tokens gives both the same
    divisor. (At lmbda 1 rlcore never reads the dataset's completions.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                           tokenize=False)
    base = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    best = ("", 10**9)
    for n in range(1, 4 * TOKENS):
        text = " ".join(["ok"] * n)
        full = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]},
                                              {"role": "assistant", "content": text}], tokenize=False)
        labelled = len(tokenizer(full, add_special_tokens=False)["input_ids"]) - base
        if abs(labelled - TOKENS) < abs(best[1] - TOKENS):
            best = (text, labelled)
        if labelled >= TOKENS:
            break
    return best


def dataset_file(root: Path, answer: str) -> Path:
    path = root / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]},
                          {"role": "assistant", "content": answer}]} for i in range(ROWS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- the runs, each in its own process --------------------------------------------------------------


def run_rlcore(student: str, teacher: str, data: str, out: Path, steps: int, topk: bool) -> dict[str, Any]:
    from fair import StepClock

    from rlcore import load_plugins
    from rlcore.plugins.gkd.config import GKDConfig
    from rlcore.plugins.gkd.trainer import GKDTrainer

    missing = [k for k in SAME if k not in GKDConfig.model_fields]
    if missing:
        raise SystemExit(f"rlcore's GKDConfig has no {', '.join(missing)}: this comparison needs them on both sides")
    import_rss = rss_mib()
    clock = StepClock()
    plugins = load_plugins()
    plugins.register(clock, "clock")
    config = GKDConfig(
        **SAME, model=student, teacher_model=teacher, dataset=data, output_dir=str(out), max_steps=steps,
        max_completion_length=TOKENS, gkd_logits_topk=TOPK if topk else None, check_weight_sync=False,
        save_steps=100_000, logging_steps=100_000,
        train={"engine": "hf", "dtype": "float32", "gradient_checkpointing": False},
        rollout={"engine": "hf", "dtype": "float32"},
    )
    trainer = GKDTrainer(config, plugins)
    optimizer = config.optimizer_options()  # what the train engine is given, the keys GKD leaves at their defaults too
    settings = {key: lookup(config, key) for key in SAME}
    settings.update(
        max_completion_length=config.max_completion_length, top_p=config.top_p, top_k=config.top_k,
        gradient_checkpointing=config.train.gradient_checkpointing, dtype=config.train.dtype,
        optimizer="torch.optim.AdamW", adam_beta1=optimizer.adam_beta1,
        adam_beta2=optimizer.adam_beta2, adam_epsilon=optimizer.adam_epsilon,
        stop_token_ids=trainer.data.stop_ids, loss_temperature=config.temperature,
        vocabulary=f"top-{TOPK}" if topk else "full",
    )
    clock.start()
    trainer.fit()
    rows = clock.rows
    batch = MICRO * ACCUM
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"step_s": clock.step_s(),
            "tokens": [r["completions/mean_length"] * batch for r in rows],
            "loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
            "phases": {k: [r.get(k, 0.0) for r in rows] for k in phases},
            "settings": settings, "import_rss_mib": import_rss}


def run_trl(student: str, teacher: str, data: str, out: Path, steps: int) -> dict[str, Any]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from fair import trainer_clock
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    import_rss = rss_mib()
    clock = trainer_clock("loss")
    tokens: list[int] = []
    seconds: list[float] = []  # per generate call

    generate = GKDTrainer.generate_on_policy_outputs

    def counted(model, inputs, generation_config):  # the completion tokens TRL generated (up to the first stop)
        start = time.perf_counter()
        ids, mask, labels = generate(model, inputs, generation_config)
        seconds.append(time.perf_counter() - start)
        tokens.append(int((labels != -100).sum()))
        return ids, mask, labels

    GKDTrainer.generate_on_policy_outputs = staticmethod(counted)
    args = GKDConfig(
        **SAME, output_dir=str(out), max_steps=steps, max_new_tokens=TOKENS, gradient_checkpointing=False,
        optim="adamw_torch",  # rlcore's torch.optim.AdamW (TRL's default differs by version: named explicitly)
        use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"},
    )
    rows_in = [json.loads(line) for line in Path(data).read_text().splitlines()]
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=Dataset.from_list(rows_in),
                         processing_class=AutoTokenizer.from_pretrained(student), callbacks=[clock])
    eos = trainer.generation_config.eos_token_id
    settings = {key: lookup(args, key) for key in SAME}
    settings.update(
        max_completion_length=args.max_new_tokens, top_p=trainer.generation_config.top_p,
        top_k=trainer.generation_config.top_k, gradient_checkpointing=args.gradient_checkpointing,
        dtype=str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
        optimizer=_optimizer_name(trainer.get_optimizer_cls_and_kwargs(args)[0]),
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon,
        stop_token_ids=sorted([eos] if isinstance(eos, int) else eos),
        loss_temperature=1.0,  # GKDTrainer.compute_loss calls generalized_jsd_loss without it: always 1
        vocabulary="full",
    )
    trainer.train()
    steps_run = range(len(clock.stamps) - 1)
    per_step = [sum(tokens[i * ACCUM: (i + 1) * ACCUM]) for i in steps_run]
    step_s = clock.step_s()
    generate_s = [sum(seconds[i * ACCUM: (i + 1) * ACCUM]) for i in steps_run]
    phases = {"time/generate": generate_s, "time/rest": [s - g for s, g in zip(step_s, generate_s)]}
    return {"step_s": step_s, "tokens": per_step, "phases": phases,
            "loss": [r["loss"] for r in clock.logs], "grad_norm": [r.get("grad_norm") for r in clock.logs],
            "settings": settings, "import_rss_mib": import_rss}


def _optimizer_name(cls: type) -> str:
    return f"{cls.__module__.replace('torch.optim.adamw', 'torch.optim')}.{cls.__name__}"


# -- the driver ---------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.run == "trl":
        result = run_trl(args.student, args.teacher, args.data, out.parent / f"{out.stem}-run", args.steps)
    else:
        result = run_rlcore(args.student, args.teacher, args.data, out.parent / f"{out.stem}-run", args.steps,
                            topk=args.run == "topk")
    result["peak_rss_mib"] = rss_mib()
    result["torch_threads"] = torch.get_num_threads()
    out.write_text(json.dumps(result))


def run_side(side: str, models: tuple[str, str], data: Path, tmp: Path, args: argparse.Namespace, r: int) -> dict:
    out = tmp / f"{side}-{r}.json"
    cmd = [sys.executable, __file__, "--run", side, "--student", models[0], "--teacher", models[1],
           "--data", str(data), "--out", str(out), "--steps", str(args.steps), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1", "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL if args.quiet else None,
                   stderr=subprocess.DEVNULL if args.quiet else None)
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - start
    return result


def summarise(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    per_run = [(statistics.median(r["step_s"][warmup:]), statistics.median(r["tokens"][warmup:])) for r in runs]
    step = statistics.median(s for s, _ in per_run)
    tokens = statistics.median(t for _, t in per_run)
    out = {"step_s": round(step, 4), "completion_tokens_per_step": round(tokens, 1),
           "tokens_per_s": round(tokens / step, 1), "peak_rss_mib": round(statistics.median(r["peak_rss_mib"] for r in runs), 1),
           "rss_after_imports_mib": round(statistics.median(r["import_rss_mib"] for r in runs), 1),
           "per_run_step_s": [round(s, 4) for s, _ in per_run],
           "per_run_process_s": [round(r["process_s"], 1) for r in runs],
           "first_loss": [round(r["loss"][0], 4) for r in runs], "last_loss": [round(r["loss"][-1], 4) for r in runs]}
    phases = runs[0].get("phases")
    if phases:
        out["phases_s"] = {k.removeprefix("time/"): round(statistics.median(
            statistics.median(r["phases"][k][warmup:]) for r in runs), 4) for k in phases}
    return out


DIFFERENCES = [
    "generation: rlcore's hf rollout engine (its own KV-cache sampling loop over the transformers model, the whole "
    f"step's {MICRO * ACCUM} prompts in one batch, finished rows dropped) vs TRL's model.generate per micro-batch "
    f"({MICRO} prompts, {ACCUM} calls a step, finished rows padded to the end)",
    "rlcore copies the trained weights into its rollout model before each on-policy step (in process; timed in the "
    "step); TRL generates with the trained model itself",
    "full-vocabulary loss: rlcore's jsd_sum (chunks of 1024 tokens recomputed in backward) on the student's log-probs "
    "and the teacher's log-probs taken with no_grad; TRL's generalized_jsd_loss on [B, T, V] at once",
    "loss divisor: rlcore the step's generated tokens; TRL the dataset completion's labelled tokens "
    f"(num_items_in_batch is counted before GKD swaps in the generation) - made equal here by giving the dataset "
    f"answer {TOKENS} labelled tokens, as random models almost never stop early",
    "sampling RNG: rlcore's sampler seeds a generator per step (seed x 100003 + step); TRL samples from torch's "
    "global RNG, so the two draw different completions",
    "peak RSS includes each framework's imports (TRL's process imports datasets, accelerate and TRL; rlcore's does not)",
    f"* top-{TOPK}: rlcore distils over the colocated teacher's {TOPK} most likely tokens; TRL has no such setting",
    "TRL 1.16 warns that lmbda 1 with temperature 1 is covered by its DistillationTrainer (chunked loss, vLLM); "
    "not run here: the comparison is with GKDTrainer",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--repeats", type=int, default=5, help="runs per side, alternating (a shared machine's load hits all)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on every side")
    parser.add_argument("--only", choices=SIDES, nargs="+", help="run these sides only")
    parser.add_argument("--quiet", action="store_true", help="hide the runs' own output")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--run", choices=SIDES, help=argparse.SUPPRESS)
    for hidden in ("--student", "--teacher", "--data", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        child(args)
        return

    from rlcore.testing import build_tiny_model

    sides = args.only or list(SIDES)
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        models = (str(build_tiny_model(tmp / "student", **STUDENT)), str(build_tiny_model(tmp / "teacher", **TEACHER)))
        stop = same_stop_tokens(models[0])
        same_stop_tokens(models[1])
        answer, labelled = answer_of_length(models[0])
        data = dataset_file(tmp, answer)
        for r in range(args.repeats):
            for side in sides:
                runs[side].append(run_side(side, models, data, tmp, args, r))
    summary = {s: summarise(v, args.warmup) for s, v in runs.items()}
    settings = {s: v[0]["settings"] for s, v in runs.items()}

    base = summary.get("trl")
    print(f"\n{'':<26}{'step (s)':>10}{'tokens/step':>13}{'tokens/s':>10}{'peak RSS MiB':>14}{'rlcore/TRL':>12}"
          f"   (median of {args.repeats} alternating runs, steps {args.warmup + 1}-{args.steps}, {args.threads} threads)")
    for side, s in summary.items():
        if base:
            s["ratio_step_s"] = round(s["step_s"] / base["step_s"], 3)
            s["ratio_tokens_per_s"] = round(s["tokens_per_s"] / base["tokens_per_s"], 3)
            s["ratio_peak_rss"] = round(s["peak_rss_mib"] / base["peak_rss_mib"], 3)
        ratio = f"{s['ratio_step_s']:.3f}" if base and side != "trl" else ""
        print(f"{LABELS[side]:<26}{s['step_s']:>10.3f}{s['completion_tokens_per_step']:>13.1f}{s['tokens_per_s']:>10.0f}"
              f"{s['peak_rss_mib']:>14.0f}{ratio:>12}")
    if base:
        print("rlcore/TRL: step time ratio (< 1: rlcore faster); tokens/s and RSS ratios are in the JSON")
    for side, s in summary.items():
        if "phases_s" in s:
            inside = " (TRL: rest = teacher, forward/backward, update, logging)" if side == "trl" else " (teacher inside train)"
            print(f"{LABELS[side]} phases (s): " + ", ".join(f"{k} {v:.3f}" for k, v in s["phases_s"].items()) + inside)
    print("loss, first -> last step (median run): " + "; ".join(
        f"{LABELS[side]} {statistics.median(s['first_loss']):.4f} -> {statistics.median(s['last_loss']):.4f}"
        for side, s in summary.items()))

    names = list(settings)
    keys = list(dict.fromkeys(k for s in settings.values() for k in s))
    differs = [k for k in keys if len({json.dumps(settings[n].get(k, "-")) for n in names if n != "topk"}) > 1]
    print(f"\n{'setting':<30}" + "".join(f"{LABELS[n][:24]:>26}" for n in names))
    for key in keys:
        values = "".join(f"{str(settings[n].get(key, '-'))[:24]:>26}" for n in names)
        print(f"{key:<30}{values}{'   DIFFERS' if key in differs else ''}")
    print("\nwhat differs between the sides:")
    for line in DIFFERENCES:
        print(f"- {line}")

    import torch
    import transformers
    import trl

    result = {
        "sides": summary,
        "labels": LABELS,
        "settings": settings,
        "settings_differ": differs,
        "differences": DIFFERENCES,
        "work": {
            "student": STUDENT, "teacher": TEACHER, "vocabulary": VOCAB,
            "batch": f"{MICRO * ACCUM} completions of up to {TOKENS} tokens a step ({MICRO} per micro-batch x {ACCUM})",
            "prompts": PROMPTS, "dataset_rows": ROWS, "dataset_answer_labelled_tokens": labelled,
            "stop_token_ids": stop, "topk": TOPK,
        },
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "torch_threads": args.threads,
        "wall_s": round(time.perf_counter() - started, 1),
        "environment": {
            "machine": platform.machine(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__, "platform": platform.platform(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
