"""verl 0.9.1's side of benchmarks/grpo_gpu.py: its GRPO (FSDP actor, vLLM colocated: the hybrid engine) on the work
the other sides do, configured from the values rlcore's run resolved (`overrides`), run as `python -m
verl.trainer.main_ppo KEY=VALUE...` in a process of its own whose Python path puts verl's own site directory first
(`VERL_SITE`: verl pins transformers < 5.11, the image has 5.17; benchmarks/verl/ stages it), its per-step metrics
read back from verl's file logger (`read_log`).

Without flash-attn (not in the image) verl runs `attn_implementation=sdpa` and `use_remove_padding=False` (its
padding-free path needs flash-attn's varlen kernels): its micro-batches are padded, as the table says.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# rlcore's loss_type -> verl's actor.loss_agg_mode (verl/trainer/ppo/core_algos.py agg_loss)
LOSS_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
REWARD = '''
"""The toy reward as verl calls a custom reward function: rlcore.testing.toy_reward on one completion."""
from rlcore.testing import toy_reward


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(toy_reward([None], [solution_str], target=[ground_truth])[0])
'''


def write_data(rows: list[dict[str, Any]], out: Path) -> Path:
    """The prompts as verl's RLHFDataset reads them: parquet with `prompt` (chat messages), `data_source`,
    `reward_model.ground_truth` (the row's target) and `extra_info`."""
    import pandas as pd

    table = [{"data_source": "toy", "prompt": r["prompt"], "ability": "toy",
              "reward_model": {"style": "rule", "ground_truth": r["target"]}, "extra_info": {"index": i}}
             for i, r in enumerate(rows)]
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(table).to_parquet(out)
    return out


def overrides(config: Any, model: str, data: Path, reward: Path, out: Path, work: dict[str, Any],
              prompt_length: int, gpus: int = 1, dynamic_bsz: bool = False) -> list[str]:
    """verl's Hydra overrides for the work of rlcore's resolved `config` (`work`: prompts, generations, completion
    tokens, micro-batch, steps). `dynamic_bsz`: verl's token-budget micro-batches (`use_dynamic_bsz`, budget the
    padded micro-batch's tokens), still padded without flash-attn."""
    prompts, micro = work["prompts"], work["micro"]
    top_k = config.top_k if config.top_k else -1
    keys = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "algorithm.norm_adv_by_std_in_grpo": str(config.scale_rewards) in ("group", "True", "true"),
        "data.train_files": str(data), "data.val_files": str(data),
        "data.train_batch_size": prompts,  # prompts a round; x rollout.n completions
        "data.max_prompt_length": prompt_length, "data.max_response_length": config.max_completion_length,
        "data.filter_overlong_prompts": False, "data.truncation": "error", "data.dataloader_num_workers": 0,
        "data.shuffle": False, "data.seed": config.seed,
        "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.model.use_remove_padding": False,  # its padding-free path needs flash-attn
        "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing": bool(config.train.gradient_checkpointing),
        "actor_rollout_ref.actor.strategy": "fsdp",
        "actor_rollout_ref.actor.optim.lr": config.learning_rate,
        "actor_rollout_ref.actor.optim.weight_decay": config.weight_decay,
        "actor_rollout_ref.actor.optim.betas": f"[{config.adam_beta1},{config.adam_beta2}]",
        "actor_rollout_ref.actor.optim.lr_scheduler_type": config.lr_scheduler_type
        if config.lr_scheduler_type in ("constant", "cosine") else "constant",
        "actor_rollout_ref.actor.grad_clip": config.max_grad_norm,
        "actor_rollout_ref.actor.ppo_mini_batch_size": prompts,  # one optimizer step a round, as the other sides
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.actor.use_dynamic_bsz": dynamic_bsz,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": micro * (prompt_length + config.max_completion_length),
        "actor_rollout_ref.actor.ppo_epochs": config.num_iterations,
        "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.kl_loss_coef": 0.0,
        "actor_rollout_ref.actor.entropy_coeff": 0,
        "actor_rollout_ref.actor.clip_ratio_low": config.epsilon,
        "actor_rollout_ref.actor.clip_ratio_high": config.epsilon_high if config.epsilon_high is not None else config.epsilon,
        "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG[config.loss_type],
        "actor_rollout_ref.actor.fsdp_config.param_offload": bool(config.offload_model),
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": bool(config.offload_optimizer),
        "actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16",  # rlcore's hf engine trains bf16 weights
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.gpu_memory_utilization": config.rollout.vllm_gpu_memory_utilization,
        "actor_rollout_ref.rollout.n": work["generations"],
        "actor_rollout_ref.rollout.temperature": config.temperature,
        "actor_rollout_ref.rollout.top_p": config.top_p, "actor_rollout_ref.rollout.top_k": top_k,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": micro,
        "actor_rollout_ref.rollout.free_cache_engine": config.sleep_level > 0,
        "actor_rollout_ref.rollout.calculate_log_probs": bool(config.vllm_importance_sampling_correction),
        "reward_model.enable": False,
        "custom_reward_function.path": str(reward), "custom_reward_function.name": "compute_score",
        "trainer.n_gpus_per_node": gpus, "trainer.nnodes": 1, "trainer.total_training_steps": work["steps"],
        "trainer.total_epochs": 1000, "trainer.logger": "[console,file]", "trainer.val_before_train": False,
        "trainer.test_freq": -1, "trainer.save_freq": -1, "trainer.resume_mode": "disable",
        "trainer.project_name": "rlcore-bench", "trainer.experiment_name": out.name,
        "trainer.default_local_dir": str(out),
    }
    if config.vllm_importance_sampling_correction:  # TRL's correction, in verl's rollout_correction terms:
        # *_truncate: importance weights capped at the threshold (rollout_is); *_mask: and the rows above it
        # rejected (rollout_rs)
        mode = str(config.vllm_importance_sampling_mode)
        level = "sequence" if mode.startswith("sequence") else "token"
        keys["algorithm.rollout_correction.rollout_is"] = level
        keys["algorithm.rollout_correction.rollout_is_threshold"] = config.vllm_importance_sampling_clip_max
        if mode.endswith("mask"):
            keys["algorithm.rollout_correction.rollout_rs"] = level
            keys["algorithm.rollout_correction.rollout_rs_threshold"] = config.vllm_importance_sampling_clip_max
    return [f"{k}={'null' if v is None else v}" for k, v in keys.items()]


