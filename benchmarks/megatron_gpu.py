"""GRPO with `train.engine=megatron` against `train.engine=hf`, side by side in one run, as a user runs them:
`rlcore run --plugin grpo --use-ray --config examples/ray/grpo/colocate_device_groups.yaml train.engine=ENGINE`,
scaled to this host's GPUs, the example's defaults (dtype auto, sleep level 1, offloading) everywhere except the
work both engines share (`SHARED`: model, data and reward, batch, lengths, steps) and each engine's keys
(`ENGINES`), listed in the table.

    python benchmarks/megatron_gpu.py --part one   # one H200: the Qwen2-0.5B-shaped work of grpo_gpu.py, train and
                                                   # vLLM colocated; target: megatron time/train <= 0.8x hf's
    python benchmarks/megatron_gpu.py --part two   # two H200s: a Qwen2.5-7B-shaped random model, the example on both
                                                   # GPUs (tensor parallel 2 for train and vLLM) with megatron, and
                                                   # the hf engine on one GPU for the same model (expected: out of memory)
    python benchmarks/megatron_gpu.py --part train # one H200, no vLLM: the train phase alone (GRPO's loss on 64 rows of
                                                   # 64 + up to 256 tokens, micro-batches of 16), hf vs megatron with
                                                   # SDPA core attention vs megatron with the local spec's attention
    python benchmarks/megatron_gpu.py              # parts one and two (needs two GPUs)

Part one runs its engines interleaved, megatron, megatron-bf16, hf, megatron, ... (`--rounds`, default 2), each in
a fresh process (one vLLM per process), the model drawn once; the ratios to hf are per round, with their median and
range. The table gives median step time, median `time/train`, completion tokens per second and the peak GPU memory
(nvidia-smi, every GPU, sampled every 0.2 s); a run that fails says how (an out-of-memory error is a result for part
two). `--json PATH` (default benchmarks/results/megatron_gpu.json) is written after each run. `--smoke --part one`
runs part one's code paths on the CPU (a tiny model, the hf rollout engine in vLLM's place, float32, 2 steps).
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

from fair import (failure, git_commit, interleave, print_provenance, profile_env, provenance, read_profile,
                  results_path, rlcore_run, scaled, spread, spread_text, user_config, write_json)

PROMPTS, GENERATIONS, TOKENS, STEPS, SKIP = 8, 8, 256, 6, 2
SMALL = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")  # Qwen2-0.5B's shape
LARGE = dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944,
             vocab_size=152064, max_position_embeddings=4096, dtype="bfloat16")  # Qwen2.5-7B's shape
NO_MASTER_WEIGHTS = {"use_distributed_optimizer": False, "master_weights": False}
RESULTS = Path(__file__).parent / "results" / "megatron_gpu.json"
EXAMPLE = "grpo/colocate_device_groups.yaml"
# the work every engine does, set on the example (with the model and the data)
SHARED: dict[str, Any] = dict(reward_funcs=["toy"], num_generations=GENERATIONS, max_completion_length=TOKENS,
                              per_device_train_batch_size=16, gradient_accumulation_steps=4, max_steps=STEPS)
# each engine's own keys
ENGINES: dict[str, dict[str, Any]] = {
    "megatron": {"train.engine": "megatron"},
    "megatron-bf16": {"train.engine": "megatron", "train.engine_kwargs": NO_MASTER_WEIGHTS},  # hf's numerics: bf16 AdamW
    "hf": {"train.engine": "hf"},
}
ENGINE_CLASSES = {"megatron": ("rlcore.plugins.megatron.engine", "MegatronTrainEngine", "train_step"),
                  "hf": ("rlcore.plugins.hf.train", "HFTrainEngine", "train_step")}
# --smoke (part one's code paths on the CPU): a tiny model (its context as long as the GPU model's), the hf rollout
# engine for vLLM, 2 prompts x 4 generations x 8 tokens, 2 steps, none skipped
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, vocab_size=1024, max_position_embeddings=2048)
SMOKE = dict(num_generations=4, max_completion_length=8, per_device_train_batch_size=4, gradient_accumulation_steps=2,
             max_steps=2)


def run_keys(model: str, data: str, out: Path, engine: str, part: str,
             gpu: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(shared, scaling, own) keys of one engine's run: the GPU run's (`gpu`), or --smoke's on the CPU."""
    gpus = 2 if part == "two" and engine == "megatron" else 1
    shared = {"model": model, "dataset": data, **SHARED, **({} if gpu else SMOKE)}
    scale = {**scaled(EXAMPLE, gpus if gpu else 0), "output_dir": str(out)}
    own = dict(ENGINES[engine])
    if gpus > 1:
        own.update({"train.tensor_model_parallel_size": gpus, "rollout.vllm_tensor_parallel_size": gpus})
    if not gpu:
        own["rollout.engine"] = "hf"
    return shared, scale, own


