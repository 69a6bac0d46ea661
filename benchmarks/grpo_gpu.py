"""GRPO on the GPU, side by side: rlcore as a user runs it against TRL's GRPOTrainer and verl, interleaved in rounds.

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
    python benchmarks/grpo_gpu.py --lengths mixed     # completions of long-tailed lengths (median 64 of 256)
    python benchmarks/grpo_gpu.py --only verl         # verl 0.9.1 (its wheels staged by benchmarks/verl/stage.sh;
                                                      # its site directory in VERL_SITE, default /tmp/gpu/verl-site)
    python benchmarks/grpo_gpu.py --lengths mixed --arms padded,varlen --rounds 1   # rlcore's packing A/B beside TRL

Arms. `--arms padded,varlen,budget` replaces rlcore's side by one side per arm of its train engine's packing
(`ARMS`): `padded` (train.padding_free=false: right-padded micro-batches), `varlen` (train.padding_free=true: rows
packed, attention through torch's varlen_attn on the GPU) and `budget` (packed, with
train.max_tokens_per_micro_batch=BUDGET). Each arm's train-phase MFU is printed beside TRL's; the result decides
`PACK_WITH_VARLEN_BY_DEFAULT` in plugins/hf/attention.py. Run it with `--lengths mixed`: with fixed lengths no
micro-batch holds padding and the arms do the same work.

Lengths. `--lengths fixed` (the default): every completion of the random model runs to the limit, so no micro-batch
holds padding. `--lengths mixed`: the model is nudged to stop (`fair.nudge_to_stop`: its stop token's output row is
set so that the estimated median completion is 64 tokens, with a long tail to the 256 limit), the same checkpoint
for every side, so the sides measure what padding costs them. The table then gives each side's train phase: its
seconds, trained tokens per second (prompt and completion tokens, no padding counted) and model-FLOP utilisation
against the H200's dense bf16 peak (`fair.train_flops_per_token`; TRL's train phase is its training_step less the
generation in _prepare_inputs, verl's its update_actor timing).

verl. `--only verl` (or `--sides rlcore,trl,verl`): verl 0.9.1's GRPO, FSDP actor with vLLM colocated (its hybrid
engine), on the same model, data and reward, batch, lengths, sampling, optimizer, loss aggregation (rlcore's
loss_type as verl's loss_agg_mode), KL off and vLLM memory share (`verl_side.overrides`), attn_implementation sdpa
and use_remove_padding false (no flash-attn in the image), in a process whose Python path puts verl's own site
directory first (verl pins transformers < 5.11).

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
import math
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

import verl_side
from fair import mfu, nudge_on, prompt_tokens, train_flops_per_token, train_phase_clock

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
MIXED_MEDIAN = {"gpu": 64, "smoke": 3}  # --lengths mixed: the median completion (of 256; --smoke: of 8)
VERL_SITE = os.environ.get("VERL_SITE", "/tmp/gpu/verl-site")  # benchmarks/verl/install.sh puts verl there
SIDES = ("rlcore", "trl", "verl")
BUDGET = 8192  # the budget arm's tokens per micro-batch: about twice a padded micro-batch of 16 rows (16 x ~300)
# --arms: rlcore's train-engine packing, one side per arm ("rlcore-<arm>"), the keys set on the example
ARMS: dict[str, dict[str, Any]] = {
    "padded": {"train.padding_free": False},
    "varlen": {"train.padding_free": True},
    "budget": {"train.padding_free": True, "train.max_tokens_per_micro_batch": BUDGET},
}
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
            "max_length": [r.get("completions/max_length") for r in rows],
            "train_s": [r.get("time/train") for r in rows],
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
    phase = train_phase_clock(trainer)
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
            "max_length": [log.get("completions/max_length") for log in clock.logs], "train_s": phase.seconds,
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


# -- verl's side, in a process of its own (verl_side.py) ------------------------------------------------


def run_verl(config: Any, model: str, tmp: Path, name: str, prompt_length: int, gpu: bool) -> dict:
    """verl's side, one round: `python -m verl.trainer.main_ppo` with the overrides of rlcore's resolved config.
    Without `gpu` (--smoke) its data, reward and overrides are built and not run (verl needs a GPU and vLLM)."""
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in toy_dataset()]
    data = verl_side.write_data(rows, tmp / "verl" / "train.parquet")
    reward = tmp / "verl" / "toy_reward.py"
    reward.write_text(verl_side.REWARD)
    work = {"prompts": PROMPTS if gpu else 2, "generations": config.num_generations,
            "micro": config.per_device_train_batch_size, "steps": config.max_steps}
    keys = verl_side.overrides(config, model, data, reward, tmp / name, work, prompt_length)
    log = tmp / f"{name}.verl.jsonl"
    checked = verl_side.check(keys, VERL_SITE) if Path(VERL_SITE).is_dir() else f"not checked: no {VERL_SITE}"
    if not gpu:
        return {"skipped": f"--smoke: verl needs a GPU and vLLM; its overrides were built ({checked})",
                "settings": verl_side.settings(config, keys), "cmd": " ".join(["python -m verl.trainer.main_ppo", *keys])}
    started = time.perf_counter()
    run_child(verl_side.command(keys), verl_side.environment(VERL_SITE, log), stdout=sys.stderr)
    result = verl_side.read_log(log)
    result.update(wall_s=time.perf_counter() - started, settings=verl_side.settings(config, keys),
                  cmd=" ".join(["python -m verl.trainer.main_ppo", *keys]))
    return result


# -- the driver ---------------------------------------------------------------------------------------


def implementation(config: Any) -> dict[str, Any]:
    """rlcore's implementation choices that TRL makes differently, as table rows."""
    from rlcore.plugins.grpo.experience import OldLogprobs

    chunked = config.train.engine_kwargs.get("chunked_lm_head", True)
    packing = getattr(config.train, "padding_free", None)
    packing = config.train.engine_kwargs.get("padding_free") if packing is None else packing
    return {
        "log-probs": "hidden states + LM head in chunks" if chunked else "full [B, T, V] logits",
        "old log-probs": "the train step's own forward (one step per round)" if OldLogprobs.of(config).source == "step"
        else "a separate no-grad forward",
        "padding": {True: "padding-free: rows packed (torch's varlen_attn on the GPU), token-budget micro-batches",
                    False: "right-padded, each micro-batch cut to its longest row",
                    None: "the engine's choice (PACK_WITH_VARLEN_BY_DEFAULT; its log line says which)"}[packing]
        + "; LM head on real tokens only",
        "optimizer": "adamw_torch",
    }


