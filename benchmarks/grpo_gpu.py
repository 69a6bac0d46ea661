"""GRPO on the GPU, side by side: rlcore (vLLM rollout, Hugging Face train engine) against TRL's GRPOTrainer.

The same random-weight Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary
32000, bf16), 8 prompts x 8 generations, 256 completion tokens, 8 steps, median of steps 3-8. Both sides get
the same settings wherever TRL has one (`SAME`): loss, clipping, beta, sampling, stop tokens, batch, optimizer
and schedule, gradient checkpointing off, vLLM's importance-sampling correction, and vLLM's memory, context,
batch limits and sleep mode. The table lists every compared setting from the configs each side ran with and
says where they differ.

    python benchmarks/grpo_gpu.py                     # one H200: TRL vLLM colocate vs rlcore vLLM colocate
    python benchmarks/grpo_gpu.py --mode separate     # two H200s: rlcore separate + async (1 train GPU, 1 rollout
                                                      # GPU, one step off-policy) vs TRL colocate, synchronous
                                                      # data parallelism over both GPUs
    python benchmarks/grpo_gpu.py --only rlcore       # one side (kept in the JSON, no ratio)
    python benchmarks/grpo_gpu.py --train-kwargs '{"chunked_lm_head": false}'   # rlcore's train engine option
    python benchmarks/grpo_gpu.py --only rlcore --profile   # + torch's profile of the last train phase
    python benchmarks/grpo_gpu.py --smoke             # a tiny model on the CPU, hf rollout, TRL without vLLM,
                                                      # 2 steps: the code paths only (both GPU configs built too)

Each framework runs in a subprocess of its own (one vLLM per process); the random model is drawn on the GPU in
a child of its own first (seconds). The table gives each median step time, completion tokens per second, the
ratio, rlcore's phases, its train phase's achieved TFLOP/s (model FLOPs of the tokens trained: 6 x matmul
parameters x tokens + causal attention, over the phase's seconds) and weight-sync seconds and GB/s, then every
compared setting and what differs by design, implementation choices included. About 4 minutes on one H200.
`--json PATH` (default benchmarks/results/grpo_gpu-<mode>-<date>-<kind>.json) keeps them with the git commit
(`RLCORE_COMMIT` where set), written after each side; a side that fails is recorded and the other still runs.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fair import build_model, failure, free_port, git_commit, results_path, run_child, same_stop_tokens, write_json

H200_BF16_DENSE_TFLOPS = 989.0  # the datasheet's dense bf16 peak, for the utilisation column

PROMPTS, GENERATIONS, TOKENS, STEPS, SKIP = 8, 8, 256, 8, 2
SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")
MICRO, ACCUM = 16, 4  # one train GPU: 16 x 4 = 64 completions per optimizer step, one step per generation
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, vocab_size=1024)  # --smoke: a tiny model on the CPU
# --smoke: 2 prompts x 4 generations x 8 tokens, micro-batches of 4 x 2, 2 steps, none skipped
SMOKE = dict(num_generations=4, max_completion_length=8, per_device_train_batch_size=4)
SMOKE_ACCUM, SMOKE_STEPS = 2, 2
GPU_MEMORY, MAX_MODEL_LEN, MAX_BATCHED_TOKENS = 0.3, 1024, 4096  # TRL fixes max_num_batched_tokens at 4096
# Keys both GRPOConfigs spell the same way, set to the same values (TRL's defaults where they differ from rlcore's
# are named in the comments).
SAME: dict[str, Any] = dict(
    learning_rate=1e-6, lr_scheduler_type="constant",  # TRL: linear
    weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
    loss_type="dapo",  # rlcore: grpo
    scale_rewards="group", importance_sampling_level="token", num_iterations=1, mask_truncated_completions=False,
    temperature=1.0, top_p=1.0, top_k=0, num_generations=GENERATIONS, max_completion_length=TOKENS,
    per_device_train_batch_size=MICRO, seed=42,
    vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
    vllm_importance_sampling_clip_max=3.0,
)
# (row label, where rlcore keeps it, where TRL keeps it): read back from the configs each side ran with
COMPARED = [(key, key, key) for key in SAME] + [
    ("gradient_checkpointing", "train.gradient_checkpointing", "gradient_checkpointing"),  # TRL's default: on
    ("gradient_accumulation_steps", "gradient_accumulation_steps", "gradient_accumulation_steps"),
    ("vllm_gpu_memory_utilization", "rollout.vllm_gpu_memory_utilization", "vllm_gpu_memory_utilization"),
    ("vllm_max_model_len", "rollout.vllm_max_model_len", "vllm_max_model_length"),
    ("vllm sleep mode", "rollout.engine_kwargs.vllm_enable_sleep_mode", "vllm_enable_sleep_mode"),
]


def lookup(obj: Any, path: str) -> Any:
    """`a.b.c` through attributes and dict keys; '-' where the path does not exist."""
    for part in path.split("."):
        obj = obj.get(part, "-") if isinstance(obj, dict) else getattr(obj, part, "-")
    return obj.value if isinstance(obj, enum.Enum) else obj  # TRL keeps some choices as enums


# -- the runs, each in its own process ------------------------------------------------------------


def train_flops(config: Any, lengths: list[int]) -> float:
    """Model FLOPs of one forward + backward over sequences of `lengths` tokens (padding not counted): 3 x the
    forward's 2 x matmul parameters (attention and MLP projections, the LM head) per token plus causal attention's
    2 x S^2 x hidden per layer per sequence."""
    h, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    matmul = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + vocab * h
    return 3.0 * sum(2 * matmul * s + layers * 2 * s * s * h for s in lengths)


def count_train_flops(engine_class: Any, model: str) -> list[float]:
    """Wrap `engine_class.train_step` to record each call's model FLOPs (see `train_flops`)."""
    from transformers import AutoConfig

    config, calls = AutoConfig.from_pretrained(model), []
    original = engine_class.train_step

    def counted(self, batch, *args, **kwargs):
        calls.append(train_flops(config, [int(n) for n in batch["attention_mask"].sum(dim=1).tolist()]))
        return original(self, batch, *args, **kwargs)

    engine_class.train_step = counted
    return calls


