"""Best-of-N sampling on GPUs: candidates per second of rlcore's `sample` (1 and 2 vLLM sampler workers, the ORM
scoring every candidate) against raw `vllm.LLM.generate` of the same prompts and settings, in the same run.

The work: 256 prompts of the toy task x 8 candidates x up to 256 tokens from the random-weight Qwen2-0.5B-shaped
model (bf16, as grpo_gpu.py builds it), temperature 1. rlcore runs on Ray with the device_groups form
(`sample_group` on GPU 0, or GPUs 0-1; the `orm` role, the `toy` reward function, on a CPU worker), batches of
128 prompts committed to its JSONL after each; a first batch of 128 more prompts warms it up and is not timed
(its time comes from metrics.jsonl). Raw vLLM warms up on the same 128 prompts, then generates the 256 in one
call. Each side runs in a process of its own.

    python benchmarks/sample_gpu.py [--json PATH]      # on nvidia-h200-x2

Targets: one worker >= 0.9x raw vLLM (the pipeline costs at most 10%); two workers on two GPUs >= 1.8x one.
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
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids[WARMUP:]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"seconds": seconds, "candidates": sum(len(o.outputs) for o in outs), "tokens": tokens}


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
    return {"seconds": seconds, "candidates": sum(b["candidates"] for b in batches),
            "pass_rate": sum(b["pass_rate"] for b in batches) / len(batches),
            "generate_s": sum(b["time/generate"] for b in batches), "score_s": sum(b["time/score"] for b in batches),
            "write_s": sum(b["time/write"] for b in batches)}


def child(what: str, model: str, data: Path, tmp: Path, workers: int = 1) -> dict:
    out = tmp / f"{what}-{workers}.json"
    subprocess.run([sys.executable, __file__, "--run", what, "--model", model, "--data", str(data), "--out", str(out),
                    "--workers", str(workers)], check=True)
    result = json.loads(out.read_text())
    result["candidates_per_s"] = result["candidates"] / result["seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/sample_gpu.json", help="where to write the results")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200-x2"), help="for the record")
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

    from rlcore.testing import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = str(build_tiny_model(tmp / "qwen2-0.5b-shaped", **SHAPE))
        data = prompts_file(tmp)
        raw = child("raw", model, data, tmp)
        one = child("rlcore", model, data, tmp, workers=1)
        two = child("rlcore", model, data, tmp, workers=2)
    one_vs_raw, two_vs_one = one["candidates_per_s"] / raw["candidates_per_s"], two["candidates_per_s"] / one["candidates_per_s"]
    print(f"{'':28} {'seconds':>8} {'candidates/s':>13} {'ratio':>7}")
    print(f"{'raw vllm.LLM.generate':28} {raw['seconds']:8.2f} {raw['candidates_per_s']:13.1f} {1.0:7.2f}")
    print(f"{'rlcore sample, 1 worker':28} {one['seconds']:8.2f} {one['candidates_per_s']:13.1f} {one_vs_raw:7.2f}  (target >= 0.9 x raw)")
    print(f"{'rlcore sample, 2 workers':28} {two['seconds']:8.2f} {two['candidates_per_s']:13.1f} {two_vs_one:7.2f}  (target >= 1.8 x 1 worker)")
    result = {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "raw": raw, "rlcore_1": one, "rlcore_2": two,
              "one_worker_vs_raw": round(one_vs_raw, 3), "two_workers_vs_one": round(two_vs_one, 3),
              "targets": {"one_worker_vs_raw": 0.9, "two_workers_vs_one": 1.8},
              "work": f"{PROMPTS} prompts x {CANDIDATES} candidates x <= {TOKENS} tokens, Qwen2-0.5B shape, bf16, "
                      f"orm 'toy' on a CPU worker, batches of {BATCH} after a {WARMUP}-prompt warm-up"}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
