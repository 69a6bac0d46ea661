"""Best-of-N sampling on GPUs: candidates per second of rlcore's `sample` (1 vLLM sampler worker, and 2 where
there are two GPUs; the ORM scoring every candidate) against raw `vllm.LLM.generate` of the same prompts and
settings.

The work: 256 prompts of the toy task x 8 candidates x up to 256 tokens from the random-weight Qwen2-0.5B-shaped
model (bf16, as grpo_gpu.py builds it, drawn on the GPU), temperature 1. rlcore runs on Ray with the
device_groups form (`sample_group` on GPU 0, or GPUs 0-1; the `orm` role, the `toy` reward function, on a CPU
worker), batches of 128 prompts committed to its JSONL after each; a first batch of 128 more prompts warms it
up and is not timed (its time comes from metrics.jsonl). Raw vLLM warms up on the same 128 prompts, then
generates the 256 in the same batches of 128 (one `generate` call each, as rlcore's steps), with vLLM's
defaults (log-probs off, detokenising on). Each side runs in a process of its own.

What rlcore's step adds to the raw calls, from reading the path (plugins/sampling/trainer.py, sources.py,
plugins/vllm/engine.py): chat-template encoding of the batch's prompts on the driver, one Ray call to the
sampler actor and the candidates' token ids back, decoding each candidate once, the ORM's Ray call, best-of-N
selection and an fsync'd commit. The sampler no longer asks vLLM for log-probs (best-of-N reads none: vLLM
computes a log-softmax over the vocabulary every decode step for them); the phases printed say where the rest goes.

    python benchmarks/sample_gpu.py                  # raw + 1 worker on one H200 (+ 2 workers with 2 GPUs), ~3 min
    python benchmarks/sample_gpu.py --only rlcore1   # one side
    python benchmarks/sample_gpu.py --smoke          # a tiny model on the CPU, hf engines in vLLM's place

`--json PATH` (default benchmarks/results/sample_gpu-<date>-<kind>.json) is written after each side; a side that
fails is recorded and the others still run.

Targets: one worker >= 0.98x raw vLLM (the pipeline's cost under 2%); two workers on two GPUs >= 1.8x one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fair import build_model, failure, git_commit, results_path, run_child, write_json
from grpo_gpu import SHAPE

PROMPTS, WARMUP, CANDIDATES, TOKENS, BATCH = 256, 128, 8, 256, 128
GPU_MEMORY, MAX_MODEL_LEN = 0.85, 1024
# --smoke: a tiny model on the CPU, 8 prompts (after 4 of warm-up) x 2 candidates x 8 tokens in batches of 4; raw
# vLLM's side generates with rlcore's hf rollout engine there, rlcore's sampler is an hf engine on a CPU worker
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, vocab_size=1024)
SMOKE_WORK = dict(PROMPTS=8, WARMUP=4, CANDIDATES=2, TOKENS=8, BATCH=4)


def work(smoke: bool) -> tuple[int, int, int, int, int]:
    """PROMPTS, WARMUP, CANDIDATES, TOKENS, BATCH: the GPU run's, or --smoke's."""
    if smoke:
        return tuple(SMOKE_WORK[k] for k in ("PROMPTS", "WARMUP", "CANDIDATES", "TOKENS", "BATCH"))
    return PROMPTS, WARMUP, CANDIDATES, TOKENS, BATCH


def prompts_file(tmp: Path, smoke: bool = False) -> Path:
    from rlcore.testing import toy_dataset

    prompts, warmup, *_ = work(smoke)
    rows = toy_dataset(warmup + prompts, seed=0)
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_raw(model: str, data: Path, smoke: bool = False) -> dict:
    from transformers import AutoTokenizer

    _, warmup, candidates, tokens, batch = work(smoke)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ids = [list(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)) for r in rows]
    stop = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    if smoke:  # no vLLM on the CPU: rlcore's hf rollout engine, the same settings, stands in for vllm.LLM
        from rlcore import SamplingParams
        from rlcore.plugins.hf.rollout import HFRolloutEngine

        engine = HFRolloutEngine(model, seed=0)
        sampling = SamplingParams(n=candidates, max_tokens=tokens, temperature=1.0, stop_token_ids=stop, logprobs=False)

        def generate(prompts: list[list[int]]) -> list[list[int]]:
            return [g.token_ids for g in engine.generate(prompts, sampling)]
    else:
        import vllm

        llm = vllm.LLM(model=model, dtype="bfloat16", gpu_memory_utilization=GPU_MEMORY, max_model_len=MAX_MODEL_LEN, seed=0)
        params = vllm.SamplingParams(n=candidates, max_tokens=tokens, temperature=1.0, stop_token_ids=stop)

        def generate(prompts: list[list[int]]) -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(c.token_ids) for o in outs for c in o.outputs]

    generate(ids[:warmup])
    outs, seconds = [], 0.0
    for start in range(warmup, len(ids), batch):  # the batches rlcore's steps generate
        began = time.perf_counter()
        outs += generate(ids[start : start + batch])
        seconds += time.perf_counter() - began
    return {"seconds": seconds, "candidates": len(outs), "tokens": sum(len(c) for c in outs),
            "settings": {"n": candidates, "max_tokens": tokens, "temperature": 1.0, "logprobs": None,
                         "detokenize": True, "gpu_memory_utilization": GPU_MEMORY, "max_model_len": MAX_MODEL_LEN,
                         "batches_of": batch, "seed": 0, "engine": "hf (--smoke)" if smoke else "vllm.LLM"}}


def run_rlcore(model: str, data: Path, workers: int, out: Path, smoke: bool = False) -> dict:
    from rlcore import load_plugins
    from rlcore.plugins.sampling import SampleConfig, SampleTrainer

    _, warmup, candidates, tokens, batch = work(smoke)
    groups = {"sample_group": {"device": "GPU", "ranks": list(range(workers)), "workers": ["sampler"]},
              "orm_group": {"device": "CPU", "ranks": 1, "workers": ["orm"]}}
    sampler = {"engine": "vllm", "dtype": "bfloat16", "vllm_gpu_memory_utilization": GPU_MEMORY,
               "vllm_max_model_len": MAX_MODEL_LEN}
    common = dict(model=model, dataset=str(data), output_dir=str(out), num_return_sequences=candidates,
                  max_new_tokens=tokens, temperature=1.0, batch_size=batch, seed_per_prompt=False, orm_model="toy",
                  n_best_to_keep=1)
    config = SampleConfig(**common, device_groups=groups, sampler=sampler)  # the GPU run's, validated under --smoke too
    if smoke:  # the CPU: the sampler an hf engine on a CPU worker
        groups = {**groups, "sample_group": {"device": "CPU", "ranks": workers, "workers": ["sampler"]}}
        config = SampleConfig(**common, device_groups=groups, sampler={"engine": "hf", "dtype": "float32"})
    SampleTrainer(config, load_plugins(), use_ray=True).fit()
    batches = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][warmup // batch:]
    seconds = sum(b["prompts"] / b["prompts_per_s"] for b in batches)
    phases = sorted({k for b in batches for k in b if k.startswith("time/")})
    return {"seconds": seconds, "candidates": sum(b["candidates"] for b in batches),
            "pass_rate": sum(b["pass_rate"] for b in batches) / len(batches),
            "phases_s": {k.removeprefix("time/"): round(sum(b.get(k, 0.0) for b in batches), 3) for k in phases},
            "settings": {"num_return_sequences": candidates, "max_new_tokens": tokens, "temperature": 1.0,
                         "batch_size": batch, "workers": workers, "sampler": config.sampler.engine, "orm_model": "toy", "seed_per_prompt": False,
                         "sampler log-probs": False, "vllm_gpu_memory_utilization": GPU_MEMORY,
                         "vllm_max_model_len": MAX_MODEL_LEN}}


def child(what: str, model: str, data: Path, tmp: Path, workers: int = 1, smoke: bool = False) -> dict:
    out = tmp / f"{what}-{workers}.json"
    run_child([sys.executable, __file__, "--run", what, "--model", model, "--data", str(data), "--out", str(out),
               "--workers", str(workers)] + (["--smoke"] if smoke else []))
    result = json.loads(out.read_text())
    result["candidates_per_s"] = result["candidates"] / result["seconds"]
    return result


def gpu_count() -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                         text=True)
    return int(out.stdout.strip() or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="default benchmarks/results/sample_gpu-<date>-<kind>.json")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="for the record")
    parser.add_argument("--only", choices=["raw", "rlcore1", "rlcore2"], action="append", help="run this side (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, hf engines for vLLM: the code "
                        "paths only (rlcore's GPU config is built there too)")
    parser.add_argument("--run", choices=["raw", "rlcore"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        out = Path(args.out)
        result = run_raw(args.model, Path(args.data), args.smoke) if args.run == "raw" else \
            run_rlcore(args.model, Path(args.data), args.workers, out.parent / f"rlcore-{args.workers}", args.smoke)
        out.write_text(json.dumps(result))
        return

    started = time.perf_counter()
    wanted = args.only or ["raw", "rlcore1"] + (["rlcore2"] if not args.smoke and gpu_count() >= 2 else [])
    path = results_path(args.json, f"sample_gpu-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    kept = json.loads(path.read_text()).get("sides", {}) if args.only and path.exists() else {}
    sides: dict[str, dict] = {}  # sides run in calls of their own (--only) add up in one file
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_model(tmp / "qwen2-0.5b-shaped", SHAPE, SMOKE_SHAPE if args.smoke else None)
        data = prompts_file(tmp, args.smoke)
        for what in wanted:
            try:
                sides[what] = child("raw", model, data, tmp, smoke=args.smoke) if what == "raw" else \
                    child("rlcore", model, data, tmp, workers=int(what[-1]), smoke=args.smoke)
            except Exception as error:  # noqa: BLE001 - the other sides still run; the child's log says why
                sides[what] = failure(error)
            sides[what]["commit"] = git_commit()
            print(json.dumps({what: sides[what]}))
            write_json(path, record({**kept, **sides}, args, started))
    result = record({**kept, **sides}, args, started)
    write_json(path, result)
    labels = {"raw": "raw vllm.LLM.generate", "rlcore1": "rlcore sample, 1 worker", "rlcore2": "rlcore sample, 2 workers"}
    print(f"\n{'':28} {'seconds':>8} {'candidates/s':>13}")
    for what, side in result["sides"].items():
        if "failed" in side:
            print(f"{labels[what]:28} FAILED: {side['failed']}")
            continue
        print(f"{labels[what]:28} {side['seconds']:8.2f} {side['candidates_per_s']:13.1f}"
              + (f"   phases: {side['phases_s']}" if "phases_s" in side else ""))
    for key, value in result["ratios"].items():
        target = result["targets"][key]
        print(f"{key}: {value:.3f} (target >= {target}: {'met' if result['met'][key] else 'NOT met'})")
    measured = {k: v for k, v in result["sides"].items() if "failed" not in v}
    if "raw" in measured and "rlcore1" in measured:
        raw, one = measured["raw"], measured["rlcore1"]
        gap, generate = one["seconds"] - raw["seconds"], one["phases_s"].get("generate", 0.0)
        print(f"rlcore's extra {gap:.2f} s: generate phase {generate - raw['seconds']:+.2f} s over raw "
              f"(encoding, Ray call, decoding), the rest scoring, selection and writing: {one['phases_s']}")
    print(f"wrote {path}")
    failed = [what for what, side in sides.items() if "failed" in side]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def record(sides: dict[str, dict], args: argparse.Namespace, started: float) -> dict:
    """The results JSON: every side's row (settings and commit included), the ratios and the targets met."""
    measured = {k: v for k, v in sides.items() if "failed" not in v}
    ratios, met = {}, {}
    if "raw" in measured and "rlcore1" in measured:
        ratios["one_worker_vs_raw"] = round(measured["rlcore1"]["candidates_per_s"] / measured["raw"]["candidates_per_s"], 3)
        met["one_worker_vs_raw"] = ratios["one_worker_vs_raw"] >= 0.98
    if "rlcore1" in measured and "rlcore2" in measured:
        ratios["two_workers_vs_one"] = round(measured["rlcore2"]["candidates_per_s"] / measured["rlcore1"]["candidates_per_s"], 3)
        met["two_workers_vs_one"] = ratios["two_workers_vs_one"] >= 1.8
    prompts, warmup, candidates, tokens, batch = work(args.smoke)
    return {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "smoke": args.smoke,
            "sides": sides, "ratios": ratios, "met": met, "targets": {"one_worker_vs_raw": 0.98, "two_workers_vs_one": 1.8},
            "wall_s": round(time.perf_counter() - started, 1),
            "work": f"{prompts} prompts x {candidates} candidates x <= {tokens} tokens, Qwen2-0.5B shape, bf16, "
                    f"orm 'toy' on a CPU worker, batches of {batch} after a {warmup}-prompt warm-up"}

if __name__ == "__main__":
    main()
