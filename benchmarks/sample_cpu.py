"""Best-of-N sampling on the CPU: candidates per second of rlcore's `sample` (hf sampler, one process, no Ray,
every candidate scored by the registered `toy` reward function) against raw transformers `model.generate` of
the same prompts with the same settings, in the same run.

The work: `--prompts` prompts of the toy task (rlcore.testing) x `CANDIDATES` candidates x up to `TOKENS`
new tokens from the tiny random-weight Qwen2-style model of sft_cpu.py (float32), temperature 1.0, top_p 0.95, no
top-k, stopping at the tokenizer's eos and pad tokens on both sides (rlcore's stop ids). Both sides go through
the prompts in batches of `BATCH` prompts; the first batch warms up and is not timed.

rlcore's `sample` is run three ways (rows labelled):
- seed_per_prompt false: one engine call per batch (BATCH prompts x CANDIDATES rows);
- seed_per_prompt true (rlcore's default): one engine call per prompt, each with a seed of its own, so the output
  does not depend on the batch or the worker count;
and its time is everything between two batches' ends on the driver: prompt encoding, the hf engine's sampling loop
(which also keeps each token's log-prob and drops finished rows from the KV cache), decoding, the `toy` reward
on every candidate, best-of-N selection, the fsync'd JSONL commit, metrics.jsonl and the progress bar. The raw side
is `model.generate(do_sample=True, num_return_sequences=CANDIDATES)` on the batch's left-padded prompts plus
`batch_decode`, nothing else (no scoring, no output); a second raw row makes one call per prompt, the call
granularity of seed_per_prompt true. Each run's order is raw, rlcore (false), rlcore (true), raw per prompt,
repeated `--repeats` times; the result is the median per side.

    OMP_NUM_THREADS=1 python benchmarks/sample_cpu.py --json benchmarks/results/sample_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sft_cpu import SHAPE

PROMPTS, BATCH, CANDIDATES, TOKENS = 64, 16, 8, 48
TEMPERATURE, TOP_P, TOP_K, SEED = 1.0, 0.95, 0, 0


def prompts_file(tmp: Path, n: int) -> Path:
    from rlcore.testing import toy_dataset

    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in toy_dataset(n, seed=0)))
    return path


def run_rlcore(model: str, data: Path, out: Path, seed_per_prompt: bool) -> dict[str, Any]:
    from rlcore import hookimpl, load_plugins
    from rlcore.plugins.sampling import SampleConfig, SampleTrainer

    stamps: list[dict] = []

    class Clock:
        @hookimpl
        def rlcore_step_end(self, trainer, step, metrics):
            stamps.append({"t": time.perf_counter(), **{k: metrics.get(k) for k in (
                "candidates", "candidates/mean_chars", "time/generate", "time/score", "time/write", "pass_rate")}})

    plugins = load_plugins()
    plugins.register(Clock(), "clock")
    config = SampleConfig(
        model=model, dataset=str(data), output_dir=str(out), num_return_sequences=CANDIDATES, max_new_tokens=TOKENS,
        temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, seed=SEED, batch_size=BATCH, seed_per_prompt=seed_per_prompt,
        orm_model="toy", n_best_to_keep=1, sampler={"engine": "hf", "dtype": "float32"},
    )
    trainer = SampleTrainer(config, plugins, use_ray=False)
    stop_ids = list(trainer.encoder.stop_ids)
    trainer.fit()
    timed = stamps[1:]  # the first batch warms up
    candidates = sum(s["candidates"] for s in timed)
    return {
        "seconds": stamps[-1]["t"] - stamps[0]["t"], "candidates": candidates,
        "mean_chars": sum(s["candidates/mean_chars"] * s["candidates"] for s in timed) / candidates,
        "generate_s": sum(s["time/generate"] for s in timed), "score_s": sum(s["time/score"] for s in timed),
        "write_s": sum(s["time/write"] for s in timed), "pass_rate": statistics.mean(s["pass_rate"] for s in timed),
        "stop_token_ids": stop_ids,
    }


class Raw:
    """transformers' generate on the same prompts: the model loaded once, as a user of transformers would."""

    def __init__(self, model: str, data: Path, stop_ids: list[int]):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlcore.data import PromptEncoder

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        encoder = PromptEncoder(model)  # the same prompt ids as rlcore's (chat template, generation prompt)
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        self.ids = [encoder.encode(r["prompt"]) for r in rows]
        self.stop_ids = stop_ids
        self.settings = dict(do_sample=True, num_return_sequences=CANDIDATES, max_new_tokens=TOKENS,
                             temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, eos_token_id=stop_ids,
                             pad_token_id=self.tokenizer.pad_token_id)

    def generate(self, prompts: list[list[int]]) -> list[str]:
        batch = self.tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        with self.torch.inference_mode():
            out = self.model.generate(**batch, **self.settings)
        return self.tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    def run(self, per_prompt: bool) -> dict[str, Any]:
        self.torch.manual_seed(SEED)
        batches = [self.ids[i : i + BATCH] for i in range(0, len(self.ids), BATCH)]
        self.generate(batches[0] if not per_prompt else batches[0][:1])  # warm-up
        texts: list[str] = []
        started = time.perf_counter()
        for batch in batches[1:]:
            for part in ([[p] for p in batch] if per_prompt else [batch]):
                texts += self.generate(part)
        return {"seconds": time.perf_counter() - started, "candidates": len(texts),
                "mean_chars": sum(map(len, texts)) / len(texts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="timed prompts (one more batch warms up)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every side, interleaved")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1),
                        help="torch threads, both sides")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    import transformers

    from rlcore.testing import build_tiny_model

    load_before = os.getloadavg()  # other work on the machine shows here
    sides = ("raw", "rlcore_batched", "rlcore_seed_per_prompt", "raw_per_prompt")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory(prefix="rlcore-sample-cpu-") as tmp_dir:
        tmp = Path(tmp_dir)
        model = str(build_tiny_model(tmp / "tiny", **SHAPE))
        data = prompts_file(tmp, BATCH + args.prompts)
        stop_ids = _stop_ids(model)  # rlcore's: the tokenizer's eos and pad tokens
        raw = Raw(model, data, stop_ids)
        for r in range(args.repeats):
            for side in sides:
                if side.startswith("rlcore"):
                    result = run_rlcore(model, data, tmp / f"{side}-{r}", side == "rlcore_seed_per_prompt")
                    assert result["stop_token_ids"] == stop_ids, (result["stop_token_ids"], stop_ids)
                else:
                    result = raw.run(per_prompt=side == "raw_per_prompt")
                result["candidates_per_s"] = result["candidates"] / result["seconds"]
                runs[side].append(result)
                print(f"run {r + 1}/{args.repeats} {side}: {result['candidates_per_s']:.1f} candidates/s",
                      file=sys.stderr, flush=True)

    def median_of(side: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[side])

    raw_cps = median_of("raw", "candidates_per_s")
    labels = {
        "raw": "raw model.generate, one call per batch",
        "rlcore_batched": "rlcore sample, seed_per_prompt false",
        "rlcore_seed_per_prompt": "rlcore sample, seed_per_prompt true *",
        "raw_per_prompt": "raw model.generate, one call per prompt",
    }
    result: dict[str, Any] = {
        "benchmark": "sample_cpu",
        "candidates_per_s": {s: round(median_of(s, "candidates_per_s"), 2) for s in sides},
        "ratio_vs_raw": {s: round(median_of(s, "candidates_per_s") / raw_cps, 3) for s in sides},
        "ratio_seed_per_prompt_vs_raw_per_prompt": round(
            median_of("rlcore_seed_per_prompt", "candidates_per_s") / median_of("raw_per_prompt", "candidates_per_s"), 3),
        "mean_chars": {s: round(median_of(s, "mean_chars"), 2) for s in sides},
        "rlcore_phases_s": {s: {k: round(median_of(s, k), 3) for k in ("generate_s", "score_s", "write_s")}
                            for s in sides if s.startswith("rlcore")},
        "per_run": {s: [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items()} for run in rs]
                    for s, rs in runs.items()},
        "labels": labels,
        "work": f"{args.prompts} timed prompts (after a {BATCH}-prompt warm-up batch) x {CANDIDATES} candidates x <= "
                f"{TOKENS} new tokens, batches of {BATCH} prompts; toy task prompts, tiny Qwen2 shape, float32",
        "settings": {"num_return_sequences": CANDIDATES, "max_new_tokens": TOKENS, "temperature": TEMPERATURE,
                     "top_p": TOP_P, "top_k": TOP_K, "seed": SEED, "batch_size": BATCH, "orm_model": "toy",
                     "stop_token_ids": runs["rlcore_batched"][0]["stop_token_ids"]},
        "model": {**SHAPE, "dtype": "float32"},
        "repeats": args.repeats,
        "torch_threads": args.threads,
        "load_average_1_5_15min": {"before": [round(x, 2) for x in load_before],
                                   "after": [round(x, 2) for x in os.getloadavg()]},
        "environment": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__, "transformers": transformers.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"\nBest-of-{CANDIDATES} sampling on the CPU, {args.threads} torch thread(s); {result['work']}; "
          f"temperature {TEMPERATURE}, top_p {TOP_P}, top_k off; median of {args.repeats} interleaved runs")
    print(f"{'side':<42}{'seconds':>9}{'candidates/s':>14}{'vs raw':>8}{'mean chars':>12}")
    for s in sides:
        print(f"{labels[s]:<42}{median_of(s, 'seconds'):>9.2f}{median_of(s, 'candidates_per_s'):>14.1f}"
              f"{result['ratio_vs_raw'][s]:>8.3f}{median_of(s, 'mean_chars'):>12.1f}")
    print(f"  * one engine call per prompt; against raw one call per prompt: "
          f"{result['ratio_seed_per_prompt_vs_raw_per_prompt']:.3f}")
    for s, phases in result["rlcore_phases_s"].items():
        print(f"  {labels[s].rstrip(' *')}: generate {phases['generate_s']:.2f} s, toy reward "
              f"{phases['score_s']:.3f} s, JSONL commit {phases['write_s']:.3f} s")
    print("rlcore's time includes scoring, selection and the output; raw's is generate + batch_decode only")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


def _stop_ids(model: str) -> list[int]:
    from rlcore.data import PromptEncoder

    return list(PromptEncoder(model).stop_ids)


if __name__ == "__main__":
    main()