def flat(parts: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return {k: v for part in parts for k, v in part.items()}


class PeakMemory:
    """The largest nvidia-smi `memory.used` of each GPU while the block runs (MiB)."""

    def __enter__(self) -> PeakMemory:
        self.peak: dict[int, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        while not self.stop.wait(0.2):
            try:
                done = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):  # no nvidia-smi (the CPU, --smoke): no peak
                return
            for line in done.stdout.splitlines():
                index, used = (int(x) for x in line.split(","))
                self.peak[index] = max(self.peak.get(index, 0), used)

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


TRAIN_VARIANTS = ("hf", "megatron", "megatron-bf16", "megatron-local")
TRAIN_ROWS, TRAIN_PROMPT, TRAIN_MICRO, TRAIN_STEPS = 64, 64, 16, 7


def run_train_phase(model: str, variant: str) -> dict:
    """`TRAIN_STEPS` optimizer steps of one engine on the same right-padded batch: seconds each, peak memory."""
    import torch

    from rlcore import Batch

    if variant == "megatron-local":  # megatron-core's own local spec: [B, heads, T, T] scores
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from rlcore.plugins.megatron import attention

        attention.layer_spec = lambda: get_gpt_layer_local_spec(normalization="RMSNorm")  # the engine adds the mask
    if variant == "hf":
        from rlcore.plugins.hf import make_train_engine
    else:
        from rlcore.plugins.megatron import make_train_engine
    extra = NO_MASTER_WEIGHTS if variant == "megatron-bf16" else {}
    engine = make_train_engine(model=model, device="cuda", dtype="bfloat16", learning_rate=1e-6, seed=0, **extra)
    g = torch.Generator().manual_seed(0)
    width = TRAIN_PROMPT + TOKENS
    ids = torch.randint(0, SMALL["vocab_size"] - 1, (TRAIN_ROWS, width), generator=g)
    lengths = TRAIN_PROMPT + torch.randint(TOKENS // 4, TOKENS + 1, (TRAIN_ROWS,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    completion = mask.clone()
    completion[:, :TRAIN_PROMPT] = 0
    advantages = torch.randn(TRAIN_ROWS, generator=g)
    batch = Batch({"input_ids": ids * mask, "attention_mask": mask, "completion_mask": completion,
                   "advantages": advantages})
    tokens = float(completion.sum())

    def loss_fn(outputs, micro):
        logprobs = outputs.logprobs()
        ratio = torch.exp(logprobs - logprobs.detach())
        loss = -(ratio * micro["advantages"][:, None] * micro["completion_mask"]).sum() / tokens
        return loss, {}

    seconds = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(TRAIN_STEPS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.train_step(batch, loss_fn, TRAIN_MICRO)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return {"train_s": seconds, "peak_allocated_mib": torch.cuda.max_memory_allocated() >> 20,
            "tokens": int(mask.sum())}


def train_phase_part(tmp: Path, variants: tuple[str, ...] = TRAIN_VARIANTS) -> dict:
    model = build({**SMALL}, "qwen2-0.5b-shape-gpu", device="cuda")
    rows = []
    for variant in variants:
        out = tmp / f"train-{variant}.json"
        cmd = [sys.executable, __file__, "--train-variant", variant, "--model", model, "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        row: dict[str, Any] = {"engine": variant}
        if done.returncode:
            row["failed"] = f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}"
        else:
            raw = json.loads(out.read_text())
            step = statistics.median(raw["train_s"][SKIP:])
            row.update(train_s=round(step, 3), peak_allocated_mib=raw["peak_allocated_mib"],
                       tokens_per_s=round(raw["tokens"] / step), steps=raw["train_s"])
        rows.append(row)
    hf = rows[0].get("train_s", float("nan"))
    print(f"\none H200, train phase alone (Qwen2-0.5B shape, bf16, {TRAIN_ROWS} rows x {TRAIN_PROMPT}+<= {TOKENS} "
          f"tokens, micro-batch {TRAIN_MICRO}); hf and megatron-bf16: bf16 AdamW, megatron: fp32 main params, grads "
          "and moments")
    print(f"{'engine':16} {'train s':>8} {'x hf':>6} {'tok/s':>9} {'peak alloc MiB':>15}  note")
    for r in rows:
        ratio = r.get("train_s", float("nan")) / hf
        print(f"{r['engine']:16} {r.get('train_s', '-'):>8} {ratio:6.2f} {r.get('tokens_per_s', '-'):>9} "
              f"{r.get('peak_allocated_mib', '-'):>15}  {r.get('failed', '')[:300]}")
    ratio = rows[1].get("train_s", float("nan")) / hf
    return {"runs": rows, "train_ratio_megatron_over_hf": round(ratio, 3), "target": "<= 1.0 (stretch 0.8)",
            "met": ratio <= 1.0}


ONE_ENGINES = ("megatron", "megatron-bf16", "hf")


def one_gpu_record(done: list[dict[str, dict]]) -> dict:
    """Each megatron engine's time/train and device-wide peak against hf's of the same round: per round, their median
    and range, and whether the targets are met by the medians; `runs`, the last round's rows."""
    def peak(r: dict) -> float:
        return max(r.get("peak_gpu_mib", {}).values(), default=float("nan"))

    ratios = []
    for engine in ONE_ENGINES[:-1]:
        pairs = [(r[engine], r["hf"]) for r in done if engine in r and "hf" in r]
        if not pairs:
            continue
        train = [ours.get("train_s", float("nan")) / hf.get("train_s", float("nan")) for ours, hf in pairs]
        memory = [peak(ours) / peak(hf) for ours, hf in pairs]
        median_train, median_memory = statistics.median(train), statistics.median(memory)
        ratios.append({"engine": engine, "train_x_hf": round(median_train, 3), "peak_x_hf": round(median_memory, 3),
                       "train_x_hf_rounds": spread(train), "peak_x_hf_rounds": spread(memory),
                       "met": median_train <= 1.0 and median_memory <= 1.0})
    last = {engine: row for r in done for engine, row in r.items()}
    return {"runs": [last[e] for e in ONE_ENGINES if e in last], "ratios": ratios, "rounds": done,
            "target": "time/train <= 1.0x hf (stretch 0.8x), peak GPU memory <= hf's, by the median over the rounds"}


def subprocess_run(model: str, data: str, engine: str, part: str, tmp: Path, name: str, smoke: bool = False,
                   profile: bool = False) -> dict:
    """One engine's run through `rlcore run` (its GPU config checked here first, under --smoke too): medians of step,
    time/train and tokens/s, and the peak GPU memory."""
    out = tmp / f"out-{name}"
    gpu_keys = run_keys(model, data, out, engine, part, gpu=True)
    user_config("grpo", EXAMPLE, flat(gpu_keys))
    keys = run_keys(model, data, out, engine, part, gpu=not smoke)
    if smoke:
        user_config("grpo", EXAMPLE, flat(keys))
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if part == "two" and engine == "hf":  # the hf engine on one GPU, as a user would try first
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[0]
    profiled = None
    if profile:  # the last step's train phase, in the train worker
        site, profiled = profile_env(tmp, name, keys[0]["max_steps"] - 1, ENGINE_CLASSES[engine.split("-")[0]])
        env.update(site)
    started = time.perf_counter()
    result: dict[str, Any] = {"engine": engine, "run": provenance(EXAMPLE, *keys)}
    with PeakMemory() as memory:
        try:
            raw = rlcore_run("grpo", EXAMPLE, flat(keys), tmp, name, use_ray=True, env=env)
        except Exception as error:  # noqa: BLE001 - an out-of-memory error is a result for part two
            raw = None
            result.update(failure(error))
    result.update(wall_s=round(time.perf_counter() - started, 1), peak_gpu_mib=memory.peak)
    if raw is None:
        if "out of memory" in result.get("error_tail", "").lower():
            result["failed"] = "out of memory"
        return result
    skip = 0 if smoke else SKIP
    rows = raw["rows"]
    train_s = [r.get("time/train", float("nan")) for r in rows]
    if profiled:  # the profiled last step is not measured
        raw["step_s"], train_s, rows = raw["step_s"][:-1], train_s[:-1], rows[:-1]
    step, train = statistics.median(raw["step_s"][skip:]), statistics.median(train_s[skip:])
    length = statistics.median(r["completions/mean_length"] for r in rows[skip:])
    completions = keys[0]["per_device_train_batch_size"] * keys[0]["gradient_accumulation_steps"]
    phases = sorted({k for r in rows for k in r if k.startswith("time/")})
    result.update(step_s=round(step, 3), train_s=round(train, 3), tokens_per_s=round(length * completions / step, 1),
                  steps_measured=len(raw["step_s"][skip:]), per_step_s=[round(s, 3) for s in raw["step_s"]],
                  per_step_train_s=[round(s, 3) for s in train_s], setup_s=raw["setup_s"],
                  phases_s={k: round(statistics.median([r[k] for r in rows[skip:] if r.get(k) is not None]
                                                       or [float("nan")]), 4) for k in phases})
    if profiled:
        result["profile"] = read_profile(profiled, "train_step")
    return result


def build(shape: dict, name: str, device: str = "cuda") -> str:
    """A random model of `shape`, its weights drawn on the GPU (a 1.5B shape takes minutes on the CPU)."""
    from rlcore.testing import build_tiny_model

    return str(build_tiny_model(Path(tempfile.gettempdir()) / "rlcore-bench" / name, **shape, device=device))


def part_one(tmp: Path, smoke: bool, rounds: int, profile: bool, record: dict, path: Path) -> dict:
    """GRPO colocated with vLLM on one GPU, megatron's train engine against hf's, interleaved in rounds (--smoke: the
    CPU, hf rollout); written into `record` at `path` after each run."""
    model = build(SMOKE_SHAPE, "tiny-smoke", device="cpu") if smoke else build(SMALL, "qwen2-0.5b-shape")
    data = prompts_file(tmp)
    done: list[dict[str, dict]] = []
    key = "one_gpu_qwen2_0.5b_colocated"
    for index, engine in interleave(list(ONE_ENGINES), rounds):
        while len(done) <= index:
            done.append({})
        done[index][engine] = subprocess_run(model, data, engine, "one", tmp, f"{engine}-{index + 1}", smoke, profile)
        record[key] = one_gpu_record(done)
        write_json(path, record)
    rows = record[key]["runs"]
    print_table("one H200, GRPO on colocate_device_groups.yaml, Qwen2-0.5B shape (megatron: fp32 main params, grads "
                "and moments; megatron-bf16 and hf: bf16 AdamW); the last round's runs", rows)
    for r in record[key]["ratios"]:
        print(f"{r['engine']:14} time/train x hf {r['train_x_hf']}, peak GPU x hf {r['peak_x_hf']}: "
              f"{'met' if r['met'] else 'NOT met'} (target time <= 1.0x, stretch 0.8x; peak <= 1.0x, by the median)")
        print(f"{'':14} time/train x hf by round: {spread_text(r['train_x_hf_rounds'])}")
    for row in rows:
        print(f"{row['engine']:14} phases (median s): " + ", ".join(f"{k[5:]} {v}" for k, v in row.get("phases_s", {}).items()))
    print_provenance({"rlcore_runs": {row["engine"]: row["run"] for row in rows}})
    for row in rows:
        if "failed" in row:
            print(f"{row['engine']} failed ({row['failed']}); the end of its output:\n{row.get('error_tail', '')}")
    return record[key]


def prompts_file(tmp: Path) -> str:
    """The toy task's prompts as chat rows with their targets (the `toy` reward reads `target`)."""
    from rlcore.testing import toy_dataset

    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]})
                            + "\n" for r in toy_dataset()))
    return str(path)


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'engine':14} {'step s':>8} {'train s':>8} {'tok/s':>9} {'peak GPU MiB':>24}  note")
    for r in rows:
        peak = ",".join(str(v) for _, v in sorted(r["peak_gpu_mib"].items()))
        print(f"{r['engine']:14} {r.get('step_s', '-'):>8} {r.get('train_s', '-'):>8} {r.get('tokens_per_s', '-'):>9} "
              f"{peak:>24}  {r.get('failed', '')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["one", "two", "both", "train"], default="both")
    parser.add_argument("--rounds", type=int, default=2, help="part one: rounds of the engines, interleaved (default 2)")
    parser.add_argument("--train-variant", choices=TRAIN_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(TRAIN_VARIANTS),
                        help=f"--part train: the engines to run, hf first (default {','.join(TRAIN_VARIANTS)})")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND"),
                        help="machine kind, for the record (default nvidia-h200 for --part one or train, else -x2)")
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/megatron_gpu.json)")
    parser.add_argument("--smoke", action="store_true", help="part one's code paths on the CPU: a tiny model, the hf "
                        "rollout engine for vLLM, float32, 2 steps (the GPU run's configs are built there too)")
    parser.add_argument("--profile", action="store_true", help="part one: each engine's last train phase under "
                        "torch's profiler; its table is printed and kept in the JSON")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_variant:  # a child: one engine's train phase
        Path(args.out).write_text(json.dumps(run_train_phase(args.model, args.train_variant)))
        return
    if args.smoke and args.part != "one":
        parser.error("--smoke runs part one's code paths only: add --part one")
    path = results_path(args.json, RESULTS.name, args.smoke)
    kind = args.kind or ("nvidia-h200" if args.part in ("one", "train") else "nvidia-h200-x2")
    record: dict[str, Any] = {"kind": kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                              "smoke": args.smoke, "steps": STEPS, "skip": SKIP, "example": f"examples/ray/{EXAMPLE}",
                              "prompts": PROMPTS, "generations": GENERATIONS, "completion_tokens": TOKENS}
    with tempfile.TemporaryDirectory() as tmp:
        if args.part == "train":
            record["one_gpu_train_phase"] = train_phase_part(Path(tmp), tuple(args.variants.split(",")))
        if args.part in ("one", "both"):
            part_one(Path(tmp), args.smoke, args.rounds, args.profile, record, path)
        if args.part in ("two", "both"):
            model, data = build(LARGE, "qwen2.5-7b-shape"), prompts_file(Path(tmp))
            rows = []
            for engine in ("megatron", "hf"):
                rows.append(subprocess_run(model, data, engine, "two", Path(tmp), f"two-{engine}"))
                record["two_gpu_qwen2.5_7b_colocated_tp2"] = {"runs": rows}
                write_json(path, record)
            print_table("two H200s, GRPO on colocate_device_groups.yaml, Qwen2.5-7B shape: megatron TP2 (+ vLLM TP2) "
                        "on both GPUs vs hf on one GPU", rows)
            print_provenance({"rlcore_runs": {row["engine"]: row["run"] for row in rows}})
    write_json(path, record)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