def train_phase(result: dict, completions: int, skip: int, work: dict[str, Any]) -> dict[str, Any]:
    """The train phase's median seconds, trained tokens per second (prompt and completion, no padding) and
    model-FLOP utilisation (`fair.mfu`), and a padded batch's share of padding (its longest completion's width for
    every row: what a side that pads each micro-batch to its longest row computes at most)."""
    seconds = [s for s in (result.get("train_s") or [])[skip:] if s]
    lengths = [m for m in result["mean_length"][skip:] if m == m]
    if not seconds or not lengths:
        return {}
    mean, prompt = statistics.median(lengths), work["prompt_tokens"]
    step = statistics.median(seconds)
    tokens = completions * (prompt + mean)
    out = {"train_s": round(step, 4), "train_tokens_per_s": round(tokens / step, 1),
           "train_mfu": round(mfu(tokens, train_flops_per_token(work["model"], (prompt + mean) / 2), step), 4)}
    longest = [m for m in (result.get("max_length") or [])[skip:] if m]
    if longest:
        out["padded_share"] = round(1 - (prompt + mean) / (prompt + statistics.median(longest)), 3)
    return out


def summarise(result: dict, completions: int, skip: int = SKIP, work: dict[str, Any] | None = None) -> dict:
    if result.get("profile"):  # the profiled last step is not measured
        for key in ("step_s", "mean_length", "max_length", "train_s", "sync_s", "sync_gb_s"):
            result[key] = (result.get(key) or [])[:-1] or result.get(key)
        result["phases"] = {k: v[:-1] for k, v in result.get("phases", {}).items()}
    steps = result["step_s"][skip:]
    step = statistics.median(steps)
    length = statistics.median(result["mean_length"][skip:]) if result["mean_length"] else float("nan")
    out = {"step_s": round(step, 4), "tokens_per_s": round(length * completions / step, 1), "steps_measured": len(steps),
           "wall_s": round(result["wall_s"], 1)}
    if result.get("setup_s") is not None:
        out["setup_s"] = result["setup_s"]
    if work is not None:
        out.update(train_phase(result, completions, skip, work))
    if result.get("verl_mfu_actor"):  # verl's own estimate, beside ours
        out["verl_mfu_actor"] = round(statistics.median(result["verl_mfu_actor"][skip:] or [float("nan")]), 4)
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