def run_rlcore(model: str, out: Path, mode: str, train_kwargs: dict[str, Any], smoke: bool = False) -> dict:
    from fair import StepClock

    from rlcore import load_plugins
    from rlcore.plugins.grpo.config import GRPOConfig
    from rlcore.plugins.grpo.trainer import GRPOTrainer
    from rlcore.plugins.hf.train import HFTrainEngine

    missing = [k for k in SAME if k not in GRPOConfig.model_fields]
    if missing:
        raise SystemExit(f"rlcore's GRPOConfig has no {', '.join(missing)}: this comparison needs them on both sides")
    clock = StepClock()
    plugins = load_plugins()
    plugins.register(clock, "clock")
    # TRL colocated: one vLLM per process, max_num_seqs = per_device_train_batch_size * steps_per_generation
    vllm = {"engine": "vllm", "gpus": 1, "dtype": "bfloat16", "vllm_gpu_memory_utilization": GPU_MEMORY,
            "vllm_max_model_len": MAX_MODEL_LEN, "engine_kwargs": {"vllm_enable_sleep_mode": False},
            "vllm_engine_kwargs": {"max_num_seqs": MICRO * ACCUM, "max_num_batched_tokens": MAX_BATCHED_TOKENS}}
    steps = SMOKE_STEPS if smoke else STEPS
    train = {"gpus": 1, "dtype": "bfloat16", "gradient_checkpointing": False, "engine_kwargs": train_kwargs}
    common = dict(SAME, model=model, output_dir=str(out), max_steps=steps, save_steps=100_000,
                  gradient_accumulation_steps=ACCUM)
    flops = count_train_flops(HFTrainEngine, model) if mode == "colocate" else []  # in this process only
    profile: dict[str, Any] = {}
    if os.environ.get("RLCORE_BENCH_PROFILE") and mode == "colocate":  # the last step's train phase, profiled
        from fair import profile_nth_call

        profile_nth_call(HFTrainEngine, "train_step", steps - 1, profile)
    if mode == "colocate":  # one process, one GPU, vLLM awake throughout: as TRL's colocate mode without sleep
        config = GRPOConfig(**common, train=train, rollout=vllm, colocate_groups=[["train", "rollout"]], sleep_level=0)
    else:  # Ray: train on one GPU, vLLM on the other, NCCL weight sync, the next round generated during
        # training. RLCORE_VLLM_IN_PROCESS=0 puts vLLM's engine core in processes of its own.
        config = GRPOConfig(**common, train=train, async_generate=True,
                            rollout={**vllm, "vllm_in_process": os.environ.get("RLCORE_VLLM_IN_PROCESS", "1") == "1"})
    if smoke:  # the GPU run's config validated above; this one runs on the CPU: hf rollout, float32, one process
        config = GRPOConfig(**{**common, **SMOKE, "gradient_accumulation_steps": SMOKE_ACCUM},
                            train={**train, "gpus": 0, "dtype": "float32"}, rollout={"engine": "hf", "dtype": "float32"},
                            sleep_level=0, async_generate=config.async_generate)
    trainer = GRPOTrainer(config, plugins, use_ray=mode != "colocate" and not smoke)
    settings = {label: lookup(config, path) for label, path, _ in COMPARED}
    settings["stop_token_ids"] = lookup(trainer, "experience.stop_ids")
    settings["completions per optimizer step"] = config.per_device_train_batch_size * config.gradient_accumulation_steps
    settings.update(implementation(config, train_kwargs))
    if config.async_generate:  # the rollout's log-probs are the old policy's: rlcore does not correct there
        settings["vllm_importance_sampling_correction"] = "not applied (async)"
    clock.start()
    trainer.fit()
    rows = clock.rows
    steps = clock.step_s()
    lengths = [r["completions/mean_length"] for r in rows]
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"step_s": steps, "mean_length": lengths, "settings": settings, "train_flops": flops, "profile": profile,
            "sync_s": [r.get("weight_sync/seconds") for r in rows], "sync_gb_s": [r.get("weight_sync/gb_per_s") for r in rows],
            "phases": {k: [r.get(k, 0.0) for r in rows] for k in phases}}


