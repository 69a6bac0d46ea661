"""GKD on the GPU, side by side: rlcore against TRL's GKDTrainer (`trl.experimental.gkd` in TRL 1.16).

The same work on both sides: a random Qwen2-0.5B-shaped student (hidden 896, 24 layers) distils a random
Qwen2-1.5B-shaped teacher (hidden 1536, 28 layers), vocabulary 151,936 (Qwen2's), bf16; every step on-policy
(lmbda 1), 64 completions of up to 256 tokens a step (8 per micro-batch x 8 accumulation steps), beta 0.5,
temperature 1, the full vocabulary. Three runs, each in a process of its own:

- `trl`: GKDTrainer, the student generating with `model.generate`, the teacher on the same GPU;
- `colocated`: rlcore, one GPU, no Ray: vLLM rollout (awake throughout) beside the train engine, the teacher
  colocated in the train worker, full vocabulary;
- `topk`: rlcore on Ray over two GPUs: train + vLLM rollout on GPU 0, the teacher a vLLM group of its own on
  GPU 1 returning its top-64 log-probs (`gkd_logits_topk: 64`) (nvidia-h200-x2).

    python benchmarks/gkd_gpu.py                     # all three (the topk run needs a second GPU)
    python benchmarks/gkd_gpu.py --only colocated    # one run, printed as JSON

The table gives each side's median step time (steps 3-6), completion tokens per second, the peak GPU memory
(device-wide, sampled every 0.2 s while the run's process lives) and the ratio to TRL's tokens/s; targets:
colocated >= 3x, topk >= 4x. `--json PATH` (default benchmarks/results/gkd_gpu.json) keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MICRO, ACCUM, TOKENS, STEPS, SKIP = 8, 8, 256, 6, 2
VOCAB = 151936
STUDENT = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
               vocab_size=VOCAB, max_position_embeddings=2048, dtype="bfloat16")
TEACHER = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
               vocab_size=VOCAB, max_position_embeddings=2048, dtype="bfloat16", seed=1)
SAME = dict(beta=0.5, lmbda=1.0, temperature=1.0, learning_rate=1e-6, per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUM, seed=42)
TARGETS = {"colocated": 3.0, "topk": 4.0}
PROMPTS = ["Write a short story about a robot.", "Explain why the sky is blue.", "List three prime numbers.",
           "What is the capital of France?", "Describe a sunset.", "Give me a recipe for bread.",
           "How do airplanes fly?", "Summarise the water cycle."]


def dataset_file(root: Path) -> Path:
    path = root / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]},
                          {"role": "assistant", "content": "An answer."}]} for i in range(512)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- the runs, each in its own process ------------------------------------------------------------


def run_rlcore(student: str, teacher: str, data: str, out: Path, topk: bool) -> dict:
    from fair import StepClock

    from rlcore import load_plugins
    from rlcore.plugins.gkd.config import GKDConfig
    from rlcore.plugins.gkd.trainer import GKDTrainer

    clock = StepClock()
    plugins = load_plugins()
    plugins.register(clock, "clock")
    vllm = {"engine": "vllm", "gpus": 1, "dtype": "bfloat16", "vllm_gpu_memory_utilization": 0.3,
            "vllm_max_model_len": 1024, "vllm_engine_kwargs": {"max_num_seqs": MICRO * ACCUM}}
    common = dict(SAME, model=student, dataset=data, output_dir=str(out), max_steps=STEPS, save_steps=100_000,
                  max_completion_length=TOKENS, train={"gpus": 1, "dtype": "bfloat16"},
                  colocate_groups=[["train", "rollout"]])
    if topk:  # Ray: train and rollout share GPU 0, the teacher serves its top-64 from GPU 1
        config = GKDConfig(**common, rollout=vllm, gkd_logits_topk=64, teacher={**vllm, "model": teacher, "vllm_gpu_memory_utilization": 0.8},
                           offload_model=False, offload_optimizer=False)
        trainer = GKDTrainer(config, plugins, use_ray=True)
    else:  # one process: vLLM awake throughout (no sleep), the teacher inside the train worker
        config = GKDConfig(**common, rollout=vllm, teacher_model=teacher, sleep_level=0)
        trainer = GKDTrainer(config, plugins)
    clock.start()
    trainer.fit()
    rows = clock.rows
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"step_s": clock.step_s(), "tokens": [r["completions/mean_length"] * MICRO * ACCUM for r in rows],
            "phases": {k: [r.get(k, 0.0) for r in rows] for k in phases}, "jsd": [r["jsd"] for r in rows]}


def run_trl(student: str, teacher: str, data: str, out: Path) -> dict:
    from fair import trainer_clock
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    clock, tokens = trainer_clock(), []

    generate = GKDTrainer.generate_on_policy_outputs

    def counted(model, inputs, generation_config):  # the completion tokens TRL generated
        ids, mask, labels = generate(model, inputs, generation_config)
        tokens.append(int((labels != -100).sum()))
        return ids, mask, labels

    GKDTrainer.generate_on_policy_outputs = staticmethod(counted)
    args = GKDConfig(**SAME, output_dir=str(out), max_steps=STEPS, max_new_tokens=TOKENS, bf16=True, report_to=[],
                     logging_steps=1, save_strategy="no", disable_tqdm=True, gradient_checkpointing=False,
                     model_init_kwargs={"dtype": "bfloat16"}, teacher_model_init_kwargs={"dtype": "bfloat16"})
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args,
                         train_dataset=load_dataset("json", data_files=data, split="train"),
                         processing_class=AutoTokenizer.from_pretrained(student), callbacks=[clock])
    trainer.train()
    per_step = [sum(tokens[i * ACCUM : (i + 1) * ACCUM]) for i in range(len(clock.stamps) - 1)]
    return {"step_s": clock.step_s(), "tokens": per_step}


# -- the driver ---------------------------------------------------------------------------------------


class PeakMemory:
    """The highest device-wide GPU memory in use (GiB, every visible GPU summed), sampled while it runs."""

    def __init__(self) -> None:
        import torch

        self.torch, self.peak, self.done = torch, 0.0, threading.Event()
        self.base = self.used()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def used(self) -> float:
        return sum(self.torch.cuda.device_memory_used(i) for i in range(self.torch.cuda.device_count())) / 2**30

    def sample(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, self.used() - self.base)

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def subprocess_run(what: str, models: tuple[str, str], data: Path, tmp: Path) -> dict:
    out = tmp / f"{what}.json"
    cmd = [sys.executable, __file__, "--run", what, "--student", models[0], "--teacher", models[1],
           "--data", str(data), "--out", str(out)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    if what != "topk":
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    with PeakMemory() as memory:
        subprocess.run(cmd, check=True, env=env)
    result = json.loads(out.read_text())
    result["peak_gpu_gib"] = round(memory.peak, 2)
    return result


def summarise(result: dict) -> dict:
    steps, tokens = result["step_s"][SKIP:], result["tokens"][SKIP:]
    step = statistics.median(steps)
    out = {"step_s": round(step, 3), "tokens_per_s": round(statistics.median(tokens) / step, 1),
           "peak_gpu_gib": result["peak_gpu_gib"], "steps_measured": len(steps)}
    if result.get("phases"):
        out["phases_s"] = {k.removeprefix("time/"): round(statistics.median(v[SKIP:]), 3) for k, v in result["phases"].items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/gkd_gpu.json", help="where to write the results")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200-x2"), help="machine kind, for the record")
    parser.add_argument("--only", choices=["trl", "colocated", "topk"], help="run one side and print it")
    parser.add_argument("--run", choices=["trl", "colocated", "topk"], help=argparse.SUPPRESS)
    for hidden in ("--student", "--teacher", "--data", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:  # a child: one run, results to --out
        out = Path(args.out)
        if args.run == "trl":
            result = run_trl(args.student, args.teacher, args.data, out.parent / "trl")
        else:
            result = run_rlcore(args.student, args.teacher, args.data, out.parent / args.run, topk=args.run == "topk")
        out.write_text(json.dumps(result))
        return

    from rlcore.testing import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        models = (str(build_tiny_model(tmp / "qwen2-0.5b-shaped", **STUDENT)),
                  str(build_tiny_model(tmp / "qwen2-1.5b-shaped", **TEACHER)))
        data = dataset_file(tmp)
        if args.only:
            print(json.dumps(summarise(subprocess_run(args.only, models, data, tmp))))
            return
        sides = {what: summarise(subprocess_run(what, models, data, tmp)) for what in ("trl", "colocated", "topk")}

    base = sides["trl"]["tokens_per_s"]
    print(f"\n{'':<34}{'step (s)':>10}{'tokens/s':>12}{'peak GiB':>10}{'x TRL':>8}{'target':>8}")
    labels = {"trl": "TRL GKDTrainer (generate)", "colocated": "rlcore colocated, full vocab", "topk": "rlcore vLLM teacher, top-64"}
    for what, side in sides.items():
        side["x_trl"] = round(side["tokens_per_s"] / base, 2)
        target = f">= {TARGETS[what]:g}" if what in TARGETS else ""
        print(f"{labels[what]:<34}{side['step_s']:>10.2f}{side['tokens_per_s']:>12.0f}{side['peak_gpu_gib']:>10.1f}"
              f"{side['x_trl']:>8.2f}{target:>8}")
    result = {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "sides": sides, "labels": labels,
              "targets": {k: f"tokens/s >= {v:g} x TRL's" for k, v in TARGETS.items()},
              "met": {k: sides[k]["x_trl"] >= v for k, v in TARGETS.items()},
              "work": f"{MICRO * ACCUM} completions x {TOKENS} tokens a step, lmbda 1, beta 0.5, vocabulary {VOCAB}, "
                      f"student Qwen2-0.5B shape, teacher Qwen2-1.5B shape, bf16, median of steps {SKIP + 1}-{STEPS}"}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