VERL_BY_DESIGN = [
    "verl: `python -m verl.trainer.main_ppo` (Ray, FSDP actor, vLLM colocated as its hybrid engine, async rollout), "
    "its site directory first (transformers < 5.11); attn_implementation sdpa and use_remove_padding false (its "
    "padding-free path needs flash-attn, absent from the image), so its micro-batches are padded; old log-probs from a "
    "separate forward; no reference model (KL off)",
]


def differences(mode: str) -> list[str]:
    """What differs between the runs by design, beyond the compared settings."""
    return _differences(mode) + VERL_BY_DESIGN


def _differences(mode: str) -> list[str]:
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
VERL_TARGET = ("ratio <= 0.8 (rlcore / verl step time)", lambda r: r <= 0.8)
LABELS = {"colocate": ("rlcore colocate.yaml", "TRL colocate", "verl 0.9.1 hybrid engine"),
          "separate": ("rlcore separate.yaml async", "TRL sync DP x2", "verl 0.9.1 hybrid engine")}


def sides_of(record: dict) -> list[str]:
    """The sides the rounds ran: rlcore's (or its arms'), TRL, verl, in that order."""
    ran = {side for done in record["rounds"] for side in done}
    return [side for side in ("rlcore", *(f"rlcore-{arm}" for arm in ARMS), "trl", "verl") if side in ran]


def labels_of(mode: str) -> dict[str, str]:
    return {**dict(zip(SIDES, LABELS[mode])), **{f"rlcore-{arm}": f"rlcore {arm}" for arm in ARMS}}


