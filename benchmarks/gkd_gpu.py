"""GKD on one GPU, side by side: rlcore as a user runs it against TRL 1.16's `DistillationTrainer` (vLLM
colocate, chunked loss), interleaved in rounds.

rlcore's sides are `rlcore run --plugin gkd --use-ray --config examples/ray/gkd/teacher_colocated.yaml KEY=VALUE...`
(`served`: teacher_standalone.yaml), scaled to this host's GPU, with the example's defaults everywhere except the
keys both sides must share: the models, the data, the batch, the lengths, the steps and lmbda 1 (`WORK`,
`shared_keys`). What else the example and rlcore's defaults choose (dtype auto, sleep level, offloading of the
student and the teacher, vLLM's memory share, beta, temperature, optimizer) is rlcore's; TRL is given the same
values where it has the setting (`peer_of`), so a slow default shows in the ratio. The table says which keys were
set on which example.

The same work on every side: a random Qwen2-0.5B-shaped student (hidden 896, 24 layers) distils a random
Qwen2-1.5B-shaped teacher (hidden 1536, 28 layers), vocabulary 151,936 (Qwen2's), bf16 checkpoints drawn once and
reused; every step on-policy (lmbda 1: `DistillationTrainer` is on-policy only), 64 completions of up to 256 tokens
a step (8 per micro-batch x 8 accumulation steps). The timed sides run interleaved, trl, full, topk, trl, full,
topk (`--rounds`, default 2), each in a fresh process (one vLLM per process):

- `trl`: `trl.DistillationTrainer` (`use_vllm=True`, `vllm_mode="colocate"`; its loss is always the chunked
  `ChunkedDivergenceFunction` over hidden states and LM heads), teacher on the same GPU;
- `full`: rlcore on teacher_colocated.yaml: Ray, vLLM rollout colocated with the train worker, the teacher in the
  train worker, the full vocabulary through the chunked LM-head loss;
- `topk`: the same with `gkd_logits_topk=64` (the teacher's top-64 taken in chunks of positions);
- `memory` (once, not timed): one micro-batch's loss forward + backward at T = 256, 512, 1024 with the engines'
  chunked LM-head path and with the [B, T, V] logits path (`chunked_lm_head=False`), torch's peak allocation;
- `trl-gkd` (only with `--only`, once): TRL's older `GKDTrainer` with `model.generate` (2 steps: it is slow);
- `served` (only with `--only`, two GPUs): rlcore on teacher_standalone.yaml, the teacher a vLLM group on GPU 1
  serving top-64;
- `full-liger` and `trl-liger` (only with `--only`): `full` with the hf engine's `liger_kernel` (liger-kernel's
  RMSNorm, SwiGLU and rotary kernels in the student and the teacher) and TRL with `use_liger_kernel` (the same
  kernels, the student's only: TRL's option does not reach the teacher); the liger-kernel wheel must be installed;
- `full-compile`, `topk-compile` and `trl-compile` (only with `--only`): `full` and `topk` with the hf engine's
  `torch_compile` (each decoder layer of the student and the teacher compiled in place, inductor, dynamic
  shapes) and TRL with transformers' `torch_compile` (`torch.compile` of the whole student, as Trainer does it).

    python benchmarks/gkd_gpu.py --only trl --only full   # 2 rounds of trl, full: about 6 minutes on one H200
    python benchmarks/gkd_gpu.py --only trl --only topk   # the same for top-64
    python benchmarks/gkd_gpu.py --only memory            # the memory sweep alone
    python benchmarks/gkd_gpu.py                  # trl, full, topk (2 rounds) and memory: about 10 minutes
    python benchmarks/gkd_gpu.py --merge a.json --merge b.json --json c.json   # two calls' JSONs (each machine
                                                  # starts bare) as one table and one JSON, with the targets; no run
    python benchmarks/gkd_gpu.py --smoke --rounds 1   # tiny models on the CPU, no vLLM: the code paths only (TRL's
                                                  # and rlcore's GPU configs are built there too)
    python benchmarks/gkd_gpu.py --only full --profile   # + torch's profile of rlcore's last train_step
    python benchmarks/gkd_gpu.py --only trl --only full --lengths mixed   # long-tailed completion lengths

`--lengths mixed`: the student is nudged to stop (`fair.nudge_to_stop`, estimated median 64 of the 256 tokens, a long
tail to the limit; the same checkpoint for both sides), so each side's padding shows. Every timed side also reports
its train phase (rlcore's time/train; TRL's training_step less the generation in _prepare_inputs): seconds, trained
tokens per second (prompt and completion, no padding) and model-FLOP utilisation against the H200's dense bf16 peak,
counting the student's forward and backward and the teacher's forward (`fair.train_flops_per_token`).

The table gives each side's median step time (steps 3-8) and completion tokens per second (the median over the
rounds, each round's too), the peak GPU memory (device-wide, sampled every 0.2 s while the run's process lives, above
what was in use before it), torch's peak allocation and reservation (TRL's process; rlcore's lives in Ray workers),
and x TRL: each round's tokens/s over that round's fastest TRL side (`trl`, `trl-liger`, `trl-compile`: TRL
configured as well as it can be), the median over the rounds and its range; targets, for each rlcore side of that
kind (`full*`, `topk*`), by the median: full >= 1.5x with peak <= that TRL side's, topk >= 2x. `--json PATH`
(default benchmarks/results/gkd_gpu-<date>-<kind>.json; with --smoke, the temporary folder) keeps every side's
rounds and settings, each rlcore side's example and keys, the git commit (`RLCORE_COMMIT` where set) and the targets
met, written after every side; a side that fails is recorded as such and the others still run.
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
from typing import Any

from fair import (failure, free_port, git_commit, host_info, interleave, mfu, print_provenance, profile_env,
                  prompt_tokens, provenance, read_profile, results_path, rlcore_run, run_child, scaled, spread,
                  spread_text, train_flops_per_token, user_config, write_json)

MICRO, ACCUM, TOKENS, STEPS, SKIP = 8, 8, 256, 8, 2
VOCAB = 151936
STUDENT = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
               vocab_size=VOCAB, max_position_embeddings=2048, dtype="bfloat16")
TEACHER = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
               vocab_size=VOCAB, max_position_embeddings=2048, dtype="bfloat16", seed=1)
# --smoke: tiny models on the CPU (their context as long as the GPU models', so the GPU configs' checks pass on them)
SMOKE_STUDENT = dict(hidden_size=64, num_layers=2, vocab_size=1024, max_position_embeddings=2048)
SMOKE_TEACHER = dict(hidden_size=96, num_layers=2, vocab_size=1024, max_position_embeddings=2048, seed=1)
# the work both sides do, set on rlcore's example and given to TRL (with the models, the data and lmbda 1)
WORK: dict[str, Any] = dict(per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
                            max_completion_length=TOKENS, max_steps=STEPS)
SMOKE_WORK: dict[str, Any] = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_completion_length=8,
                                  max_steps=2)
MAX_BATCHED_TOKENS = 4096  # TRL fixes vLLM's max_num_batched_tokens at 4096
TARGETS = {"full": 1.5, "topk": 2.0}
MIXED_MEDIAN = {"gpu": 64, "smoke": 3}  # --lengths mixed: the student's median completion (of 256; --smoke: of 8)
LENGTHS = (256, 512, 1024)  # the memory sweep's sequence lengths
SIDES = ("trl", "full", "topk", "memory")  # the default run; trl-gkd and served with --only
LABELS = {"trl": "TRL DistillationTrainer (vLLM)", "trl-gkd": "TRL GKDTrainer (generate)",
          "full": "rlcore teacher_colocated.yaml, full", "topk": "rlcore teacher_colocated.yaml, top-64",
          "served": "rlcore teacher_standalone.yaml, top-64",
          "trl-liger": "TRL + use_liger_kernel (student)", "full-liger": "rlcore full vocab + liger (both)",
          "trl-compile": "TRL + torch_compile (student)", "full-compile": "rlcore full vocab + compile (both)",
          "topk-compile": "rlcore top-64 + compile (both)"}
EXTRA = ("trl-gkd", "served", "trl-liger", "full-liger", "trl-compile", "full-compile", "topk-compile")  # with --only
TRL_SIDES = ("trl", "trl-liger", "trl-compile")  # the ratio's base: the fastest of these that ran
PROMPTS = ["Write a short story about a robot.", "Explain why the sky is blue.", "List three prime numbers.",
           "What is the capital of France?", "Describe a sunset.", "Give me a recipe for bread.",
           "How do airplanes fly?", "Summarise the water cycle."]


def dataset_file(root: Path) -> Path:
    """512 chat rows: rlcore reads `messages` (the user turn is the prompt), TRL's DistillationTrainer `prompt`."""
    path = root / "prompts.jsonl"
    rows = []
    for i in range(512):
        user = {"role": "user", "content": PROMPTS[i % len(PROMPTS)]}
        rows.append({"messages": [user, {"role": "assistant", "content": "An answer."}], "prompt": [user]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def torch_peaks() -> dict[str, float | None]:
    """torch's peak allocation and peak reservation (its cached blocks too) in this process, GiB: the reserved
    peak tells a device peak above the other side's from the allocator's caching or from outside torch."""
    import torch

    if not torch.cuda.is_available():
        return {"torch_peak_gib": None, "torch_reserved_gib": None}
    return {"torch_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "torch_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


# -- the runs, each in its own process ------------------------------------------------------------


EXAMPLES = {"served": "gkd/teacher_standalone.yaml"}  # every other rlcore side: gkd/teacher_colocated.yaml
# rlcore's own keys of each side on top of its example (listed in the table); the shared ones are `shared_keys`'
OWN: dict[str, dict[str, Any]] = {
    "full": {}, "topk": {"gkd_logits_topk": 64}, "served": {},
    "full-liger": {"train.engine_kwargs.liger_kernel": True},  # liger's RMSNorm, SwiGLU, rotary: student and teacher
    "full-compile": {"train.engine_kwargs.torch_compile": True},  # each decoder layer compiled in place
    "topk-compile": {"gkd_logits_topk": 64, "train.engine_kwargs.torch_compile": True},
}
SMOKE_CPU = {"rollout.engine": "hf", "teacher.engine": "hf"}  # --smoke's rlcore run: no vLLM on the CPU


def example_of(what: str) -> str:
    return EXAMPLES.get(what, "gkd/teacher_colocated.yaml")


def shared_keys(what: str, student: str, teacher: str, data: str, smoke: bool) -> dict[str, Any]:
    """The keys set on rlcore's example and given to TRL alike: the models, the data, the batch, the lengths, the
    steps, and lmbda 1 (TRL's DistillationTrainer is on-policy only)."""
    teacher_key = "teacher.model" if what == "served" else "teacher_model"
    work = SMOKE_WORK if smoke else WORK
    return {"model": student, teacher_key: teacher, "dataset": data, "lmbda": 1.0, **work}


def rlcore_keys(what: str, student: str, teacher: str, data: str, out: Path,
                gpu: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(shared, scaling, own) keys of an rlcore side: the GPU run's (`gpu`), or --smoke's run on the CPU."""
    example = example_of(what)
    shared = shared_keys(what, student, teacher, data, smoke=not gpu)
    scale = {**scaled(example, 1 if gpu else 0), "output_dir": str(out)}
    own = {**OWN[what], **({} if gpu else {k: v for k, v in SMOKE_CPU.items() if what == "served" or "rollout" in k})}
    if not gpu:  # the CPU has no compiler toolchain to count on, nor liger's Triton kernels
        own = {k: v for k, v in own.items() if not k.startswith("train.engine_kwargs.")}
    return shared, scale, own


def flat(parts: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return {k: v for part in parts for k, v in part.items()}


def rlcore_settings(config: Any, what: str, cuda: bool) -> dict[str, Any]:
    """The settings rlcore's side ran with, read back from its config (`cuda`: on a GPU)."""
    from rlcore.engine_checks import resolve_dtype

    settings = {k: getattr(config, k) for k in ("beta", "lmbda", "temperature", "top_p", "learning_rate",
                                                "lr_scheduler_type", "max_grad_norm", "weight_decay",
                                                "per_device_train_batch_size", "gradient_accumulation_steps",
                                                "max_completion_length", "gkd_logits_topk", "seed", "sleep_level",
                                                "offload_model", "offload_optimizer", "offload_teacher_model")}
    settings.update(gradient_checkpointing=config.train.gradient_checkpointing,
                    dtype=f"{config.train.dtype} -> {resolve_dtype(config.train.dtype, config.model, cuda)}",
                    rollout={k: getattr(config.rollout, k) for k in ("engine", "vllm_gpu_memory_utilization",
                                                                     "vllm_max_model_len", "vllm_engine_kwargs")},
                    teacher="vLLM group on GPU 1" if what == "served" else "colocated in the train worker",
                    chunked_lm_head=config.train.engine_kwargs.get("chunked_lm_head", True),
                    liger_kernel=config.train.engine_kwargs.get("liger_kernel", False),
                    torch_compile=config.train.engine_kwargs.get("torch_compile", False))
    return settings


def peer_of(config: Any) -> dict[str, Any]:
    """TRL's keys given the values rlcore's run resolved: the example's, else rlcore's defaults (vLLM's memory share,
    its sleep between generations, the loss's beta and temperature, the optimizer, the schedule)."""
    peer = {k: getattr(config, k) for k in ("beta", "temperature", "top_p", "learning_rate", "lr_scheduler_type",
                                            "max_grad_norm", "weight_decay", "per_device_train_batch_size",
                                            "gradient_accumulation_steps", "seed", "max_completion_length")}
    peer.update(gradient_checkpointing=config.train.gradient_checkpointing,
                vllm_gpu_memory_utilization=config.rollout.vllm_gpu_memory_utilization,
                vllm_max_model_length=config.rollout.vllm_max_model_len,
                vllm_enable_sleep_mode=config.sleep_level > 0)
    return peer


def run_rlcore(what: str, keys: dict[str, Any], tmp: Path, name: str, profile: bool, env: dict[str, str]) -> dict:
    """An rlcore side, one round: `rlcore run --plugin gkd --use-ray` on its example in a process of its own (`env`
    added to this one's)."""
    profiled = None
    if profile and what != "served":  # the last step's train phase, in the train worker
        site, profiled = profile_env(tmp, name, keys["max_steps"] - 1, ("rlcore.plugins.hf.train", "HFTrainEngine",
                                                                       "train_step"))
        env = {**env, **site}
    run = rlcore_run("gkd", example_of(what), keys, tmp, name, use_ray=True, env=env)
    rows = run["rows"]
    completions = keys["per_device_train_batch_size"] * keys["gradient_accumulation_steps"]
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"step_s": run["step_s"], "tokens": [r["completions/mean_length"] * completions for r in rows],
            "train_s": [r.get("time/train") for r in rows], "completions": completions,
            "phases": {k: [r.get(k, 0.0) for r in rows] for k in phases}, "jsd": [r.get("jsd") for r in rows],
            "setup_s": run["setup_s"], "cmd": run["cmd"], "profile": profiled and read_profile(profiled, "train_step")}


def run_trl(student: str, teacher: str, data: str, out: Path, peer: dict[str, dict[str, Any]], smoke: bool,
            liger: bool = False, compile: bool = False) -> dict:
    """`trl.DistillationTrainer` as TRL documents it for colocated vLLM: `use_vllm=True, vllm_mode="colocate"`.
    `liger`: with transformers' `use_liger_kernel` (the student's RMSNorm, SwiGLU and rotary kernels; its loss
    kernels off, as rlcore's `liger_kernel` has them; TRL's option does not reach the teacher). `compile`: with
    transformers' `torch_compile` (Trainer compiles the whole student; the teacher stays eager). `peer`: TRL's keys
    with the values of rlcore's run, the GPU run's (`gpu`) and this one's (`run`, --smoke's on the CPU)."""
    from datasets import load_dataset
    from fair import train_phase_clock, trainer_clock, trl_args
    from transformers import AutoTokenizer, GenerationConfig
    from trl import DistillationConfig, DistillationTrainer

    clock = trainer_clock("completions/mean_length")
    stop = GenerationConfig.from_pretrained(student).eos_token_id  # same_stop_tokens wrote rlcore's there
    gpu = dict(peer["gpu"], use_vllm=True, vllm_mode="colocate", bf16=True,
               generation_kwargs={"stop_token_ids": stop},  # vLLM stops there, as rlcore asks its engine to
               output_dir=str(out), max_steps=STEPS, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
               optim="adamw_torch",  # rlcore's torch.optim.AdamW
               model_init_kwargs={"dtype": "bfloat16"}, teacher_model_init_kwargs={"dtype": "bfloat16"},
               **({"use_liger_kernel": True, "liger_kernel_config": {"rope": True, "rms_norm": True, "swiglu": True,
                   "cross_entropy": False, "fused_linear_cross_entropy": False}} if liger else {}),
               **({"torch_compile": True} if compile else {}))
    cpu = dict(peer["run"], use_vllm=False, bf16=False, use_cpu=True, generation_kwargs=None, use_liger_kernel=False,
               vllm_enable_sleep_mode=False, max_steps=SMOKE_WORK["max_steps"], torch_compile=False,
               model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"})
    args = trl_args(DistillationConfig, gpu, cpu if smoke else None)
    tokenizer = AutoTokenizer.from_pretrained(student, padding_side="left")
    dataset = load_dataset("json", data_files=data, split="train").remove_columns("messages")
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[clock])
    phase = train_phase_clock(trainer)
    settings = {k: getattr(args, k) for k in peer["gpu"]}
    settings.update(lmbda="1 (on-policy only)", gkd_logits_topk=None, dtype="bfloat16 (model_init_kwargs)",
                    use_liger_kernel=args.use_liger_kernel, torch_compile=args.torch_compile,
                    use_vllm=args.use_vllm, vllm_mode=args.vllm_mode, max_num_seqs=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                    max_num_batched_tokens=MAX_BATCHED_TOKENS,  # TRL's VLLMGeneration fixes it
                    loss="ChunkedDivergenceFunction (trl/kernels/chunked_divergence.py)",
                    optim=getattr(args.optim, "value", str(args.optim)),
                    distributed=str(args.distributed_state.distributed_type))  # RANK/LOCAL_RANK set: DDP of one process
    trainer.train()
    completions = args.per_device_train_batch_size * args.gradient_accumulation_steps
    tokens = [log["completions/mean_length"] * completions for log in clock.logs]
    return {"step_s": clock.step_s(), "tokens": tokens, "settings": settings, "train_s": phase.seconds,
            "completions": completions, **torch_peaks()}


def run_trl_gkd(student: str, teacher: str, data: str, out: Path, peer: dict[str, dict[str, Any]],
                smoke: bool = False) -> dict:
    """TRL's older `GKDTrainer` (`trl.experimental.gkd`), generating with `model.generate`: 2 + SKIP steps."""
    from datasets import load_dataset
    from fair import trainer_clock
    from transformers import AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    clock, counts = trainer_clock(), []
    generate = GKDTrainer.generate_on_policy_outputs

    def counted(model, inputs, generation_config):  # the completion tokens TRL generated
        ids, mask, labels = generate(model, inputs, generation_config)
        counts.append(int((labels != -100).sum()))
        return ids, mask, labels

    GKDTrainer.generate_on_policy_outputs = staticmethod(counted)
    fields = GKDConfig.__dataclass_fields__
    same = {k: v for k, v in peer["run"].items() if k in fields and not k.startswith("vllm_") and k != "max_completion_length"}
    dtype, tokens, device = ("float32", 8, dict(use_cpu=True, bf16=False)) if smoke else ("bfloat16", TOKENS, dict(bf16=True))
    args = GKDConfig(**same, **device, lmbda=1.0, output_dir=str(out), max_steps=SKIP + 2, max_new_tokens=tokens,
                     report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
                     model_init_kwargs={"dtype": dtype}, teacher_model_init_kwargs={"dtype": dtype})
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args,
                         train_dataset=load_dataset("json", data_files=data, split="train").remove_columns("prompt"),
                         processing_class=AutoTokenizer.from_pretrained(student), callbacks=[clock])
    trainer.train()
    accum = args.gradient_accumulation_steps
    per_step = [sum(counts[i * accum : (i + 1) * accum]) for i in range(len(clock.stamps) - 1)]
    settings = {k: getattr(args, k) for k in same}
    settings.update(lmbda=args.lmbda, max_new_tokens=args.max_new_tokens, generation="model.generate")
    return {"step_s": clock.step_s(), "tokens": per_step, "settings": settings, **torch_peaks()}


def run_memory(student: str, teacher: str, beta: float, smoke: bool) -> dict:
    """One micro-batch (MICRO rows x T tokens, the last half completion) through the GKD loss, forward and
    backward, with the chunked LM-head path and with the [B, T, V] logits path: torch's peak allocation above
    the engines' own memory, per T. The chunked path's peak grows with B x T x hidden, the logits path's with
    B x T x V."""
    import functools
    import gc

    import torch

    from rlcore import Batch, OptimizerOptions
    from rlcore.plugins.gkd.objective import DistillObjective
    from rlcore.plugins.gkd.workers import teacher_answer
    from rlcore.plugins.hf.train import HFTrainEngine

    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    lengths, rows = ((16, 32), 2) if smoke else (LENGTHS, MICRO)
    out: dict[str, Any] = {"lengths": list(lengths), "rows": rows}
    for chunked in (True, False):
        engine = HFTrainEngine(student, dtype=dtype, device=device, chunked_lm_head=chunked,
                               optimizer=OptimizerOptions(learning_rate=1e-6))
        teach = HFTrainEngine(teacher, dtype=dtype, device=device, chunked_lm_head=chunked, forward_only=True)
        vocab = engine.model.get_output_embeddings().weight.shape[0]
        peaks, seconds = [], []
        for i, T in enumerate((lengths[0], *lengths)):  # the first, unmeasured, allocates AdamW's state
            ids = torch.randint(0, vocab, (rows, T), generator=torch.Generator().manual_seed(T))
            mask = torch.zeros(rows, T, dtype=torch.long)
            mask[:, T // 2:] = 1
            batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=mask)
            objective = DistillObjective(beta=beta, temperature=1.0, topk=None,
                                         num_items_in_batch=float(mask.sum()))

            def teacher_fn(micro, k, temperature, teach=teach):
                return teacher_answer(teach, micro, k, temperature)

            loss_fn = functools.partial(objective, teacher=teacher_fn)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            engine.train_step(batch, loss_fn, micro_batch_size=rows)
            if i == 0:
                continue
            if device == "cuda":
                torch.cuda.synchronize()
                peaks.append(round((torch.cuda.max_memory_allocated() - base) / 2**30, 3))
            seconds.append(round(time.perf_counter() - start, 3))
        out["chunked" if chunked else "logits"] = {"peak_gib_above_engines": peaks, "step_s": seconds}
        del engine, teach, teacher_fn, loss_fn
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    out["bTV_fp32_gib"] = [round(rows * T * VOCAB * 4 / 2**30, 3) for T in lengths]
    return out


def run_build(root: Path, smoke: bool) -> None:
    """The two random models, drawn on the GPU (seconds; the CPU takes minutes for the 1.5B shape)."""
    from fair import same_stop_tokens

    from rlcore.testing import build_tiny_model

    device = "cpu" if smoke else "cuda"
    student = build_tiny_model(root / "student", device=device, **(SMOKE_STUDENT if smoke else STUDENT))
    build_tiny_model(root / "teacher", device=device, **(SMOKE_TEACHER if smoke else TEACHER))
    same_stop_tokens(str(student))
    if os.environ.get("RLCORE_BENCH_LENGTHS") == "mixed":  # the student's completions: long-tailed lengths
        from fair import nudge_to_stop

        limit = (SMOKE_WORK if smoke else WORK)["max_completion_length"]
        estimate = nudge_to_stop(str(student), MIXED_MEDIAN["smoke" if smoke else "gpu"], limit, device)
        (root / "lengths.json").write_text(json.dumps(estimate))


# -- the driver ---------------------------------------------------------------------------------------


class PeakMemory:
    """The highest device-wide GPU memory in use (GiB, every visible GPU summed, as nvidia-smi reports it: what
    megatron_gpu.py measured on the H200) above what was in use at the start, sampled every 0.2 s while it
    runs; 0 without nvidia-smi."""

    def __init__(self) -> None:
        self.peak, self.done = 0.0, threading.Event()
        self.gpus = [int(i) for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.strip().isdigit()]
        self.base = self.used()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def used(self) -> float:
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return 0.0
        total = 0.0
        for line in done.stdout.splitlines():
            index, used = (int(x) for x in line.split(","))
            if not self.gpus or index in self.gpus:
                total += used / 1024
        return total

    def sample(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, self.used() - self.base)

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def child(what: str, tmp: Path, data: Path | None = None, smoke: bool = False, name: str | None = None,
          keys: dict[str, Any] | None = None, profile: bool = False) -> dict | None:
    """Run one side (or the model build) in a process of its own: an rlcore side through `rlcore run` with its
    `keys`, the others as this script's child; its result (and peak memory) or None."""
    name = name or what
    out = tmp / f"{name}.json"
    cmd = [sys.executable, __file__, "--run", what, "--tmp", str(tmp), "--out", str(out)] + (["--smoke"] if smoke else [])
    if data is not None:
        cmd += ["--data", str(data)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}  # a world of one, as TRL documents colocated vLLM in one process (grpo_gpu.py's too)
    gpus = {} if what == "served" else {"CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    started = time.perf_counter()
    with PeakMemory() as memory:
        if what in OWN:
            result = run_rlcore(what, keys or {}, tmp, name, profile, gpus)
        else:
            run_child(cmd, {**env, **gpus})
            result = None if what == "build" else json.loads(out.read_text())
    if result is None:
        return None
    result["peak_gpu_gib"] = round(memory.peak, 2)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def summarise(result: dict, skip: int) -> dict:
    if "lengths" in result:  # the memory sweep
        return result
    if result.get("profile"):  # the profiled last step is not measured
        result["step_s"], result["tokens"] = result["step_s"][:-1], result["tokens"][:-1]
        result["phases"] = {k: v[:-1] for k, v in result.get("phases", {}).items()}
    steps, tokens = result["step_s"][skip:], result["tokens"][skip:]
    step = statistics.median(steps)
    out = {"step_s": round(step, 3), "tokens_per_s": round(statistics.median(tokens) / step, 1),
           "peak_gpu_gib": result["peak_gpu_gib"], "torch_peak_gib": result.get("torch_peak_gib"),
           "torch_reserved_gib": result.get("torch_reserved_gib"),
           "steps_measured": len(steps), "wall_s": result["wall_s"], "settings": result.get("settings", {}),
           "per_step_s": [round(s, 3) for s in result["step_s"]]}
    out.update({k: result[k] for k in ("setup_s", "cmd") if k in result})
    out.update(train_phase(result, skip))
    if result.get("phases"):
        out["phases_s"] = {k.removeprefix("time/"): round(statistics.median(v[skip:]), 3) for k, v in result["phases"].items()}
    if result.get("profile"):
        out["profile"] = result["profile"]
    return out


def train_phase(result: dict, skip: int) -> dict[str, Any]:
    """The train phase's median seconds, trained tokens per second (prompt and completion tokens, no padding) and
    model-FLOP utilisation: the student's forward and backward and the teacher's forward (`WORK_INFO`)."""
    seconds = [s for s in (result.get("train_s") or [])[skip:] if s]
    tokens = [t for t in result["tokens"][skip:] if t == t]
    if not seconds or not tokens or not WORK_INFO:
        return {}
    step, completions = statistics.median(seconds), result["completions"]
    mean, prompt = statistics.median(tokens) / completions, WORK_INFO["prompt_tokens"]
    context = (prompt + mean) / 2
    flops = (train_flops_per_token(WORK_INFO["student"], context)
             + train_flops_per_token(WORK_INFO["teacher"], context, forward_only=True))
    trained = completions * (prompt + mean)
    return {"train_s": round(step, 4), "train_tokens_per_s": round(trained / step, 1),
            "train_mfu": round(mfu(trained, flops, step), 4)}


def print_table(sides: dict[str, dict], met: dict[str, bool], ratios: dict[str, dict]) -> None:
    print("\nx TRL: each round's tokens/s over the fastest TRL side of that round (TRL configured as well as it can be); "
          "the median of the rounds, then its range")
    print(f"\n{'':<38}{'step (s)':>10}{'tokens/s':>11}{'peak GiB':>10}{'torch GiB':>11}{'reserved':>10}{'x TRL':>8}  target")
    for what, side in sides.items():
        if "failed" in side:
            print(f"{LABELS.get(what, what):<38}FAILED: {side['failed']}")
            continue
        if what == "memory":
            continue
        ratio = ratios.get(what, {}).get("median", float("nan"))
        target = ""
        kind = target_of(what)
        if kind:
            extra = " & peak <= TRL's" if kind == "full" else ""
            target = f">= {TARGETS[kind]:g}x{extra}: {'met' if met.get(what) else 'NOT met'}" if what in ratios else \
                f">= {TARGETS[kind]:g}x"
        torch_gib, reserved = (side.get(k) for k in ("torch_peak_gib", "torch_reserved_gib"))
        print(f"{LABELS[what]:<38}{side['step_s']:>10.2f}{side['tokens_per_s']:>11.0f}{side['peak_gpu_gib']:>10.2f}"
              f"{(torch_gib if torch_gib is not None else float('nan')):>11.2f}"
              f"{(reserved if reserved is not None else float('nan')):>10.2f}{ratio:>8.2f}  {target}")
        if what in ratios:
            print(f"{'':<38}x TRL by round: {spread_text(ratios[what])}")
        if len(side.get("rounds", [])) > 1:
            print(f"{'':<38}step by round: " + ", ".join(f"{r['step_s']:.2f}" if "step_s" in r else "failed"
                                                        for r in side["rounds"]))
        if side.get("phases_s"):
            print(f"{'':<38}phases: " + ", ".join(f"{k} {v:.3f}" for k, v in side["phases_s"].items()))
        if "train_s" in side:
            print(f"{'':<38}train phase: {side['train_s']:.3f} s, {side['train_tokens_per_s']:.0f} trained tokens/s, "
                  f"MFU {side['train_mfu']:.1%} of the H200's dense bf16 peak")
    if LENGTHS_ESTIMATE:
        est = LENGTHS_ESTIMATE
        print(f"lengths: mixed, estimated p10 {est['p10']}, median {est['median_tokens']}, p90 {est['p90']}, "
              f"{est['reach_limit']:.0%} reach {est['limit']}")
    for what, side in sides.items():
        if side.get("profile"):
            print(f"\n{LABELS[what]}: the last train phase under torch's profiler ({side['profile']['seconds']:.3f} s):\n"
                  f"{side['profile']['table']}")
    if "lengths" in sides.get("memory", {}):
        mem = sides["memory"]
        print(f"\nloss forward+backward of {mem['rows']} rows, torch peak above the engines (GiB):")
        print(f"{'T':>6}{'chunked':>10}{'logits':>10}{'B*T*V fp32':>12}{'chunked/logits':>16}")
        for i, T in enumerate(mem["lengths"]):
            c, f = mem["chunked"]["peak_gib_above_engines"], mem["logits"]["peak_gib_above_engines"]
            if c and f:
                print(f"{T:>6}{c[i]:>10.2f}{f[i]:>10.2f}{mem['bTV_fp32_gib'][i]:>12.2f}{c[i] / f[i]:>16.3f}")


def trl_base(sides: dict[str, dict]) -> str | None:
    """The fastest TRL side that ran (TRL configured as well as it can be): the ratios' base."""
    ran = [what for what in TRL_SIDES if "tokens_per_s" in sides.get(what, {})]
    return max(ran, key=lambda what: sides[what]["tokens_per_s"]) if ran else None


def target_of(what: str) -> str | None:
    """The target an rlcore side is held to: `full` for full*, `topk` for topk*."""
    return next((kind for kind in TARGETS if what == kind or what.startswith(f"{kind}-")), None)


def round_ratios(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Each rlcore side's tokens/s over the fastest TRL side of the same round, per round: their median and range."""
    per: dict[str, list[float]] = {}
    for done in rounds:
        base = trl_base(done)
        for what, row in done.items():
            if base and what not in TRL_SIDES and "tokens_per_s" in row:
                per.setdefault(what, []).append(row["tokens_per_s"] / done[base]["tokens_per_s"])
    return {what: spread(values) for what, values in per.items()}


def targets_met(sides: dict[str, dict], ratios: dict[str, dict]) -> dict[str, bool]:
    """A side meets its target by its median ratio over the rounds (and, full*, its median peak memory)."""
    base = trl_base(sides)
    met = {}
    for what, ratio in ratios.items():
        kind = target_of(what)
        if kind:
            met[what] = ratio["median"] >= TARGETS[kind]
            if kind == "full" and base:
                met[what] = met[what] and sides[what]["peak_gpu_gib"] <= sides[base]["peak_gpu_gib"]
    return met


def over_rounds(rows: list[dict]) -> dict:
    """A side's row over its rounds: the medians of step, tokens/s and peak memory, the last round's details, and
    each round's row."""
    done = [r for r in rows if "step_s" in r]
    if not done:
        return {**rows[-1], "rounds": rows} if len(rows) > 1 else rows[-1]
    med = {k: statistics.median(r[k] for r in done) for k in ("step_s", "tokens_per_s", "peak_gpu_gib")}
    med.update({k: statistics.median(r[k] for r in done if k in r) for k in ("train_s", "train_tokens_per_s", "train_mfu")
                if any(k in r for r in done)})
    return {**done[-1], **{k: round(v, 3) for k, v in med.items()}, "rounds": rows}


ONCE = ("memory", "trl-gkd")  # not timed against TRL: run once, after the rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/gkd_gpu-<date>-<kind>.json)")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    choices = [*SIDES, *EXTRA]
    parser.add_argument("--only", choices=choices, action="append", help="run this side (repeatable)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the timed sides, interleaved (default 2)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, no vLLM, 2 steps: the code paths only")
    parser.add_argument("--profile", action="store_true", help="profile rlcore's last train phase (not measured)")
    parser.add_argument("--lengths", choices=["fixed", "mixed"], default="fixed",
                        help="fixed: the random student's completions run to the limit; mixed: it is nudged to stop")
    parser.add_argument("--merge", action="append", default=[], metavar="JSON",
                        help="an earlier call's results (repeatable): its sides are kept beside this run's (later ones "
                        "win); with no --only nothing runs: the merged table, targets and JSON only")
    parser.add_argument("--run", choices=[*choices, "build"], help=argparse.SUPPRESS)
    for flag in ("--tmp", "--data", "--out"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:  # a child: one run, results to --out
        tmp = Path(args.tmp)
        student, teacher = str(tmp / "student"), str(tmp / "teacher")
        if args.run == "build":
            return run_build(tmp, args.smoke)
        peer = json.loads((tmp / "peer.json").read_text())
        if args.run in TRL_SIDES:
            result = run_trl(student, teacher, args.data, tmp / f"out-{args.run}", peer, args.smoke,
                             liger=args.run == "trl-liger", compile=args.run == "trl-compile")
        elif args.run == "trl-gkd":
            result = run_trl_gkd(student, teacher, args.data, tmp / "out-trl-gkd", peer, args.smoke)
        else:
            result = run_memory(student, teacher, peer["run"]["beta"], args.smoke)
        Path(args.out).write_text(json.dumps(result, default=str))
        return

    if args.only or not args.merge:  # a merge alone runs nothing here: its sides' machine is not this one
        HOST.update(host_info())
    if args.profile:
        os.environ["RLCORE_BENCH_PROFILE"] = "1"  # the children read it
    os.environ["RLCORE_BENCH_LENGTHS"] = args.lengths  # the build child reads it
    wanted = list(dict.fromkeys(args.only or ([] if args.merge else list(SIDES))))
    started = time.perf_counter()
    stem = "gkd_gpu-mixed" if args.lengths == "mixed" else "gkd_gpu"
    path = results_path(args.json, f"{stem}-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    kept: dict[str, dict] = {}  # sides run in calls of their own (--only, --merge) add up in one file
    for earlier in [path] * bool(args.only and path.exists()) + [Path(m) for m in args.merge]:
        old = json.loads(earlier.read_text())
        kept.update(old.get("sides", {}))
        RATIOS.update(old.get("ratios", {}))
        RUNS.update(old.get("rlcore_runs", {}))
    sides: dict[str, dict] = {}
    if not wanted:
        write_json(path, record(kept, args, started))
    timed, rounds = [w for w in wanted if w not in ONCE], []
    order = interleave(timed, args.rounds) + [(0, w) for w in wanted if w in ONCE]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if wanted:
            child("build", tmp, smoke=args.smoke)
            data = dataset_file(tmp)
            WORK_INFO.update(student=str(tmp / "student"), teacher=str(tmp / "teacher"),
                             prompt_tokens=prompt_tokens(str(tmp / "student"), [[{"role": "user", "content": p}]
                                                                                 for p in PROMPTS]))
            if (tmp / "lengths.json").exists():
                LENGTHS_ESTIMATE.update(json.loads((tmp / "lengths.json").read_text()))
            keys = prepare(wanted, tmp, str(data), args.smoke)
        per_side: dict[str, list[dict]] = {}
        for index, what in order:
            name = f"{what}-{index + 1}"
            try:
                run = {**keys[what], "output_dir": str(tmp / f"out-{name}")} if what in keys else None  # fresh each round
                row = summarise(child(what, tmp, data, args.smoke, name, run, args.profile), 0 if args.smoke else SKIP)
            except Exception as error:  # noqa: BLE001 - the other sides still run; the child's log says why
                row = failure(error)
            if what in RUNS and "failed" not in row:  # rlcore's settings: those of the config it ran with
                row["settings"] = RUNS[what]["settings"]
            row["commit"] = git_commit()
            print(json.dumps({what: row}, default=str))
            if what in timed:
                while len(rounds) <= index:
                    rounds.append({})
                rounds[index][what] = row
            per_side.setdefault(what, []).append(row)
            sides[what] = over_rounds(per_side[what])
            RATIOS.update(round_ratios(rounds))
            write_json(path, record({**kept, **sides}, args, started))
    everything = {**kept, **sides}
    print_table(everything, targets_met(everything, RATIOS), RATIOS)
    print_runs()
    print(f"wrote {path}")
    if any("failed" in side for side in sides.values()):
        raise SystemExit(f"failed: {', '.join(k for k, v in sides.items() if 'failed' in v)}")


def prepare(wanted: list[str], tmp: Path, data: str, smoke: bool) -> dict[str, dict[str, Any]]:
    """Each rlcore side's keys (its GPU config loaded and checked on this machine first, as `rlcore config validate`
    does, also under --smoke) and TRL's peer values (peer.json): those of teacher_colocated.yaml with the shared
    keys, as a user's rlcore run resolves them."""
    student, teacher = str(tmp / "student"), str(tmp / "teacher")
    keys: dict[str, dict[str, Any]] = {}
    peer: dict[str, dict[str, Any]] = {}
    for what in dict.fromkeys([*[w for w in wanted if w in OWN], "full"]):
        gpu = rlcore_keys(what, student, teacher, data, tmp / f"out-{what}", gpu=True)
        gpu_config = user_config("gkd", example_of(what), flat(gpu))
        run = rlcore_keys(what, student, teacher, data, tmp / f"out-{what}", gpu=not smoke)
        config = user_config("gkd", example_of(what), flat(run)) if smoke else gpu_config
        if what == "full":
            peer = {"gpu": peer_of(gpu_config), "run": peer_of(config)}
        if what in wanted:
            keys[what] = flat(run)
            RUNS[what] = {**provenance(example_of(what), *run), "settings": rlcore_settings(config, what, not smoke)}
    (tmp / "peer.json").write_text(json.dumps(peer))
    return keys


def print_runs() -> None:
    """Each rlcore side's example and the keys set on it."""
    print_provenance({"rlcore_runs": {LABELS.get(what, what): run for what, run in RUNS.items()}})


HOST: dict[str, Any] = {}  # host_info() of the machine this call's sides ran on, measured once in main()
RUNS: dict[str, dict[str, Any]] = {}  # each rlcore side's example, keys and settings
RATIOS: dict[str, dict[str, Any]] = {}  # each rlcore side's x TRL per round, median and range
WORK_INFO: dict[str, Any] = {}  # the models and the mean prompt length, for the train phase's MFU
LENGTHS_ESTIMATE: dict[str, Any] = {}  # --lengths mixed: nudge_to_stop's estimate of the completion lengths


def record(sides: dict[str, dict], args: argparse.Namespace, started: float) -> dict:
    """The results JSON: every side's row (settings and commit included), each rlcore side's example and keys, the
    per-round ratios, the targets and which were met."""
    return {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "smoke": args.smoke,
            "host": HOST, "rounds": args.rounds,
            "sides": sides, "labels": {k: v for k, v in LABELS.items() if k in sides},
            "rlcore_runs": RUNS, "ratios": RATIOS, "lengths": LENGTHS_ESTIMATE or "fixed",
            "targets": {"full": "median over the rounds of tokens/s / the round's fastest TRL side's >= 1.5, peak GPU "
                                "memory <= its peak", "topk": "the same median >= 2"},
            "targets_base": trl_base(sides), "met": targets_met(sides, RATIOS),
            "wall_s": round(time.perf_counter() - started, 1),
            "work": f"{MICRO * ACCUM} completions x {TOKENS} tokens a step, lmbda 1, vocabulary {VOCAB}, "
                    f"student Qwen2-0.5B shape, teacher Qwen2-1.5B shape, bf16 checkpoints, median of steps "
                    f"{SKIP + 1}-{STEPS}; rlcore: the example's other settings (dtype auto, sleep, offloading, beta, "
                    f"vLLM's memory share), given to TRL where it has them"}

if __name__ == "__main__":
    main()
