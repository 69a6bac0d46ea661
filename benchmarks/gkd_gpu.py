"""GKD on one GPU, side by side: rlcore against TRL 1.16's `DistillationTrainer` (vLLM colocate, chunked loss).

The same work on every side: a random Qwen2-0.5B-shaped student (hidden 896, 24 layers) distils a random
Qwen2-1.5B-shaped teacher (hidden 1536, 28 layers), vocabulary 151,936 (Qwen2's), bf16; every step on-policy
(lmbda 1: `DistillationTrainer` is on-policy only), 64 completions of up to 256 tokens a step (8 per
micro-batch x 8 accumulation steps), beta 0.5, temperature 1, gradient checkpointing off, vLLM colocated at
0.3 of the GPU with `max_num_seqs` 64, `max_num_batched_tokens` 4096 (TRL's fixed value) and no sleep mode. Each
run in a process of its own:

- `trl`: `trl.DistillationTrainer` (`use_vllm=True`, `vllm_mode="colocate"`; its loss is always the chunked
  `ChunkedDivergenceFunction` over hidden states and LM heads), teacher on the same GPU;
- `full`: rlcore, one process, no Ray: vLLM rollout awake beside the train engine, the teacher colocated in the
  train worker, the full vocabulary through the chunked LM-head loss;
- `topk`: the same, with `gkd_logits_topk: 64` (the teacher colocated, its top-64 taken in chunks of positions);
- `memory`: no trainer: one micro-batch's loss forward + backward at T = 256, 512, 1024 with the engines'
  chunked LM-head path and with the [B, T, V] logits path (`chunked_lm_head=False`), torch's peak allocation;
- `trl-gkd` (only with `--only`): TRL's older `GKDTrainer` with `model.generate` (2 steps: it is slow);
- `served` (only with `--only`, two GPUs): rlcore on Ray, the teacher a vLLM group on GPU 1 serving top-64;
- `full-liger` and `trl-liger` (only with `--only`): `full` with the hf engine's `liger_kernel` (liger-kernel's
  RMSNorm, SwiGLU and rotary kernels in the student and the teacher) and TRL with `use_liger_kernel` (the same
  kernels, the student's only: TRL's option does not reach the teacher); the liger-kernel wheel must be installed;
- `full-compile`, `topk-compile` and `trl-compile` (only with `--only`): `full` and `topk` with the hf engine's
  `torch_compile` (each decoder layer of the student and the teacher compiled in place, inductor, dynamic
  shapes) and TRL with transformers' `torch_compile` (`torch.compile` of the whole student, as Trainer does it).

    python benchmarks/gkd_gpu.py                  # trl, full, topk, memory: about 6 minutes on one H200
    python benchmarks/gkd_gpu.py --only trl --only full; python benchmarks/gkd_gpu.py --only topk --only memory
                                                  # the same in two calls of about 4 and 2.5 minutes
    python benchmarks/gkd_gpu.py --only full      # one side; sides run in separate calls add up in the JSON
    python benchmarks/gkd_gpu.py --merge a.json --merge b.json --json c.json   # two calls' JSONs (each machine
                                                  # starts bare) as one table and one JSON, with the targets; no run
    python benchmarks/gkd_gpu.py --smoke          # tiny models on the CPU, no vLLM: the code paths only (TRL's
                                                  # and rlcore's GPU configs are built there too)
    python benchmarks/gkd_gpu.py --only full --profile   # + torch's profile of rlcore's last train phase

The table gives each side's median step time (steps 3-10), completion tokens per second, the peak GPU memory
(device-wide, sampled every 0.2 s while the run's process lives, above what was in use before it), torch's
peak allocation and peak reservation in the run's process, and the ratio to the fastest TRL side that ran (`trl`, `trl-liger`, `trl-compile`: TRL configured as well as it
can be); targets, for each rlcore side of that kind (`full*`, `topk*`): full >= 1.5x with peak <= that TRL side's,
topk >= 2x. `--json PATH` (default benchmarks/results/gkd_gpu-<date>-<kind>.json;
with --smoke, the temporary folder) keeps every side's settings, the git commit (`RLCORE_COMMIT` where set) and the
targets met, written after every side; a side that fails is recorded as such and the others still run.
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

from fair import failure, free_port, git_commit, host_info, results_path, run_child, write_json

MICRO, ACCUM, TOKENS, STEPS, SKIP = 8, 8, 256, 10, 2
VOCAB = 151936
STUDENT = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
               vocab_size=VOCAB, max_position_embeddings=2048, dtype="bfloat16")
TEACHER = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
               vocab_size=VOCAB, max_position_embeddings=2048, dtype="bfloat16", seed=1)
SMOKE_STUDENT = dict(hidden_size=64, num_layers=2, vocab_size=1024, max_position_embeddings=512)
SMOKE_TEACHER = dict(hidden_size=96, num_layers=2, vocab_size=1024, max_position_embeddings=512, seed=1)
SAME: dict[str, Any] = dict(beta=0.5, temperature=1.0, learning_rate=1e-6, per_device_train_batch_size=MICRO,
                            gradient_accumulation_steps=ACCUM, seed=42, max_completion_length=TOKENS,
                            lr_scheduler_type="constant", max_grad_norm=1.0, weight_decay=0.0)
GPU_MEMORY, MAX_MODEL_LEN, MAX_BATCHED_TOKENS = 0.3, 1024, 4096  # TRL fixes max_num_batched_tokens at 4096
TARGETS = {"full": 1.5, "topk": 2.0}
LENGTHS = (256, 512, 1024)  # the memory sweep's sequence lengths
SIDES = ("trl", "full", "topk", "memory")  # the default run; trl-gkd and served with --only
LABELS = {"trl": "TRL DistillationTrainer (vLLM)", "trl-gkd": "TRL GKDTrainer (generate)",
          "full": "rlcore colocated, full vocab", "topk": "rlcore colocated, top-64",
          "served": "rlcore vLLM teacher (GPU 1), top-64",
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


def run_rlcore(student: str, teacher: str, data: str, out: Path, what: str, smoke: bool) -> dict:
    from fair import StepClock

    from rlcore import load_plugins
    from rlcore.plugins.gkd.config import GKDConfig
    from rlcore.plugins.gkd.trainer import GKDTrainer

    clock = StepClock()
    plugins = load_plugins()
    plugins.register(clock, "clock")
    steps = 2 if smoke else STEPS
    rollout: dict[str, Any] = {
        "engine": "vllm", "gpus": 1, "dtype": "bfloat16", "vllm_gpu_memory_utilization": GPU_MEMORY,
        "vllm_max_model_len": MAX_MODEL_LEN, "engine_kwargs": {"vllm_enable_sleep_mode": False},  # as TRL's, no sleep mode
        "vllm_engine_kwargs": {"max_num_seqs": MICRO * ACCUM, "max_num_batched_tokens": MAX_BATCHED_TOKENS}}
    train: dict[str, Any] = {"gpus": 1, "dtype": "bfloat16", "gradient_checkpointing": False}
    if what == "full-liger":  # liger-kernel's RMSNorm, SwiGLU and rotary kernels in the student and the teacher
        train["engine_kwargs"] = {"liger_kernel": True}
    if what.endswith("-compile"):  # each decoder layer of the student and the teacher compiled in place
        train["engine_kwargs"] = {"torch_compile": True}
    common = dict(SAME, lmbda=1.0, model=student, dataset=data, output_dir=str(out), max_steps=steps, save_steps=100_000,
                  eval_size=0, colocate_groups=[["train", "rollout"]])

    def gkd_config(rollout: dict[str, Any], train: dict[str, Any], **extra: Any) -> GKDConfig:
        keys = {**common, "train": train, "rollout": rollout, **extra}
        if what == "served":  # Ray: train and rollout share GPU 0, the teacher serves its top-64 from GPU 1
            return GKDConfig(**keys, gkd_logits_topk=64, offload_model=False, offload_optimizer=False,
                             teacher={**rollout, "model": teacher, "vllm_gpu_memory_utilization": 0.8})
        # one process: vLLM awake throughout (no sleep), the teacher inside the train worker
        return GKDConfig(**keys, teacher_model=teacher, sleep_level=0, gkd_logits_topk=64 if what.startswith("topk") else None)

    config = gkd_config(rollout, train)  # the GPU run's config, validated on the CPU too under --smoke
    if smoke:  # the CPU: the hf rollout engine, float32, no GPUs to share
        rollout, train = {"engine": "hf", "dtype": "float32"}, {**{k: v for k, v in train.items() if k != "gpus"}, "dtype": "float32"}
        config = gkd_config(rollout, train, colocate_groups=[], per_device_train_batch_size=2,
                            gradient_accumulation_steps=2, max_completion_length=8)
    trainer = GKDTrainer(config, plugins, use_ray=what == "served")
    profile: dict[str, Any] = {}
    if os.environ.get("RLCORE_BENCH_PROFILE") and what != "served":  # the last step's train phase, profiled
        from fair import profile_nth_call

        from rlcore.plugins.hf.train import HFTrainEngine

        profile_nth_call(HFTrainEngine, "train_step", steps - 1, profile)
    settings = {k: getattr(config, k) for k in ("beta", "lmbda", "temperature", "learning_rate", "lr_scheduler_type",
                                                "max_grad_norm", "weight_decay", "per_device_train_batch_size",
                                                "gradient_accumulation_steps", "max_completion_length", "gkd_logits_topk",
                                                "seed", "sleep_level")}
    settings.update(gradient_checkpointing=config.train.gradient_checkpointing, rollout=dict(rollout),
                    teacher="vLLM group on GPU 1" if what == "served" else "colocated in the train worker",
                    chunked_lm_head=config.train.engine_kwargs.get("chunked_lm_head", True),
                    liger_kernel=config.train.engine_kwargs.get("liger_kernel", False),
                    torch_compile=config.train.engine_kwargs.get("torch_compile", False))
    clock.start()
    trainer.fit()
    rows = clock.rows
    completions = config.per_device_train_batch_size * config.gradient_accumulation_steps
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {"step_s": clock.step_s(), "tokens": [r["completions/mean_length"] * completions for r in rows],
            "phases": {k: [r.get(k, 0.0) for r in rows] for k in phases}, "jsd": [r["jsd"] for r in rows],
            "settings": settings, **torch_peaks(), "profile": profile}


def run_trl(student: str, teacher: str, data: str, out: Path, smoke: bool, liger: bool = False,
            compile: bool = False) -> dict:
    """`trl.DistillationTrainer` as TRL documents it for colocated vLLM: `use_vllm=True, vllm_mode="colocate"`.
    `liger`: with transformers' `use_liger_kernel` (the student's RMSNorm, SwiGLU and rotary kernels; its loss
    kernels off, as rlcore's `liger_kernel` has them; TRL's option does not reach the teacher). `compile`: with
    transformers' `torch_compile` (Trainer compiles the whole student; the teacher stays eager)."""
    from datasets import load_dataset
    from fair import trainer_clock, trl_args
    from transformers import AutoTokenizer, GenerationConfig
    from trl import DistillationConfig, DistillationTrainer

    clock = trainer_clock("completions/mean_length")
    stop = GenerationConfig.from_pretrained(student).eos_token_id  # same_stop_tokens wrote rlcore's there
    gpu = dict(SAME, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=GPU_MEMORY,
               vllm_max_model_length=MAX_MODEL_LEN, vllm_enable_sleep_mode=False, bf16=True,
               generation_kwargs={"stop_token_ids": stop},  # vLLM stops there, as rlcore asks its engine to
               output_dir=str(out), max_steps=STEPS, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
               gradient_checkpointing=False, optim="adamw_torch",  # rlcore's torch.optim.AdamW
               model_init_kwargs={"dtype": "bfloat16"}, teacher_model_init_kwargs={"dtype": "bfloat16"},
               **({"use_liger_kernel": True, "liger_kernel_config": {"rope": True, "rms_norm": True, "swiglu": True,
                   "cross_entropy": False, "fused_linear_cross_entropy": False}} if liger else {}),
               **({"torch_compile": True} if compile else {}))
    cpu = dict(use_vllm=False, bf16=False, use_cpu=True, generation_kwargs=None, max_steps=2, use_liger_kernel=False,
               per_device_train_batch_size=2, gradient_accumulation_steps=2, max_completion_length=8,
               model_init_kwargs={"dtype": "float32"}, teacher_model_init_kwargs={"dtype": "float32"})
    args = trl_args(DistillationConfig, gpu, cpu if smoke else None)
    tokenizer = AutoTokenizer.from_pretrained(student, padding_side="left")
    dataset = load_dataset("json", data_files=data, split="train").remove_columns("messages")
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[clock])
    settings = {k: getattr(args, k) for k in SAME}
    settings.update(lmbda="1 (on-policy only)", gkd_logits_topk=None, gradient_checkpointing=args.gradient_checkpointing,
                    use_liger_kernel=args.use_liger_kernel, torch_compile=args.torch_compile,
                    use_vllm=args.use_vllm, vllm_mode=args.vllm_mode, vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                    vllm_max_model_length=args.vllm_max_model_length, vllm_enable_sleep_mode=args.vllm_enable_sleep_mode,
                    max_num_seqs=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                    max_num_batched_tokens=MAX_BATCHED_TOKENS,  # TRL's VLLMGeneration fixes it
                    loss="ChunkedDivergenceFunction (trl/kernels/chunked_divergence.py)",
                    optim=getattr(args.optim, "value", str(args.optim)),
                    distributed=str(args.distributed_state.distributed_type))  # RANK/LOCAL_RANK set: DDP of one process
    trainer.train()
    completions = args.per_device_train_batch_size * args.gradient_accumulation_steps
    tokens = [log["completions/mean_length"] * completions for log in clock.logs]
    return {"step_s": clock.step_s(), "tokens": tokens, "settings": settings, **torch_peaks()}


