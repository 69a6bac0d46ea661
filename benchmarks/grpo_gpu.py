"""GRPO on the GPU, side by side: rlcore (vLLM rollout, Hugging Face train engine) against TRL's GRPOTrainer.

The same random-weight Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary
32000, bf16), 8 prompts x 8 generations, 256 completion tokens, beta 0, 8 steps, median of steps 3-8.

    python benchmarks/grpo_gpu.py                     # one H200: TRL vLLM colocate vs rlcore vLLM colocate
    python benchmarks/grpo_gpu.py --mode separate     # two H200s: rlcore separate + async (1 train GPU,
                                                      # 1 rollout GPU) vs TRL colocate, data-parallel on both
Each framework runs in a subprocess of its own (one vLLM per process). The table gives each median step
time, completion tokens per second, the ratio, and rlcore's weight-sync seconds and GB/s; `--json PATH`
(default benchmarks/results/grpo_gpu-<mode>-<date>.json) keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, GENERATIONS, TOKENS, STEPS, SKIP = 8, 8, 256, 8, 2
SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")
GPU_MEMORY = 0.3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the runs, each in its own process ------------------------------------------------------------


def run_rlcore(model: str, out: Path, mode: str) -> dict:
    from rlcore import hookimpl, load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer

    stamps, rows = [], []

    class Clock:
        @hookimpl
        def rlcore_step_end(self, trainer, step, metrics):
            stamps.append(time.perf_counter())
            rows.append(dict(metrics))

    plugins = load_plugins()
    plugins.register(Clock(), "clock")
    vllm = {"engine": "vllm", "gpus": 1, "dtype": "bfloat16", "vllm_gpu_memory_utilization": GPU_MEMORY,
            "vllm_max_model_len": 1024}
    common = dict(model=model, output_dir=str(out), max_steps=STEPS, learning_rate=1e-6, beta=0.0,
                  num_generations=GENERATIONS, max_completion_length=TOKENS, save_steps=100_000,
                  train={"gpus": 1, "dtype": "bfloat16"})
    if mode == "colocate":  # one process, one GPU: like TRL's colocate mode (no sleep there either)
        config = GRPOConfig(**common, rollout=vllm, colocate_groups=[["train", "rollout"]], sleep_level=0,
                            per_device_train_batch_size=16, gradient_accumulation_steps=4)
        trainer = GRPOTrainer(config, plugins)
    else:  # Ray: train on one GPU, vLLM on the other, NCCL weight sync, the next round generated during
        # training. RLCORE_VLLM_IN_PROCESS=0 puts vLLM's engine core in processes of its own.
        config = GRPOConfig(**common, rollout={**vllm, "vllm_in_process": os.environ.get("RLCORE_VLLM_IN_PROCESS", "1") == "1"},
                            async_generate=True,
                            per_device_train_batch_size=16, gradient_accumulation_steps=4)
        trainer = GRPOTrainer(config, plugins, use_ray=True)
    stamps.append(time.perf_counter())
    trainer.fit()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    lengths = [r["completions/mean_length"] for r in rows]
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"step_s": steps, "mean_length": lengths,
            "sync_s": [r.get("weight_sync/seconds") for r in rows], "sync_gb_s": [r.get("weight_sync/gb_per_s") for r in rows],
            "phases": {k: [r.get(k, 0.0) for r in rows] for k in phases}}


def run_trl(model: str, out: Path, processes: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.plugins.grpo.toy import toy_dataset, toy_reward

    stamps, lengths = [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in toy_dataset()]
    args = GRPOConfig(
        output_dir=str(out), max_steps=STEPS, learning_rate=1e-6, beta=0.0, num_generations=GENERATIONS,
        max_completion_length=TOKENS, per_device_train_batch_size=16, gradient_accumulation_steps=4 // processes,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=GPU_MEMORY, bf16=True,
        report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=42,
        model_init_kwargs={"dtype": "bfloat16"},
    )
    trainer = GRPOTrainer(model=model, reward_funcs=toy_reward, args=args, train_dataset=Dataset.from_list(rows),
                          callbacks=[Clock()])
    trainer.train()
    return {"step_s": [b - a for a, b in zip(stamps, stamps[1:])], "mean_length": lengths}


# -- the driver ---------------------------------------------------------------------------------------


def subprocess_run(what: str, model: str, tmp: Path, processes: int = 1, mode: str = "colocate") -> dict:
    out = tmp / f"{what}.json"
    script = [__file__, "--run", what, "--model", model, "--out", str(out), "--mode", mode]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if what == "trl" and processes > 1:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--main_process_port", env["MASTER_PORT"], *script, "--processes", str(processes)]
    else:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        cmd = [sys.executable, *script]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def summarise(result: dict, completions: int) -> dict:
    steps = result["step_s"][SKIP:]
    step = statistics.median(steps)
    length = statistics.median(result["mean_length"][SKIP:]) if result["mean_length"] else float("nan")
    out = {"step_s": round(step, 4), "tokens_per_s": round(length * completions / step, 1), "steps_measured": len(steps)}
    if result.get("sync_s"):
        sync = [s for s in result["sync_s"][SKIP:] if s is not None]
        rate = [g for g in result["sync_gb_s"][SKIP:] if g is not None]
        out.update(sync_s=round(statistics.median(sync), 4), sync_gb_s=round(statistics.median(rate), 2))
    if result.get("phases"):  # where a step's time goes (the driver's view; async generation overlaps train)
        out["phases_s"] = {k.removeprefix("time/"): round(statistics.median(v[SKIP:]), 4) for k, v in result["phases"].items()}
        out["per_step_s"] = {"step": [round(s, 3) for s in result["step_s"]],
                             **{k.removeprefix("time/"): [round(s, 3) for s in v] for k, v in result["phases"].items()}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["colocate", "separate"], default="colocate")
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    parser.add_argument("--only", choices=["rlcore", "trl"], help="run one side and print it (no ratio, no JSON)")
    parser.add_argument("--run", choices=["rlcore", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:  # a child: one framework, results to --out (rank 0 of a data-parallel TRL run writes)
        result = run_rlcore(args.model, Path(args.out).parent / "rlcore", args.mode) if args.run == "rlcore" \
            else run_trl(args.model, Path(args.out).parent / "trl", args.processes)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(result))
        return

    from rlcore.plugins.hf.tiny import build_tiny_model

    completions = PROMPTS * GENERATIONS
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = str(build_tiny_model(tmp / "qwen2-0.5b-shaped", **SHAPE))
        trl_processes = 2 if args.mode == "separate" else 1
        if args.only:
            processes = trl_processes if args.only == "trl" else 1
            print(json.dumps(summarise(subprocess_run(args.only, model, tmp, processes=processes, mode=args.mode), completions)))
            return
        ours = summarise(subprocess_run("rlcore", model, tmp, mode=args.mode), completions)
        theirs = summarise(subprocess_run("trl", model, tmp, processes=trl_processes), completions)

    if args.mode == "colocate":
        ratio, target = ours["step_s"] / theirs["step_s"], "ratio <= 0.9 (rlcore / TRL step time)"
    else:
        ratio, target = ours["tokens_per_s"] / theirs["tokens_per_s"], "speedup >= 1.3 (rlcore / TRL tokens/s)"
    result = {"mode": args.mode, "kind": args.kind, "date": time.strftime("%Y-%m-%d"), "rlcore": ours, "trl": theirs,
              "ratio": round(ratio, 3), "target": target,
              "work": f"{PROMPTS} prompts x {GENERATIONS} generations x {TOKENS} tokens, Qwen2-0.5B shape, bf16, median of steps {SKIP + 1}-{STEPS}"}
    trl_label = "TRL colocate" + (" DP x2" if args.mode == "separate" else "")
    ours_label = "rlcore colocate" if args.mode == "colocate" else "rlcore separate+async"
    print(f"\n{'':<24}{'step (s)':>10}{'tokens/s':>12}{'sync (s)':>10}{'sync GB/s':>11}")
    print(f"{ours_label:<24}{ours['step_s']:>10.3f}{ours['tokens_per_s']:>12.0f}{ours.get('sync_s', 0):>10.3f}{ours.get('sync_gb_s', 0):>11.1f}")
    print(f"{trl_label:<24}{theirs['step_s']:>10.3f}{theirs['tokens_per_s']:>12.0f}")
    print(f"{'ratio':<24}{ratio:>10.3f}   target: {target}")
    print("rlcore phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in ours.get("phases_s", {}).items()))
    path = Path(args.json or f"benchmarks/results/grpo_gpu-{args.mode}-{time.strftime('%Y-%m-%d')}-{args.kind}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