def run_trl(model: str, out: Path, processes: int, smoke: bool = False) -> dict:
    from datasets import Dataset
    from fair import trainer_clock, trl_args
    from transformers import GenerationConfig
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.testing import toy_dataset, toy_reward

    clock = trainer_clock("completions/mean_length")
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in toy_dataset()]
    stop = GenerationConfig.from_pretrained(model).eos_token_id  # same_stop_tokens wrote rlcore's stop ids there
    gpu = dict(
        **SAME, output_dir=str(out), max_steps=STEPS, gradient_accumulation_steps=ACCUM // processes,
        gradient_checkpointing=False, optim="adamw_torch",  # rlcore's torch.optim.AdamW (TRL's default: fused)
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=GPU_MEMORY,
        vllm_max_model_length=MAX_MODEL_LEN, vllm_enable_sleep_mode=False,
        generation_kwargs={"stop_token_ids": stop},  # vLLM stops there, as rlcore asks its engine to
        bf16=True, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16"},
    )
    cpu = dict(SMOKE, gradient_accumulation_steps=SMOKE_ACCUM, max_steps=SMOKE_STEPS, use_vllm=False, bf16=False,
               use_cpu=True, generation_kwargs=None, model_init_kwargs={"dtype": "float32"})
    args = trl_args(GRPOConfig, gpu, cpu if smoke else None)
    trainer = GRPOTrainer(model=model, reward_funcs=toy_reward, args=args, train_dataset=Dataset.from_list(rows),
                          callbacks=[clock])
    settings = {label: lookup(args, path) for label, _, path in COMPARED}
    settings["stop_token_ids"] = sorted(trainer.eos_token_ids)
    settings["completions per optimizer step"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * processes
    settings.update({
        "log-probs": "TRL's chunked kernel (trl/kernels/chunked_logprob.py)",
        "old log-probs": "a separate no-grad forward (vLLM IS correction on)",
        "attn_implementation": trainer.model.config._attn_implementation,
        "padding": "left-padded prompts + right-padded completions, whole micro-batch",
        "optimizer": args.optim.value if hasattr(args.optim, "value") else str(args.optim),
        "vllm max_num_batched_tokens": 4096,
    })
    trainer.train()
    return {"step_s": clock.step_s(), "mean_length": [log["completions/mean_length"] for log in clock.logs],
            "settings": settings}


# -- the driver ---------------------------------------------------------------------------------------


def implementation(config: Any, train_kwargs: dict[str, Any]) -> dict[str, Any]:
    """rlcore's implementation choices that TRL makes differently, as table rows."""
    from rlcore.plugins.grpo.objective import old_logprobs_in_step
    import torch

    from rlcore.head import triton_device, trl_logprob_function

    chunked = train_kwargs.get("chunked_lm_head", True)
    on_triton = torch.cuda.is_available() and triton_device(torch.device("cuda"))
    kernel = "TRL's chunked kernel" if trl_logprob_function() is not None and on_triton else "torch chunks"
    return {
        "log-probs": f"hidden states + LM head in chunks ({kernel})" if chunked else "full [B, T, V] logits",
        "old log-probs": "the train step's own forward (one step per round)" if old_logprobs_in_step(config)
        else "a separate no-grad forward",
        "attn_implementation": "sdpa",  # transformers' default, as TRL's model loads
        "padding": "right-padded, each micro-batch cut to its longest row; LM head on real tokens only",
        "optimizer": "adamw_torch",
        "vllm max_num_batched_tokens": MAX_BATCHED_TOKENS,
    }


def subprocess_run(what: str, model: str, tmp: Path, processes: int = 1, mode: str = "colocate",
                   train_kwargs: str = "{}", smoke: bool = False) -> dict:
    out = tmp / f"{what}.json"
    script = [__file__, "--run", what, "--model", model, "--out", str(out), "--mode", mode, "--train-kwargs", train_kwargs]
    script += ["--smoke"] if smoke else []
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if what == "trl" and processes > 1 and not smoke:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--main_process_port", env["MASTER_PORT"], *script, "--processes", str(processes)]
    else:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        cmd = [sys.executable, *script]
    started = time.perf_counter()
    run_child(cmd, env)
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def summarise(result: dict, completions: int, skip: int = SKIP) -> dict:
    if result.get("profile"):  # the profiled last step is not measured
        for key in ("step_s", "mean_length", "train_flops", "sync_s", "sync_gb_s"):
            result[key] = (result.get(key) or [])[:-1] or result.get(key)
        result["phases"] = {k: v[:-1] for k, v in result.get("phases", {}).items()}
    steps = result["step_s"][skip:]
    step = statistics.median(steps)
    length = statistics.median(result["mean_length"][skip:]) if result["mean_length"] else float("nan")
    out = {"step_s": round(step, 4), "tokens_per_s": round(length * completions / step, 1), "steps_measured": len(steps),
           "settings": result["settings"], "wall_s": round(result["wall_s"], 1)}
    if result.get("sync_s"):
        sync = [s for s in result["sync_s"][skip:] if s is not None]
        rate = [g for g in result["sync_gb_s"][skip:] if g is not None]
        out.update(sync_s=round(statistics.median(sync), 4), sync_gb_s=round(statistics.median(rate), 2))
    if result.get("train_flops") and result.get("phases", {}).get("time/train"):
        per_step = [f / s for f, s in zip(result["train_flops"], result["phases"]["time/train"])][skip:]
        tflops = statistics.median(per_step) / 1e12
        out["train_tflops"] = round(tflops, 1)
        out["train_mfu"] = round(tflops / H200_BF16_DENSE_TFLOPS, 3)
    if result.get("phases"):  # where a step's time goes (the driver's view; async generation overlaps train)
        out["phases_s"] = {k.removeprefix("time/"): round(statistics.median(v[skip:]), 4) for k, v in result["phases"].items()}
        out["per_step_s"] = {"step": [round(s, 3) for s in result["step_s"]],
                             **{k.removeprefix("time/"): [round(s, 3) for s in v] for k, v in result["phases"].items()}}
    if result.get("profile"):
        out["profile"] = result["profile"]
    return out


def differences(mode: str) -> list[str]:
    """What differs between the two runs by design, beyond the compared settings."""
    if mode == "colocate":
        return ["rlcore: one process, no Ray, weights handed over in process; TRL: one process, vLLM colocated",
                "old log-probs for TRL's sampler correction: rlcore takes them (and the ratio) from the train step's own "
                "forward, the same policy since a round feeds one optimizer step; TRL runs a separate no-grad forward",
                "log-probs: rlcore's train engine returns last hidden states and applies the LM head in chunks on real "
                "tokens only (TRL's chunked kernel where installed); TRL uses its chunked kernel over the padded batch"]
    return [
        "rlcore: one-step-off-policy async: 1 train GPU + 1 vLLM GPU (Ray, NCCL weight sync); round n+1 is generated "
        "while round n trains, so its samples come from the policy one step old",
        "TRL: synchronous, on-policy data parallelism over 2 GPUs: each GPU generates half the round with its own "
        "colocated vLLM, then both train (2 micro-batches each instead of 4)",
        "rlcore applies no vLLM importance-sampling correction with async_generate (the rollout's log-probs serve as "
        "the old policy's); TRL corrects with the settings above",
        f"vLLM max_num_seqs: rlcore {MICRO * ACCUM} (one engine, the whole round), TRL {MICRO * ACCUM // 2} per engine",
    ]


def print_table(mode: str, ours: dict, theirs: dict, ratio: float, target: str, labels: tuple[str, str]) -> None:
    ours_label, trl_label = labels
    print(f"\n{'':<28}{'step (s)':>10}{'tokens/s':>12}{'sync (s)':>10}{'sync GB/s':>11}")
    print(f"{ours_label:<28}{ours['step_s']:>10.3f}{ours['tokens_per_s']:>12.0f}{ours.get('sync_s', 0):>10.3f}{ours.get('sync_gb_s', 0):>11.1f}")
    print(f"{trl_label:<28}{theirs['step_s']:>10.3f}{theirs['tokens_per_s']:>12.0f}")
    met = ratio <= 0.5 if mode == "colocate" else ratio >= 1.3
    print(f"{'ratio':<28}{ratio:>10.3f}   target: {target}: {'met' if met else 'NOT met'}")
    print("rlcore phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in ours.get("phases_s", {}).items()))
    if ours.get("profile"):
        print(f"rlcore's last train phase under torch's profiler ({ours['profile']['seconds']:.3f} s):\n{ours['profile']['table']}")
    if "train_tflops" in ours:
        print(f"rlcore train phase: {ours['train_tflops']:.1f} TFLOP/s achieved (model FLOPs), "
              f"{100 * ours['train_mfu']:.1f}% of the H200's {H200_BF16_DENSE_TFLOPS:g} dense bf16")
    print(f"\n{'setting':<34}{'rlcore':>22}{'TRL':>22}")
    for key, value in ours["settings"].items():
        other = theirs["settings"].get(key, "-")
        print(f"{key:<34}{str(value):>22}{str(other):>22}{'' if value == other else '   DIFFERS'}")
    print("\nby design:\n" + "\n".join(f"- {line}" for line in differences(mode)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["colocate", "separate"], default="colocate")
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/grpo_gpu-<mode>-<date>-<kind>.json)")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    parser.add_argument("--only", choices=["rlcore", "trl"], help="run one side (kept in the JSON beside the other's)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, hf rollout, TRL without vLLM, "
                        "2 steps: the code paths only (both GPU configs are built there too)")
    parser.add_argument("--run", choices=["rlcore", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--train-kwargs", default="{}", help="JSON: rlcore's train engine_kwargs (e.g. chunked_lm_head)")
    parser.add_argument("--profile", action="store_true", help="profile rlcore's last train phase (not measured)")
    args = parser.parse_args()
    if args.profile:
        os.environ["RLCORE_BENCH_PROFILE"] = "1"  # the children read it

    if args.run:  # a child: one framework, results to --out (rank 0 of a data-parallel TRL run writes)
        out = Path(args.out).parent
        result = run_rlcore(args.model, out / "rlcore", args.mode, json.loads(args.train_kwargs), args.smoke) \
            if args.run == "rlcore" else run_trl(args.model, out / "trl", args.processes, args.smoke)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(result))
        return

    completions = SMOKE["num_generations"] * 2 if args.smoke else PROMPTS * GENERATIONS
    started = time.perf_counter()
    path = results_path(args.json, f"grpo_gpu-{args.mode}-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    record = json.loads(path.read_text()) if args.only and path.exists() else {}  # sides run with --only add up
    record.update({"mode": args.mode, "kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                   "smoke": args.smoke, "work": f"{PROMPTS} prompts x {GENERATIONS} generations x {TOKENS} tokens, "
                   f"Qwen2-0.5B shape, bf16, median of steps {SKIP + 1}-{STEPS}"})
    trl_processes = 2 if args.mode == "separate" else 1
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_model(tmp / "qwen2-0.5b-shaped", SHAPE, SMOKE_SHAPE if args.smoke else None)
        same_stop_tokens(model)  # before either side loads the model
        for side in [args.only] if args.only else ["rlcore", "trl"]:
            try:
                result = subprocess_run(side, model, tmp, processes=trl_processes if side == "trl" else 1, mode=args.mode,
                                        train_kwargs=args.train_kwargs, smoke=args.smoke)
                record[side] = summarise(result, completions, 0 if args.smoke else SKIP)
            except Exception as error:  # noqa: BLE001 - the other side still runs; the child's log says why
                record[side] = failure(error)
            record[side]["commit"] = git_commit()
            if side == "rlcore":
                record["train_kwargs"] = args.train_kwargs
            record["wall_s"] = round(time.perf_counter() - started, 1)
            write_json(path, record)
    ours, theirs = record.get("rlcore", {}), record.get("trl", {})
    if "step_s" in ours and "step_s" in theirs:
        compare(args.mode, ours, theirs, record)
        write_json(path, record)
    else:
        for side in ("rlcore", "trl"):
            row = record.get(side, {})
            print(f"{side}: " + (f"FAILED: {row['failed']}" if "failed" in row else
                                 f"step {row['step_s']:.3f} s, {row['tokens_per_s']:.0f} tokens/s, phases {row.get('phases_s')}"
                                 if "step_s" in row else "not run"))
            if "train_tflops" in row:
                print(f"rlcore train phase: {row['train_tflops']:.1f} TFLOP/s achieved (model FLOPs)")
            if row.get("profile"):
                print(f"rlcore's last train phase under torch's profiler ({row['profile']['seconds']:.3f} s):\n"
                      f"{row['profile']['table']}")
    print(f"wrote {path}")
    failed = [side for side in ("rlcore", "trl") if "failed" in record.get(side, {})]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def compare(mode: str, ours: dict, theirs: dict, record: dict) -> None:
    """Both sides' table, the ratio and its target, into `record` too."""
    if mode == "colocate":
        ratio, target = ours["step_s"] / theirs["step_s"], "ratio <= 0.5 (rlcore / TRL step time)"
        labels = ("rlcore colocate", "TRL colocate")
    else:
        ratio, target = ours["tokens_per_s"] / theirs["tokens_per_s"], "speedup >= 1.3 (rlcore / TRL tokens/s)"
        labels = ("rlcore 1-step-off async", "TRL sync DP x2")
    record.update(ratio=round(ratio, 3), target=target, met=ratio <= 0.5 if mode == "colocate" else ratio >= 1.3,
                  labels=list(labels), by_design=differences(mode),
                  differ=[k for k, v in ours["settings"].items() if theirs["settings"].get(k, "-") != v])
    print_table(mode, ours, theirs, ratio, target, labels)

if __name__ == "__main__":
    main()
