"""GRPO on the GPU, side by side: rlcore as a user runs it against TRL's GRPOTrainer, interleaved in rounds.

rlcore's side is `rlcore run --plugin grpo --use-ray --config examples/ray/grpo/colocate.yaml KEY=VALUE...`
(`--mode separate`: examples/ray/grpo/separate.yaml with async_generate=true, as the README runs it), scaled to
this host's GPUs, with the example's defaults everywhere except the keys both sides must share: the model, the
data and reward, the batch, the lengths and the steps (`SHARED`). Whatever else the example and rlcore's defaults
choose (dtype, sleep level, offloading, vLLM's memory share, loss, sampling, optimizer) is rlcore's; TRL is given
the same values where it has the setting (`PEER`), so a slow default shows in the ratio. The table says which
keys were set and which example was used.

The same random-weight Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary 32000,
bf16 checkpoint, drawn on the GPU once and reused), 8 prompts x 8 generations, 256 completion tokens, 6 steps,
median of steps 3-6. The sides run interleaved, rlcore, TRL, rlcore, TRL (`--rounds`, default 2), each in a fresh
process (one vLLM per process); the table gives each round's ratio, their median and their range, since one
machine's speed was seen to drift between calls.

    python benchmarks/grpo_gpu.py                     # one H200: rlcore colocate.yaml vs TRL vLLM colocate, 2 rounds
    python benchmarks/grpo_gpu.py --mode separate     # two H200s: rlcore separate.yaml + async (1 train GPU, 1 rollout
                                                      # GPU, one step off-policy) vs TRL colocate, synchronous
                                                      # data parallelism over both GPUs
    python benchmarks/grpo_gpu.py --only rlcore       # one side, its rounds beside the other side's in the JSON
    python benchmarks/grpo_gpu.py --set train.engine_kwargs.chunked_lm_head=false   # an rlcore key of its own, listed
    python benchmarks/grpo_gpu.py --only rlcore --profile   # + torch's profile of rlcore's last train_step
    python benchmarks/grpo_gpu.py --smoke --rounds 1  # a tiny model on the CPU, hf rollout, TRL without vLLM,
                                                      # 2 steps: the code paths only (both GPU configs built too)

The table gives each side's median step time and completion tokens per second over the rounds, the per-round
ratio, rlcore's phases and weight-sync seconds and GB/s, the example and the keys set on it, then every compared
setting and what differs by design. About 2 minutes a side on one H200, so 2 rounds fit in about 8 minutes.
`--json PATH` (default benchmarks/results/grpo_gpu-<mode>-<date>-<kind>.json) keeps them with the git commit
(`RLCORE_COMMIT` where set), written after each side; a side that fails is recorded and the others still run.
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

import yaml
from fair import (build_model, failure, free_port, git_commit, host_info, interleave, print_provenance, profile_env,
                  provenance, read_profile, results_path, rlcore_run, run_child, same_stop_tokens, scaled, spread,
                  spread_text, user_config, write_json)

from rlcore.testing import toy_dataset

PROMPTS, GENERATIONS, TOKENS, STEPS, SKIP = 8, 8, 256, 6, 2
SHAPE = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")
MICRO, ACCUM = 16, 4  # one train GPU: 16 x 4 = 64 completions per optimizer step, one step per generation
# --smoke: a tiny model on the CPU (its context as long as the GPU model's, so the GPU config's checks pass on it)
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, vocab_size=1024, max_position_embeddings=2048)
EXAMPLES = {"colocate": "grpo/colocate.yaml", "separate": "grpo/separate.yaml"}
# The keys set on rlcore's example, and given to TRL alike: the work (model, data and reward, batch, lengths, steps).
SHARED: dict[str, Any] = dict(reward_funcs=["toy"], num_generations=GENERATIONS, max_completion_length=TOKENS,
                              per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, max_steps=STEPS)
# --smoke: 2 prompts x 4 generations x 8 tokens, micro-batches of 4 x 2, 2 steps, none skipped
SMOKE = dict(num_generations=4, max_completion_length=8, per_device_train_batch_size=4, gradient_accumulation_steps=2,
             max_steps=2)
SMOKE_CPU = {"rollout.engine": "hf"}  # --smoke's rlcore run: no vLLM on the CPU
# TRL's keys given rlcore's resolved value (the example's, else rlcore's default), so TRL runs what the user's rlcore
# runs: (TRL's key, rlcore's key path)
PEER = [(key, key) for key in (
    "learning_rate", "lr_scheduler_type", "weight_decay", "max_grad_norm", "beta", "epsilon", "epsilon_high",
    "loss_type", "scale_rewards", "importance_sampling_level", "num_iterations", "mask_truncated_completions",
    "temperature", "top_p", "top_k", "num_generations", "max_completion_length", "per_device_train_batch_size",
    "gradient_accumulation_steps", "seed", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max")] + [
    ("gradient_checkpointing", "train.gradient_checkpointing"),
    ("vllm_gpu_memory_utilization", "rollout.vllm_gpu_memory_utilization"),
    ("vllm_max_model_length", "rollout.vllm_max_model_len"),
]
# (row label, where rlcore keeps it, where TRL keeps it): read back from the configs each side ran with
COMPARED = [(trl, rl, trl) for trl, rl in PEER] + [
    ("vllm sleep mode", "vllm sleep mode", "vllm_enable_sleep_mode"),  # rlcore: colocated and sleep_level > 0
    ("dtype", "dtype", "model_init_kwargs.dtype"),  # rlcore: train.dtype, resolved for this host
]


def lookup(obj: Any, path: str) -> Any:
    """`a.b.c` through attributes and dict keys; '-' where the path does not exist."""
    for part in path.split("."):
        obj = obj.get(part, "-") if isinstance(obj, dict) else getattr(obj, part, "-")
    return obj.value if isinstance(obj, enum.Enum) else obj  # TRL keeps some choices as enums


# -- rlcore's side: the example YAML with the shared keys -----------------------------------------------------


def rlcore_keys(mode: str, model: str, data: str, out: Path, own: dict[str, Any], gpu: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(shared, scaling, own) keys of rlcore's run: the GPU run's (`gpu`), or --smoke's run on the CPU."""
    shared = {"model": model, "dataset": data, **SHARED, **({} if gpu else SMOKE)}
    scale = {**scaled(EXAMPLES[mode], 1 if gpu else 0), "output_dir": str(out)}
    own = {**({"async_generate": True} if mode == "separate" else {}), **own, **({} if gpu else SMOKE_CPU)}
    return shared, scale, own


