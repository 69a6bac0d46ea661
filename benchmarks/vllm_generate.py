"""One GRPO round of generation on one GPU: rlcore's vLLM engine against raw vLLM, and what each option costs.

The work of `grpo_gpu.py`'s rollout: 8 prompts x 8 completions x 256 tokens from the random-weight
Qwen2-0.5B-shaped model, bf16. In one engine it times raw `LLM.generate` (no log-probs, no seeds, no text)
and then adds one thing at a time (text, per-request seeds, the sampled tokens' log-probs), then rlcore's
`VLLMRolloutEngine.generate` as GRPO calls it. It runs once with the engine core in the calling process
and once in processes of its own (`vllm_in_process=False`).

    python benchmarks/vllm_generate.py [--json PATH]

The table gives the median seconds of 3 rounds after a warm-up, tokens/s, and the ratio to raw vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpo_gpu import GENERATIONS, GPU_MEMORY, PROMPTS, SHAPE, TOKENS

ROUNDS = 3


def run_child(model: str, in_process: bool) -> list[dict]:
    from transformers import AutoTokenizer

    from rlcore import SamplingParams
    from rlcore.testing import toy_dataset
    from rlcore.plugins.vllm import VLLMRolloutEngine

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True)
               for r in toy_dataset()[:PROMPTS]]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    engine = VLLMRolloutEngine(model=model, vllm_gpu_memory_utilization=GPU_MEMORY, vllm_max_model_len=1024,
                               vllm_in_process=in_process, dtype="bfloat16", seed=0)
    vllm = engine._vllm

    def raw(**extra):
        params = dict(n=GENERATIONS, max_tokens=TOKENS, temperature=1.0, detokenize=False)
        params.update(extra)

        def call():
            outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], vllm.SamplingParams(**params), use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)
        return call

    def ours(seed):
        def call():
            gens = engine.generate(prompts, SamplingParams(n=GENERATIONS, max_tokens=TOKENS, temperature=1.0, seed=seed))
            return sum(len(g.token_ids) for g in gens)
        return call

    variants = [
        ("raw vLLM", raw()),
        ("raw + text", raw(detokenize=True)),
        ("raw + seed", raw(seed=1234)),
        ("raw + logprobs", raw(logprobs=0)),
        ("rlcore generate", ours(None)),
        ("rlcore generate, seeded", ours(1234)),
    ]
    rows = []
    for name, call in variants:
        call()  # warm-up
        seconds, tokens = [], 0
        for _ in range(ROUNDS):
            start = time.perf_counter()
            tokens = call()
            seconds.append(time.perf_counter() - start)
        rows.append({"variant": name, "in_process": in_process, "seconds": statistics.median(seconds), "tokens": tokens})
        print(f"  {name:<28}{rows[-1]['seconds']:.3f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="where to write the results")
    parser.add_argument("--kind", default="nvidia-h200", help="machine kind, for the record")
    parser.add_argument("--child", choices=["in_process", "core_processes"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.out).write_text(json.dumps(run_child(args.model, args.child == "in_process")))
        return

    from rlcore.testing import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = str(build_tiny_model(tmp / "qwen2-0.5b-shaped", **SHAPE))
        for child in ("in_process", "core_processes"):  # one vLLM per process
            out = tmp / f"{child}.json"
            print(f"{child}:", flush=True)
            subprocess.run([sys.executable, __file__, "--child", child, "--model", model, "--out", str(out)], check=True)
            rows += json.loads(out.read_text())

    floor = {r["in_process"]: r["seconds"] for r in rows if r["variant"] == "raw vLLM"}
    print(f"\n{'variant':<28}{'engine core':<16}{'seconds':>9}{'tokens/s':>10}{'vs raw':>8}")
    for r in rows:
        r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1)
        r["ratio"] = round(r["seconds"] / floor[r["in_process"]], 3)
        where = "in process" if r["in_process"] else "own processes"
        print(f"{r['variant']:<28}{where:<16}{r['seconds']:>9.3f}{r['tokens_per_s']:>10.0f}{r['ratio']:>8.2f}")
    result = {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "rows": rows,
              "work": f"{PROMPTS} prompts x {GENERATIONS} completions x {TOKENS} tokens, Qwen2-0.5B shape, bf16, median of {ROUNDS}"}
    path = Path(args.json or f"benchmarks/results/vllm_generate-{time.strftime('%Y-%m-%d')}-{args.kind}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