def print_table(mode: str, record: dict) -> None:
    labels = labels_of(mode)
    print(f"\n{'':<28}{'round':>6}{'step (s)':>10}{'tokens/s':>12}{'train (s)':>11}{'train tok/s':>13}{'MFU':>7}"
          f"{'padded':>8}{'sync (s)':>10}{'sync GB/s':>11}")
    for i, done in enumerate(record["rounds"]):
        for side in sides_of(record):
            row = done.get(side)
            if row is None:
                continue
            if "failed" in row or "skipped" in row:
                print(f"{labels[side]:<28}{i + 1:>6}  {'FAILED: ' + row['failed'] if 'failed' in row else row['skipped']}")
                continue
            train = (f"{row['train_s']:>11.3f}{row['train_tokens_per_s']:>13.0f}{row['train_mfu']:>7.1%}"
                     if "train_s" in row else f"{'-':>11}{'-':>13}{'-':>7}")
            print(f"{labels[side]:<28}{i + 1:>6}{row['step_s']:>10.3f}{row['tokens_per_s']:>12.0f}{train}"
                  f"{row.get('padded_share', float('nan')):>8.1%}"
                  + (f"{row['sync_s']:>10.3f}{row['sync_gb_s']:>11.1f}" if "sync_s" in row else ""))
    print("(train: the train phase; MFU of the H200's dense bf16 peak; padded: a padded batch's share of padding, its "
          "longest completion's width for every row)")
    target, _ = TARGETS[mode]
    if record.get("ratio"):
        print(f"{'ratio to TRL, median':<28}{spread_text(record['ratio'])}   target: {target}: "
              f"{'met' if record['met'] else 'NOT met'}")
    for label, each in (record.get("ratios") or {}).items():
        print(f"{label:<28}{spread_text(each)}")
    if record.get("ratio_verl"):
        print(f"{'ratio to verl, median':<28}{spread_text(record['ratio_verl'])}   target: {VERL_TARGET[0]}: "
              f"{'met' if record['met_verl'] else 'NOT met'}")
    if record.get("lengths"):
        est = record["lengths"]
        print(f"lengths: mixed, estimated p10 {est['p10']}, median {est['median_tokens']}, p90 {est['p90']}, "
              f"{est['reach_limit']:.0%} reach {est['limit']} ({est['how']})")
    ours = next((d["rlcore"] for d in record["rounds"] if "step_s" in d.get("rlcore", {})), {})
    theirs = next((d["trl"] for d in record["rounds"] if "step_s" in d.get("trl", {})), {})
    if ours.get("phases_s"):
        print("rlcore phases (median s, round 1): " + ", ".join(f"{k} {v:.3f}" for k, v in ours["phases_s"].items()))
    print_provenance(record)
    every = record.get("settings", {})
    ran = [side for side in sides_of(record) if side in every]
    print(f"\n{'setting':<34}" + "".join(f"{side:>30}" for side in ran))
    for key in dict.fromkeys(k for side in ran for k in every[side]):
        values = [every[side].get(key, "-") for side in ran]
        print(f"{key:<34}" + "".join(f"{str(v)[:29]:>30}" for v in values)
              + ("" if len({str(v) for v in values}) == 1 else "   DIFFERS"))
    print("\nby design:\n" + "\n".join(f"- {line}" for line in differences(mode)))
    if ours.get("profile") or theirs.get("profile"):
        print("(profiles printed above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["colocate", "separate"], default="colocate")
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/grpo_gpu-<mode>-<date>-<kind>.json)")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    parser.add_argument("--only", choices=list(SIDES), help="run one side (kept in the JSON beside the others')")
    parser.add_argument("--sides", default="rlcore,trl", help="the sides of a round, in order (default rlcore,trl; "
                        "verl too: rlcore,trl,verl)")
    parser.add_argument("--lengths", choices=["fixed", "mixed"], default="fixed",
                        help="fixed: every completion to the limit; mixed: a model nudged to stop, long-tailed lengths")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of rlcore, TRL (default 2)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, hf rollout, TRL without vLLM, "
                        "2 steps: the code paths only (both GPU configs are built there too)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an rlcore key of its own on top of the example (repeatable; listed in the table)")
    parser.add_argument("--profile", action="store_true", help="profile rlcore's last train_step (not measured)")
    parser.add_argument("--arms", help=f"rlcore's packing arms in place of its side, of {', '.join(ARMS)} "
                        "(e.g. padded,varlen; each a side beside TRL)")
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
    arms = args.arms.split(",") if args.arms else []
    if [a for a in arms if a not in ARMS]:
        parser.error(f"--arms {args.arms}: the arms are {', '.join(ARMS)}")
    order = [args.only] if args.only else args.sides.split(",")
    if arms:  # rlcore's side becomes one side per arm
        order = [s for side in order for s in ([f"rlcore-{a}" for a in arms] if side == "rlcore" else [side])]
    started = time.perf_counter()
    mixed = args.lengths == "mixed"
    stem = f"grpo_gpu-{args.mode}{'-mixed' if mixed else ''}{'-arms' if arms else ''}"
    path = results_path(args.json, f"{stem}-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    record = json.loads(path.read_text()) if args.only and path.exists() else {}  # the other side's earlier rounds
    record.update({"mode": args.mode, "kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                   "smoke": args.smoke, "host": host_info(), "rounds_asked": args.rounds,
                   "work": f"{PROMPTS} prompts x {GENERATIONS} generations x {TOKENS} tokens"
                   f"{' at most, long-tailed lengths' if mixed else ''}, Qwen2-0.5B shape, "
                   f"bf16 checkpoint, median of steps {SKIP + 1}-{STEPS}", "by_design": differences(args.mode),
                   "lengths_asked": args.lengths})
    record["rounds"] = [] if not args.only else record.get("rounds", [])
    processes = 2 if args.mode == "separate" else 1
    skip = 0 if args.smoke else SKIP
    completions = SMOKE["num_generations"] * 2 if args.smoke else PROMPTS * GENERATIONS
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_model(tmp / "qwen2-0.5b-shaped", SHAPE, SMOKE_SHAPE if args.smoke else None)
        same_stop_tokens(model)  # before either side loads the model
        if mixed:  # the same nudged checkpoint for every side
            median = MIXED_MEDIAN["smoke" if args.smoke else "gpu"]
            record["lengths"] = nudge_on("cpu" if args.smoke else "cuda", model, median,
                                         SMOKE["max_completion_length"] if args.smoke else TOKENS)
        data = tmp / "prompts.jsonl"
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in toy_dataset()]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        work = {"model": model, "prompt_tokens": prompt_tokens(model, [r["prompt"] for r in rows])}
        prompt_length = 2 ** math.ceil(math.log2(work["prompt_tokens"] * 2))  # verl's max_prompt_length: room for all
        # the GPU run's config, loaded and checked as `rlcore config validate` does (on the CPU too, under --smoke)
        gpu_keys = rlcore_keys(args.mode, model, str(data), tmp / "rlcore", own, gpu=True)
        gpu_config = user_config("grpo", EXAMPLES[args.mode], {k: v for part in gpu_keys for k, v in part.items()})
        keys = rlcore_keys(args.mode, model, str(data), tmp / "rlcore", own, gpu=not args.smoke)
        config = user_config("grpo", EXAMPLES[args.mode], {k: v for part in keys for k, v in part.items()}) \
            if args.smoke else gpu_config
        (tmp / "peer.json").write_text(json.dumps({"gpu": peer_of(gpu_config, args.mode), "run": peer_of(config, args.mode)}))
        record.setdefault("rlcore_runs", {})["rlcore"] = provenance(EXAMPLES[args.mode], *keys)  # --only: beside the others
        record.setdefault("settings", {})["rlcore"] = {**rlcore_settings(config, args.mode, not args.smoke),
                                              **implementation(config)}
        flat = {k: v for part in keys for k, v in part.items()}
        for arm in arms:  # each arm's config checked here, on the CPU, before a GPU is taken
            arm_config = user_config("grpo", EXAMPLES[args.mode], {**flat, **ARMS[arm]})
            record["rlcore_runs"][f"rlcore-{arm}"] = provenance(EXAMPLES[args.mode], *keys[:2], {**keys[2], **ARMS[arm]})
            record["settings"][f"rlcore-{arm}"] = {**rlcore_settings(arm_config, args.mode, not args.smoke),
                                                   **implementation(arm_config)}
        if arms:  # the arms' runs and settings stand in for rlcore's
            record["settings"].pop("rlcore")
            record["rlcore_runs"].pop("rlcore")
        for index, side in interleave(order, args.rounds):
            if len(record["rounds"]) <= index:
                record["rounds"].append({})
            try:
                if side.startswith("rlcore"):
                    arm = ARMS[side.removeprefix("rlcore-")] if side != "rlcore" else {}
                    name = f"{side}-{index + 1}"  # a fresh output_dir each round: a used one holds checkpoints
                    result = run_rlcore(args.mode, {**flat, **arm, "output_dir": str(tmp / name)}, tmp, name, args.profile)
                elif side == "trl":
                    result = trl_child(model, str(data), tmp, f"trl-{index + 1}", processes, args.mode, args.smoke)
                    record["settings"]["trl"] = result.pop("settings")
                else:
                    result = run_verl(config, model, tmp, f"verl-{index + 1}", prompt_length, not args.smoke)
                    record["settings"]["verl"] = result.pop("settings")
                    record.setdefault("verl_runs", []).append(result.pop("cmd"))
                row = result if "skipped" in result else summarise(result, completions, skip, work)
                record["rounds"][index][side] = row
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
    """Each side's median over the rounds, the per-round ratios to TRL and to verl (rounds where both sides ran),
    their medians and ranges, the targets met by the medians, into `record`."""
    for side in sides_of(record):
        done = [r[side] for r in record["rounds"] if "step_s" in r.get(side, {})]
        if done:
            record[side] = {"step_s": round(statistics.median(r["step_s"] for r in done), 4),
                            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in done), 1),
                            "steps_measured": done[0]["steps_measured"], "rounds": len(done),
                            "settings": record.get("settings", {}).get(side, {})}
            for key in ("train_s", "train_tokens_per_s", "train_mfu", "padded_share"):
                values = [r[key] for r in done if key in r]
                if values:
                    record[side][key] = round(statistics.median(values), 4)
    versus_verl = [r["rlcore"]["step_s"] / r["verl"]["step_s"] for r in record["rounds"]
                   if "step_s" in r.get("rlcore", {}) and "step_s" in r.get("verl", {})]
    if versus_verl:
        record.update(ratio_verl=spread(versus_verl), target_verl=VERL_TARGET[0],
                      met_verl=VERL_TARGET[1](statistics.median(versus_verl)))
    arms = {side: [ratio_of(mode, r[side], r["trl"]) for r in record["rounds"]
                   if "step_s" in r.get(side, {}) and "step_s" in r.get("trl", {})]
            for side in sides_of(record) if side.startswith("rlcore-")}
    if any(arms.values()):  # each arm over TRL (the colocate mode: step time; separate: tokens/s)
        record["ratios"] = {f"{labels_of(mode)[side]} / TRL": spread(v) for side, v in arms.items() if v}
    ratios = [ratio_of(mode, r["rlcore"], r["trl"]) for r in record["rounds"]
              if "step_s" in r.get("rlcore", {}) and "step_s" in r.get("trl", {})]
    if ratios:
        target, met = TARGETS[mode]
        record.update(ratio=spread(ratios), target=target, met=met(statistics.median(ratios)), labels=list(LABELS[mode]))
        rl, trl = record.get("settings", {}).get("rlcore", {}), record.get("settings", {}).get("trl", {})
        record["differ"] = [k for k, v in rl.items() if trl.get(k, "-") != v]


if __name__ == "__main__":
    main()