def peer_of(config: Any, mode: str) -> dict[str, Any]:
    """TRL's keys with the values rlcore's run resolved (`PEER`); vLLM sleeps between generations on both sides
    where rlcore's colocated rollout does (`sleep_level`)."""
    peer = {trl: lookup(config, path) for trl, path in PEER}
    peer["vllm_enable_sleep_mode"] = mode == "colocate" and config.sleep_level > 0
    return peer


def rlcore_settings(config: Any, mode: str, cuda: bool) -> dict[str, Any]:
    """rlcore's compared settings read back from the config it ran with (`cuda`: on a GPU), and its own choices that
    TRL lacks."""
    from rlcore.engine_checks import resolve_dtype

    view = {"vllm sleep mode": peer_of(config, mode)["vllm_enable_sleep_mode"],
            "dtype": f"{config.train.dtype} -> {resolve_dtype(config.train.dtype, config.model, cuda)}"}
    settings = {label: lookup(config, path) if path not in view else view[path] for label, path, _ in COMPARED}
    settings.update({
        "sleep_level": config.sleep_level,
        "completions per optimizer step": config.per_device_train_batch_size * config.gradient_accumulation_steps,
        "offload_model / offload_optimizer": f"{config.offload_model} / {config.offload_optimizer}",
        "rollout engine": config.rollout.engine,
        "vllm_engine_kwargs": config.rollout.vllm_engine_kwargs or "rlcore's defaults",
        "train engine_kwargs": config.train.engine_kwargs or "the engine's defaults",
        "attn_implementation": config.train.engine_kwargs.get("attn_implementation", "sdpa"),
    })
    if config.async_generate:  # the rollout's log-probs are the old policy's: rlcore does not correct there
        settings["vllm_importance_sampling_correction"] = "not applied (async)"
    return settings