def settings(config: Any, keys: list[str]) -> dict[str, Any]:
    """verl's compared settings, as the overrides set them (the table's third column)."""
    given = dict(k.lstrip("+").split("=", 1) for k in keys)
    a = "actor_rollout_ref."
    return {
        "learning_rate": float(given[a + "actor.optim.lr"]),
        "lr_scheduler_type": given[a + "actor.optim.lr_scheduler_type"],
        "weight_decay": float(given[a + "actor.optim.weight_decay"]), "max_grad_norm": float(given[a + "actor.grad_clip"]),
        "beta": 0.0, "epsilon": float(given[a + "actor.clip_ratio_low"]),
        "epsilon_high": float(given[a + "actor.clip_ratio_high"]), "importance_sampling_level": "token",
        "mask_truncated_completions": False, "seed": int(given["data.seed"]),
        "loss_type": f"{config.loss_type} -> loss_agg_mode {given[a + 'actor.loss_agg_mode']}",
        "scale_rewards": f"norm_adv_by_std_in_grpo {given['algorithm.norm_adv_by_std_in_grpo']}",
        "num_iterations": int(given[a + "actor.ppo_epochs"]), "temperature": float(given[a + "rollout.temperature"]),
        "top_p": float(given[a + "rollout.top_p"]), "top_k": f"{given[a + 'rollout.top_k']} (none)",
        "num_generations": int(given[a + "rollout.n"]), "max_completion_length": int(given["data.max_response_length"]),
        "per_device_train_batch_size": int(given[a + "actor.ppo_micro_batch_size_per_gpu"]),
        "gradient_accumulation_steps": int(given["data.train_batch_size"]) * int(given[a + "rollout.n"])
        // int(given[a + "actor.ppo_micro_batch_size_per_gpu"]),
        "completions per optimizer step": int(given["data.train_batch_size"]) * int(given[a + "rollout.n"]),
        "gradient_checkpointing": given[a + "model.enable_gradient_checkpointing"] == "True",
        "vllm_gpu_memory_utilization": float(given[a + "rollout.gpu_memory_utilization"]),
        "vllm sleep mode": given[a + "rollout.free_cache_engine"] == "True",
        "vllm_importance_sampling_correction": "algorithm.rollout_correction" in " ".join(given),
        "vllm_importance_sampling_mode": "rollout_is " + given.get("algorithm.rollout_correction.rollout_is", "-")
        + ", rollout_rs " + given.get("algorithm.rollout_correction.rollout_rs", "-"),
        "vllm_importance_sampling_clip_max": float(given.get("algorithm.rollout_correction.rollout_is_threshold", "nan")),
        "offload_model / offload_optimizer": f"{given[a + 'actor.fsdp_config.param_offload']} / "
                                             f"{given[a + 'actor.fsdp_config.optimizer_offload']}",
        "dtype": "bf16 weights, FSDP mixed precision", "attn_implementation": "sdpa",
        "padding": "use_remove_padding false (needs flash-attn): padded micro-batches"
                   + (", use_dynamic_bsz" if given[a + "actor.use_dynamic_bsz"] == "True" else ""),
        "old log-probs": "a separate no-grad forward (compute_log_prob)",
        "optimizer": "torch.optim.AdamW", "rollout engine": "vllm (async, hybrid engine)",
    }


