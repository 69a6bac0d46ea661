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

from fair import build_on_gpu, git_commit
from grpo_gpu import SHAPE

PROMPTS, WARMUP, CANDIDATES, TOKENS, BATCH = 256, 128, 8, 256, 128
GPU_MEMORY, MAX_MODEL_LEN = 0.85, 1024


def prompts_file(tmp: Path) -> Path:
    from rlcore.testing import toy_dataset

    rows = toy_dataset(WARMUP + PROMPTS, seed=0)
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_raw(model: str, data: Path) -> dict:
    import vllm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ids = [list(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)) for r in rows]
    llm = vllm.LLM(model=model, dtype="bfloat16", gpu_memory_utilization=GPU_MEMORY, max_model_len=MAX_MODEL_LEN, seed=0)
    params = vllm.SamplingParams(n=CANDIDATES, max_tokens=TOKENS, temperature=1.0,
                                 stop_token_ids=[tokenizer.eos_token_id, tokenizer.pad_token_id])
    llm.generate([{"prompt_token_ids": p} for p in ids[:WARMUP]], params, use_tqdm=False)
    outs, seconds = [], 0.0
    for start in range(WARMUP, len(ids), BATCH):  # the batches rlcore's steps generate
        began = time.perf_counter()
        outs += llm.generate([{"prompt_token_ids": p} for p in ids[start : start + BATCH]], params, use_tqdm=False)
        seconds += time.perf_counter() - began
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"seconds": seconds, "candidates": sum(len(o.outputs) for o in outs), "tokens": tokens,
            "settings": {"n": CANDIDATES, "max_tokens": TOKENS, "temperature": 1.0, "logprobs": None,
                         "detokenize": True, "gpu_memory_utilization": GPU_MEMORY, "max_model_len": MAX_MODEL_LEN,
                         "batches_of": BATCH, "seed": 0}}


def run_rlcore(model: str, data: Path, workers: int, out: Path) -> dict:
    from rlcore import load_plugins
    from rlcore.plugins.sampling import SampleConfig, SampleTrainer

    groups = {"sample_group": {"device": "GPU", "ranks": list(range(workers)), "workers": ["sampler"]},
              "orm_group": {"device": "CPU", "ranks": 1, "workers": ["orm"]}}
    config = SampleConfig(
        model=model, dataset=str(data), output_dir=str(out), num_return_sequences=CANDIDATES, max_new_tokens=TOKENS,
        temperature=1.0, batch_size=BATCH, seed_per_prompt=False, orm_model="toy", n_best_to_keep=1,
        device_groups=groups, sampler={"engine": "vllm", "dtype": "bfloat16", "vllm_gpu_memory_utilization": GPU_MEMORY,
                                       "vllm_max_model_len": MAX_MODEL_LEN},
    )
    SampleTrainer(config, load_plugins(), use_ray=True).fit()
    batches = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][WARMUP // BATCH:]
    seconds = sum(b["prompts"] / b["prompts_per_s"] for b in batches)
    phases = sorted({k for b in batches for k in b if k.startswith("time/")})
    return {"seconds": seconds, "candidates": sum(b["candidates"] for b in batches),
            "pass_rate": sum(b["pass_rate"] for b in batches) / len(batches),
            "phases_s": {k.removeprefix("time/"): round(sum(b.get(k, 0.0) for b in batches), 3) for k in phases},
            "settings": {"num_return_sequences": CANDIDATES, "max_new_tokens": TOKENS, "temperature": 1.0,
                         "batch_size": BATCH, "workers": workers, "orm_model": "toy", "seed_per_prompt": False,
                         "sampler log-probs": False, "vllm_gpu_memory_utilization": GPU_MEMORY,
                         "vllm_max_model_len": MAX_MODEL_LEN}}


def child(what: str, model: str, data: Path, tmp: Path, workers: int = 1) -> dict:
    out = tmp / f"{what}-{workers}.json"
    subprocess.run([sys.executable, __file__, "--run", what, "--model", model, "--data", str(data), "--out", str(out),
                    "--workers", str(workers)], check=True)
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
    parser.add_argument("--run", choices=["raw", "rlcore"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        out = Path(args.out)
        result = run_raw(args.model, Path(args.data)) if args.run == "raw" else \
            run_rlcore(args.model, Path(args.data), args.workers, out.parent / f"rlcore-{args.workers}")
        out.write_text(json.dumps(result))
        return

    started = time.perf_counter()
    wanted = args.only or ["raw", "rlcore1"] + (["rlcore2"] if gpu_count() >= 2 else [])
    sides: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_on_gpu(tmp / "qwen2-0.5b-shaped", SHAPE)
        data = prompts_file(tmp)
        for what in wanted:
            sides[what] = child("raw", model, data, tmp) if what == "raw" else \
                child("rlcore", model, data, tmp, workers=int(what[-1]))
            sides[what]["commit"] = git_commit()
            print(json.dumps({what: sides[what]}))
    path = Path(args.json or f"benchmarks/results/sample_gpu-{time.strftime('%Y-%m-%d')}-{args.kind}.json")
    if args.only and path.exists():  # sides run in calls of their own add up in one file
        sides = {**json.loads(path.read_text()).get("sides", {}), **sides}
    labels = {"raw": "raw vllm.LLM.generate", "rlcore1": "rlcore sample, 1 worker", "rlcore2": "rlcore sample, 2 workers"}
    ratios, met = {}, {}
    if "raw" in sides and "rlcore1" in sides:
        ratios["one_worker_vs_raw"] = round(sides["rlcore1"]["candidates_per_s"] / sides["raw"]["candidates_per_s"], 3)
        met["one_worker_vs_raw"] = ratios["one_worker_vs_raw"] >= 0.98
    if "rlcore1" in sides and "rlcore2" in sides:
        ratios["two_workers_vs_one"] = round(sides["rlcore2"]["candidates_per_s"] / sides["rlcore1"]["candidates_per_s"], 3)
        met["two_workers_vs_one"] = ratios["two_workers_vs_one"] >= 1.8
    print(f"\n{'':28} {'seconds':>8} {'candidates/s':>13}")
    for what, side in sides.items():
        print(f"{labels[what]:28} {side['seconds']:8.2f} {side['candidates_per_s']:13.1f}"
              + (f"   phases: {side['phases_s']}" if "phases_s" in side else ""))
    for key, value in ratios.items():
        target = 0.98 if key == "one_worker_vs_raw" else 1.8
        print(f"{key}: {value:.3f} (target >= {target}: {'met' if met[key] else 'NOT met'})")
    if "raw" in sides and "rlcore1" in sides:
        gap = sides["rlcore1"]["seconds"] - sides["raw"]["seconds"]
        generate = sides["rlcore1"]["phases_s"].get("generate", 0.0)
        print(f"rlcore's extra {gap:.2f} s: generate phase {generate - sides['raw']['seconds']:+.2f} s over raw "
              f"(encoding, Ray call, decoding), the rest scoring, selection and writing: {sides['rlcore1']['phases_s']}")
    result = {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "sides": sides,
              "ratios": ratios, "met": met, "targets": {"one_worker_vs_raw": 0.98, "two_workers_vs_one": 1.8},
              "wall_s": round(time.perf_counter() - started, 1),
              "work": f"{PROMPTS} prompts x {CANDIDATES} candidates x <= {TOKENS} tokens, Qwen2-0.5B shape, bf16, "
                      f"orm 'toy' on a CPU worker, batches of {BATCH} after a {WARMUP}-prompt warm-up"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