def run_rlcore(mode: str, keys: dict[str, Any], tmp: Path, name: str, profile: bool) -> dict:
    """rlcore's side, one round: `rlcore run` on the example in a process of its own."""
    env, profiled = {}, None
    if profile:  # the last train_step, in the train worker
        env, profiled = profile_env(tmp, name, keys["max_steps"] - 1, ("rlcore.plugins.hf.train", "HFTrainEngine",
                                                                      "train_step"))
    run = rlcore_run("grpo", EXAMPLES[mode], keys, tmp, name, use_ray=True, env=env)
    rows = run["rows"]
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"step_s": run["step_s"], "mean_length": [r["completions/mean_length"] for r in rows],
            "sync_s": [r.get("weight_sync/seconds") for r in rows], "sync_gb_s": [r.get("weight_sync/gb_per_s") for r in rows],
            "phases": {k: [r.get(k, 0.0) for r in rows] for k in phases}, "wall_s": run["wall_s"],
            "setup_s": run["setup_s"], "profile": profiled and read_profile(profiled, "train_step")}


# -- TRL's side, in a process of its own ----------------------------------------------------------------------


def run_trl(model: str, data: str, out: Path, processes: int, peer: dict[str, dict[str, Any]], smoke: bool = False) -> dict:
    from datasets import load_dataset
    from fair import trainer_clock, trl_args
    from transformers import GenerationConfig
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.testing import toy_reward

    clock = trainer_clock("completions/mean_length")
    stop = GenerationConfig.from_pretrained(model).eos_token_id  # same_stop_tokens wrote rlcore's stop ids there

    def keys(values: dict[str, Any]) -> dict[str, Any]:  # data parallelism: the accumulation split over processes
        return {**values, "gradient_accumulation_steps": values["gradient_accumulation_steps"] // processes}

    gpu = dict(
        **keys(peer["gpu"]), output_dir=str(out), max_steps=STEPS,
        optim="adamw_torch",  # rlcore's torch.optim.AdamW (TRL's default: fused)
        use_vllm=True, vllm_mode="colocate",
        generation_kwargs={"stop_token_ids": stop},  # vLLM stops there, as rlcore asks its engine to
        bf16=True, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16"},
    )
    cpu = dict(keys(peer["run"]), max_steps=SMOKE["max_steps"], use_vllm=False, bf16=False, use_cpu=True,
               vllm_enable_sleep_mode=False, generation_kwargs=None, model_init_kwargs={"dtype": "float32"})
    args = trl_args(GRPOConfig, gpu, cpu if smoke else None)
    trainer = GRPOTrainer(model=model, reward_funcs=toy_reward, args=args,
                          train_dataset=load_dataset("json", data_files=data, split="train"), callbacks=[clock])
    settings = {label: lookup(args, path) for label, _, path in COMPARED}
    settings["completions per optimizer step"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * processes
    settings.update({
        "log-probs": "TRL's chunked kernel (trl/kernels/chunked_logprob.py)",
        "old log-probs": "a separate no-grad forward (vLLM IS correction on)",
        "attn_implementation": trainer.model.config._attn_implementation,
        "padding": "left-padded prompts + right-padded completions, whole micro-batch",
        "optimizer": args.optim.value if hasattr(args.optim, "value") else str(args.optim),
        "vllm max_num_batched_tokens": 4096,
        "vllm max_num_seqs": args.per_device_train_batch_size * args.gradient_accumulation_steps,
    })
    trainer.train()
    return {"step_s": clock.step_s(), "mean_length": [log["completions/mean_length"] for log in clock.logs],
            "settings": settings}


def trl_child(model: str, data: str, tmp: Path, name: str, processes: int, mode: str, smoke: bool) -> dict:
    """TRL's side, one round, in a process of its own (`processes` of them, data parallel, with accelerate)."""
    out = tmp / f"{name}.json"
    script = [__file__, "--run", "trl", "--model", model, "--data", data, "--out", str(out), "--mode", mode,
              "--peer", str(tmp / "peer.json")] + (["--smoke"] if smoke else [])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if processes > 1 and not smoke:
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


# -- the driver ---------------------------------------------------------------------------------------


def implementation(config: Any) -> dict[str, Any]:
    """rlcore's implementation choices that TRL makes differently, as table rows."""
    from rlcore.plugins.grpo.objective import old_logprobs_in_step

    chunked = config.train.engine_kwargs.get("chunked_lm_head", True)
    return {
        "log-probs": "hidden states + LM head in chunks" if chunked else "full [B, T, V] logits",
        "old log-probs": "the train step's own forward (one step per round)" if old_logprobs_in_step(config)
        else "a separate no-grad forward",
        "padding": "right-padded, each micro-batch cut to its longest row; LM head on real tokens only",
        "optimizer": "adamw_torch",
    }


def summarise(result: dict, completions: int, skip: int = SKIP) -> dict:
    if result.get("profile"):  # the profiled last step is not measured
        for key in ("step_s", "mean_length", "sync_s", "sync_gb_s"):
            result[key] = (result.get(key) or [])[:-1] or result.get(key)
        result["phases"] = {k: v[:-1] for k, v in result.get("phases", {}).items()}
    steps = result["step_s"][skip:]
    step = statistics.median(steps)
    length = statistics.median(result["mean_length"][skip:]) if result["mean_length"] else float("nan")
    out = {"step_s": round(step, 4), "tokens_per_s": round(length * completions / step, 1), "steps_measured": len(steps),
           "wall_s": round(result["wall_s"], 1)}
    if result.get("setup_s") is not None:
        out["setup_s"] = result["setup_s"]
    if any(s is not None for s in result.get("sync_s") or []):
        sync = [s for s in result["sync_s"][skip:] if s is not None]
        rate = [g for g in result["sync_gb_s"][skip:] if g is not None]
        if sync and rate:
            out.update(sync_s=round(statistics.median(sync), 4), sync_gb_s=round(statistics.median(rate), 2))
    if result.get("phases"):  # where a step's time goes (the driver's view; async generation overlaps train)
        out["phases_s"] = {k.removeprefix("time/"): round(statistics.median(v[skip:] or v), 4)
                           for k, v in result["phases"].items()}
        out["per_step_s"] = {"step": [round(s, 3) for s in result["step_s"]],
                             **{k.removeprefix("time/"): [round(s, 3) for s in v] for k, v in result["phases"].items()}}
    if result.get("profile"):
        out["profile"] = result["profile"]
    return out


def differences(mode: str) -> list[str]:
    """What differs between the two runs by design, beyond the compared settings."""
    if mode == "colocate":
        return ["rlcore: `rlcore run --use-ray` on the example: Ray, train and rollout roles colocated on the GPU, with "
                "the example's sleep level and offloading; TRL: one process, vLLM colocated (sleep mode where rlcore's "
                "vLLM sleeps)",
                "old log-probs for TRL's sampler correction: rlcore takes them (and the ratio) from the train step's own "
                "forward, the same policy since a round feeds one optimizer step; TRL runs a separate no-grad forward",
                "log-probs: rlcore's train engine returns last hidden states and applies the LM head in chunks on real "
                "tokens only; TRL uses its chunked kernel over the padded batch"]
    return [
        "rlcore: one-step-off-policy async: 1 train GPU + 1 vLLM GPU (Ray, NCCL weight sync); round n+1 is generated "
        "while round n trains, so its samples come from the policy one step old",
        "TRL: synchronous, on-policy data parallelism over 2 GPUs: each GPU generates half the round with its own "
        "colocated vLLM, then both train (2 micro-batches each instead of 4)",
        "rlcore applies no vLLM importance-sampling correction with async_generate (the rollout's log-probs serve as "
        "the old policy's); TRL corrects with the settings above",
    ]


def ratio_of(mode: str, ours: dict, theirs: dict) -> float:
    """colocate: rlcore's step time over TRL's (lower is better); separate: rlcore's tokens/s over TRL's."""
    if mode == "colocate":
        return ours["step_s"] / theirs["step_s"]
    return ours["tokens_per_s"] / theirs["tokens_per_s"]


TARGETS = {"colocate": ("ratio <= 0.5 (rlcore / TRL step time)", lambda r: r <= 0.5),
           "separate": ("speedup >= 1.3 (rlcore / TRL tokens/s)", lambda r: r >= 1.3)}
LABELS = {"colocate": ("rlcore colocate.yaml", "TRL colocate"), "separate": ("rlcore separate.yaml async", "TRL sync DP x2")}


def print_table(mode: str, record: dict) -> None:
    labels = dict(zip(("rlcore", "trl"), LABELS[mode]))
    print(f"\n{'':<28}{'round':>6}{'step (s)':>10}{'tokens/s':>12}{'sync (s)':>10}{'sync GB/s':>11}")
    for i, done in enumerate(record["rounds"]):
        for side in ("rlcore", "trl"):
            row = done.get(side)
            if row is None:
                continue
            if "failed" in row:
                print(f"{labels[side]:<28}{i + 1:>6}  FAILED: {row['failed']}")
                continue
            print(f"{labels[side]:<28}{i + 1:>6}{row['step_s']:>10.3f}{row['tokens_per_s']:>12.0f}"
                  + (f"{row['sync_s']:>10.3f}{row['sync_gb_s']:>11.1f}" if "sync_s" in row else ""))
    target, _ = TARGETS[mode]
    if record.get("ratio"):
        print(f"{'ratio, median of rounds':<28}{spread_text(record['ratio'])}   target: {target}: "
              f"{'met' if record['met'] else 'NOT met'}")
    ours = next((d["rlcore"] for d in record["rounds"] if "step_s" in d.get("rlcore", {})), {})
    theirs = next((d["trl"] for d in record["rounds"] if "step_s" in d.get("trl", {})), {})
    if ours.get("phases_s"):
        print("rlcore phases (median s, round 1): " + ", ".join(f"{k} {v:.3f}" for k, v in ours["phases_s"].items()))
    print_provenance(record)
    rl, trl = record.get("settings", {}).get("rlcore", {}), record.get("settings", {}).get("trl", {})
    print(f"\n{'setting':<34}{'rlcore':>26}{'TRL':>26}")
    for key in dict.fromkeys([*rl, *trl]):
        value, other = rl.get(key, "-"), trl.get(key, "-")
        print(f"{key:<34}{str(value):>26}{str(other):>26}{'' if value == other else '   DIFFERS'}")
    print("\nby design:\n" + "\n".join(f"- {line}" for line in differences(mode)))
    if ours.get("profile") or theirs.get("profile"):
        print("(profiles printed above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["colocate", "separate"], default="colocate")
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/grpo_gpu-<mode>-<date>-<kind>.json)")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    parser.add_argument("--only", choices=["rlcore", "trl"], help="run one side (kept in the JSON beside the other's)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of rlcore, TRL (default 2)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, hf rollout, TRL without vLLM, "
                        "2 steps: the code paths only (both GPU configs are built there too)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an rlcore key of its own on top of the example (repeatable; listed in the table)")
    parser.add_argument("--profile", action="store_true", help="profile rlcore's last train_step (not measured)")
    parser.add_argument("--run", choices=["trl"], help=argparse.SUPPRESS)
    for flag in ("--model", "--data", "--out", "--peer"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:  # a child: TRL, results to --out (rank 0 of a data-parallel TRL run writes)
        result = run_trl(args.model, args.data, Path(args.out).with_suffix(""), args.processes,
                         json.loads(Path(args.peer).read_text()), args.smoke)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(result, default=str))
        return

    own = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}  # as rlcore run
    started = time.perf_counter()
    path = results_path(args.json, f"grpo_gpu-{args.mode}-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    record = json.loads(path.read_text()) if args.only and path.exists() else {}  # the other side's earlier rounds
    record.update({"mode": args.mode, "kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                   "smoke": args.smoke, "host": host_info(), "rounds_asked": args.rounds,
                   "work": f"{PROMPTS} prompts x {GENERATIONS} generations x {TOKENS} tokens, Qwen2-0.5B shape, "
                   f"bf16 checkpoint, median of steps {SKIP + 1}-{STEPS}", "by_design": differences(args.mode)})
    record["rounds"] = [] if not args.only else record.get("rounds", [])
    processes = 2 if args.mode == "separate" else 1
    skip = 0 if args.smoke else SKIP
    completions = SMOKE["num_generations"] * 2 if args.smoke else PROMPTS * GENERATIONS
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_model(tmp / "qwen2-0.5b-shaped", SHAPE, SMOKE_SHAPE if args.smoke else None)
        same_stop_tokens(model)  # before either side loads the model
        data = tmp / "prompts.jsonl"
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in toy_dataset()]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        # the GPU run's config, loaded and checked as `rlcore config validate` does (on the CPU too, under --smoke)
        gpu_keys = rlcore_keys(args.mode, model, str(data), tmp / "rlcore", own, gpu=True)
        gpu_config = user_config("grpo", EXAMPLES[args.mode], {k: v for part in gpu_keys for k, v in part.items()})
        keys = rlcore_keys(args.mode, model, str(data), tmp / "rlcore", own, gpu=not args.smoke)
        config = user_config("grpo", EXAMPLES[args.mode], {k: v for part in keys for k, v in part.items()}) \
            if args.smoke else gpu_config
        (tmp / "peer.json").write_text(json.dumps({"gpu": peer_of(gpu_config, args.mode), "run": peer_of(config, args.mode)}))
        record["rlcore_runs"] = {"rlcore": provenance(EXAMPLES[args.mode], *keys)}
        record.setdefault("settings", {})["rlcore"] = {**rlcore_settings(config, args.mode, not args.smoke),
                                              **implementation(config)}
        flat = {k: v for part in keys for k, v in part.items()}
        for index, side in interleave([args.only] if args.only else ["rlcore", "trl"], args.rounds):
            if len(record["rounds"]) <= index:
                record["rounds"].append({})
            try:
                if side == "rlcore":
                    name = f"rlcore-{index + 1}"  # a fresh output_dir each round: a used one holds checkpoints
                    result = run_rlcore(args.mode, {**flat, "output_dir": str(tmp / name)}, tmp, name, args.profile)
                else:
                    result = trl_child(model, str(data), tmp, f"trl-{index + 1}", processes, args.mode, args.smoke)
                    record["settings"]["trl"] = result.pop("settings")
                record["rounds"][index][side] = summarise(result, completions, skip)
            except Exception as error:  # noqa: BLE001 - the other side still runs; the child's log says why
                record["rounds"][index][side] = failure(error)
            record["rounds"][index][side]["commit"] = git_commit()
            compare(args.mode, record)
            record["wall_s"] = round(time.perf_counter() - started, 1)
            write_json(path, record)
    print_table(args.mode, record)
    print(f"wrote {path}")
    failed = sorted({side for done in record["rounds"] for side, row in done.items() if "failed" in row})
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def compare(mode: str, record: dict) -> None:
    """Each side's median over the rounds, the per-round ratio (rounds where both sides ran), its median and range,
    the target met by the median, into `record`."""
    for side in ("rlcore", "trl"):
        done = [r[side] for r in record["rounds"] if "step_s" in r.get(side, {})]
        if done:
            record[side] = {"step_s": round(statistics.median(r["step_s"] for r in done), 4),
                            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in done), 1),
                            "steps_measured": done[0]["steps_measured"], "rounds": len(done),
                            "settings": record.get("settings", {}).get(side, {})}
    ratios = [ratio_of(mode, r["rlcore"], r["trl"]) for r in record["rounds"]
              if "step_s" in r.get("rlcore", {}) and "step_s" in r.get("trl", {})]
    if ratios:
        target, met = TARGETS[mode]
        record.update(ratio=spread(ratios), target=target, met=met(statistics.median(ratios)), labels=list(LABELS[mode]))
        rl, trl = record.get("settings", {}).get("rlcore", {}), record.get("settings", {}).get("trl", {})
        record["differ"] = [k for k, v in rl.items() if trl.get(k, "-") != v]


if __name__ == "__main__":
    main()