def run_trl_gkd(student: str, teacher: str, data: str, out: Path, smoke: bool = False) -> dict:
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
    same = {k: v for k, v in SAME.items() if k != "max_completion_length"}
    dtype, tokens, device = ("float32", 8, dict(use_cpu=True, bf16=False)) if smoke else ("bfloat16", TOKENS, dict(bf16=True))
    if smoke:
        same.update(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    args = GKDConfig(**same, **device, lmbda=1.0, output_dir=str(out), max_steps=SKIP + 2, max_new_tokens=tokens,
                     report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, gradient_checkpointing=False,
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


def run_memory(student: str, teacher: str, smoke: bool) -> dict:
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
            objective = DistillObjective(beta=SAME["beta"], temperature=1.0, topk=None,
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


def child(what: str, tmp: Path, data: Path | None = None, smoke: bool = False) -> dict | None:
    """Run one side (or the model build) in a process of its own; its result (and peak memory) or None."""
    out = tmp / f"{what}.json"
    cmd = [sys.executable, __file__, "--run", what, "--tmp", str(tmp)] + (["--smoke"] if smoke else [])
    if data is not None:
        cmd += ["--data", str(data)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}  # a world of one, as TRL documents colocated vLLM in one process (grpo_gpu.py's too)
    if what != "served":
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    started = time.perf_counter()
    with PeakMemory() as memory:
        run_child(cmd, env)
    if what == "build":
        return None
    result = json.loads(out.read_text())
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
    if result.get("phases"):
        out["phases_s"] = {k.removeprefix("time/"): round(statistics.median(v[skip:]), 3) for k, v in result["phases"].items()}
    if result.get("profile"):
        out["profile"] = result["profile"]
    return out


def print_table(sides: dict[str, dict], met: dict[str, bool]) -> None:
    base_side = trl_base(sides)  # None where every TRL side is absent or failed
    base = sides[base_side]["tokens_per_s"] if base_side else None
    if base_side:
        print(f"\nx TRL: against {LABELS[base_side]}, the fastest TRL side that ran")
    print(f"\n{'':<38}{'step (s)':>10}{'tokens/s':>11}{'peak GiB':>10}{'torch GiB':>11}{'reserved':>10}{'x TRL':>8}  target")
    for what, side in sides.items():
        if "failed" in side:
            print(f"{LABELS.get(what, what):<38}FAILED: {side['failed']}")
            continue
        if what == "memory":
            continue
        ratio = side["tokens_per_s"] / base if base else float("nan")
        target = ""
        kind = target_of(what)
        if kind:
            extra = " & peak <= TRL's" if kind == "full" else ""
            target = f">= {TARGETS[kind]:g}x{extra}: {'met' if met.get(what) else 'NOT met'}" if base else f">= {TARGETS[kind]:g}x"
        torch_gib, reserved = (side.get(k) for k in ("torch_peak_gib", "torch_reserved_gib"))
        print(f"{LABELS[what]:<38}{side['step_s']:>10.2f}{side['tokens_per_s']:>11.0f}{side['peak_gpu_gib']:>10.2f}"
              f"{(torch_gib if torch_gib is not None else float('nan')):>11.2f}"
              f"{(reserved if reserved is not None else float('nan')):>10.2f}{ratio:>8.2f}  {target}")
        if side.get("phases_s"):
            print(f"{'':<38}phases: " + ", ".join(f"{k} {v:.3f}" for k, v in side["phases_s"].items()))
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


def targets_met(sides: dict[str, dict]) -> dict[str, bool]:
    base = trl_base(sides)
    if base is None:
        return {}
    trl, met = sides[base], {}
    for what, side in sides.items():
        kind = target_of(what)
        if kind and "tokens_per_s" in side:
            met[what] = side["tokens_per_s"] >= TARGETS[kind] * trl["tokens_per_s"]
            if kind == "full":
                met[what] = met[what] and side["peak_gpu_gib"] <= trl["peak_gpu_gib"]
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/gkd_gpu-<date>-<kind>.json)")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="machine kind, for the record")
    choices = [*SIDES, *EXTRA]
    parser.add_argument("--only", choices=choices, action="append", help="run this side (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, no vLLM, 2 steps: the code paths only")
    parser.add_argument("--profile", action="store_true", help="profile rlcore's last train phase (not measured)")
    parser.add_argument("--merge", action="append", default=[], metavar="JSON",
                        help="an earlier call's results (repeatable): its sides are kept beside this run's (later ones "
                        "win); with no --only nothing runs: the merged table, targets and JSON only")
    parser.add_argument("--run", choices=[*choices, "build"], help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run:  # a child: one run, results to tmp/<run>.json
        tmp = Path(args.tmp)
        student, teacher = str(tmp / "student"), str(tmp / "teacher")
        if args.run == "build":
            return run_build(tmp, args.smoke)
        if args.run in TRL_SIDES:
            result = run_trl(student, teacher, args.data, tmp / f"out-{args.run}", args.smoke,
                             liger=args.run == "trl-liger", compile=args.run == "trl-compile")
        elif args.run == "trl-gkd":
            result = run_trl_gkd(student, teacher, args.data, tmp / "out-trl-gkd", args.smoke)
        elif args.run == "memory":
            result = run_memory(student, teacher, args.smoke)
        else:
            result = run_rlcore(student, teacher, args.data, tmp / f"out-{args.run}", args.run, args.smoke)
        (tmp / f"{args.run}.json").write_text(json.dumps(result, default=str))
        return

    if args.only or not args.merge:  # a merge alone runs nothing here: its sides' machine is not this one
        HOST.update(host_info())
    if args.profile:
        os.environ["RLCORE_BENCH_PROFILE"] = "1"  # the children read it
    wanted = args.only or ([] if args.merge else list(SIDES))
    started = time.perf_counter()
    path = results_path(args.json, f"gkd_gpu-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    kept: dict[str, dict] = {}  # sides run in calls of their own (--only, --merge) add up in one file
    for earlier in [path] * bool(args.only and path.exists()) + [Path(m) for m in args.merge]:
        kept.update(json.loads(earlier.read_text()).get("sides", {}))
    sides: dict[str, dict] = {}
    if not wanted:
        write_json(path, record(kept, args, started))
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if wanted:
            child("build", tmp, smoke=args.smoke)
            data = dataset_file(tmp)
        for what in wanted:
            try:
                sides[what] = summarise(child(what, tmp, data, args.smoke), 0 if args.smoke else SKIP)
            except Exception as error:  # noqa: BLE001 - the other sides still run; the child's log says why
                sides[what] = failure(error)
            sides[what]["commit"] = git_commit()
            print(json.dumps({what: sides[what]}, default=str))
            write_json(path, record({**kept, **sides}, args, started))
    print_table({**kept, **sides}, targets_met({**kept, **sides}))
    print(f"wrote {path}")
    if any("failed" in side for side in sides.values()):
        raise SystemExit(f"failed: {', '.join(k for k, v in sides.items() if 'failed' in v)}")


HOST: dict[str, Any] = {}  # host_info() of the machine this call's sides ran on, measured once in main()


def record(sides: dict[str, dict], args: argparse.Namespace, started: float) -> dict:
    """The results JSON: every side's row (settings and commit included), the targets and which were met."""
    return {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "smoke": args.smoke,
            "host": HOST,
            "sides": sides, "labels": {k: v for k, v in LABELS.items() if k in sides},
            "targets": {"full": "tokens/s >= 1.5 x DistillationTrainer's, peak GPU memory <= its peak",
                        "topk": "tokens/s >= 2 x DistillationTrainer's"},
            "targets_base": trl_base(sides), "met": targets_met(sides), "wall_s": round(time.perf_counter() - started, 1),
            "work": f"{MICRO * ACCUM} completions x {TOKENS} tokens a step, lmbda 1, beta {SAME['beta']}, vocabulary {VOCAB}, "
                    f"student Qwen2-0.5B shape, teacher Qwen2-1.5B shape, bf16, median of steps {SKIP + 1}-{STEPS}"}

if __name__ == "__main__":
    main()