CHECK = """
import os, sys
import verl
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass, validate_config

with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
    cfg = compose("ppo_trainer", overrides=sys.argv[1:])
for section in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm):
    omega_conf_to_dataclass(section)
validate_config(cfg, use_reference_policy=False, use_critic=False)
print("verl", verl.__version__, "accepts the overrides")
"""


def check(keys: list[str], site: str) -> str:
    """verl's own checks of `keys` in its environment (no GPU): Hydra composes them onto its ppo_trainer config,
    the actor, rollout and algorithm sections become verl's dataclasses, `validate_config` passes. Its last line,
    or a RuntimeError with verl's message."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", CHECK, *keys], env=environment(site, Path(os.devnull)),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"verl refused the overrides: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return done.stdout.strip().splitlines()[-1]


def command(keys: list[str]) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo", *keys]


def environment(site: str, log: Path) -> dict[str, str]:
    """verl's process: its own site directory ahead of the kit's (transformers 5.9 over the image's 5.17), its file
    logger at `log`."""
    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "VERL_FILE_LOGGER_PATH": str(log), "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1"}


def read_log(log: Path) -> dict[str, Any]:
    """Per-step values from verl's file logger (`{"step": n, "data": {...}}` a line): step seconds, completion
    lengths, the generate and actor-update phases, verl's own MFU."""
    rows = [json.loads(line)["data"] for line in log.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/step" in r]

    def column(key: str) -> list[float]:
        return [float(r.get(key, float("nan"))) for r in rows]

    return {"step_s": column("timing_s/step"), "mean_length": column("response_length/mean"),
            "max_length": column("response_length/max"), "train_s": column("timing_s/update_actor"),
            "phases": {"time/generate": column("timing_s/gen"), "time/old_logprobs": column("timing_s/old_log_prob"),
                       "time/train": column("timing_s/update_actor")},
            "verl_mfu_actor": column("perf/mfu/actor")}
