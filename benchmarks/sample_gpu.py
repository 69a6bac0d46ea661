"""Best-of-N sampling on GPUs: candidates per second of rlcore's `sample` as a user runs it (`rlcore run --plugin
sample --use-ray --config examples/ray/sample/sampling.yaml`, scaled to this host: 1 vLLM sampler worker, and 2
where there are two GPUs) against raw `vllm.LLM.generate` of the same prompts and settings, interleaved in rounds.

rlcore's side keeps the example's settings (vLLM's memory share, seed_per_prompt, n_best_to_keep, dtype auto)
except the keys both sides must share: the model, the data, the candidates, the lengths and the batch (`SHARED`);
raw vLLM gets rlcore's resolved values of its settings (`peer_of`). Raw vLLM scores nothing, so rlcore's side keeps
only the ORM (the `toy` reward function) and drops the example's process reward model, its scorers on a CPU worker
(`OWN`): listed in the table with the example.

The work: 256 prompts of the toy task x 8 candidates x up to 256 tokens from the random-weight Qwen2-0.5B-shaped
model (bf16 checkpoint, as grpo_gpu.py builds it, drawn on the GPU once), batches of 128 prompts committed to its
JSONL after each; a first batch of 128 more prompts warms it up and is not timed (its time comes from
metrics.jsonl). Raw vLLM warms up on the same 128 prompts, then generates the 256 in the same batches of 128 (one
`generate` call each, as rlcore's steps), with vLLM's defaults otherwise (log-probs off, detokenising on). The sides
run raw, rlcore1, raw, rlcore1 (`--rounds`, default 2), each in a process of its own; the table gives each round's
ratio, their median and range.

What rlcore's step adds to the raw calls, from reading the path (plugins/sampling/trainer.py, sources.py,
plugins/vllm/engine.py): chat-template encoding of the batch's prompts on the driver, one Ray call to the
sampler actor and the candidates' token ids back, decoding each candidate once, the ORM's Ray call, best-of-N
selection and an fsync'd commit; the phases printed say where the time goes.

    python benchmarks/sample_gpu.py                  # raw + 1 worker on one H200 (+ 2 workers with 2 GPUs), ~5 min
    python benchmarks/sample_gpu.py --only rlcore1   # one side
    python benchmarks/sample_gpu.py --smoke --rounds 1   # a tiny model on the CPU, hf engines in vLLM's place

`--json PATH` (default benchmarks/results/sample_gpu-<date>-<kind>.json) is written after each side; a side that
fails is recorded and the others still run.

Targets, by the median over the rounds: one worker >= 0.98x raw vLLM (the pipeline's cost under 2%); two workers
on two GPUs >= 1.8x one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fair import (build_model, failure, git_commit, interleave, print_provenance, provenance, results_path, rlcore_run,
                  run_child, scaled, spread, spread_text, user_config, write_json)
from grpo_gpu import SHAPE

PROMPTS, WARMUP, CANDIDATES, TOKENS, BATCH = 256, 128, 8, 256, 128
EXAMPLE = "sample/sampling.yaml"
# --smoke: a tiny model on the CPU, 8 prompts (after 4 of warm-up) x 4 candidates x 8 tokens in batches of 4; raw
# vLLM's side generates with rlcore's hf rollout engine there, rlcore's sampler is an hf engine on a CPU worker
SMOKE_SHAPE = dict(hidden_size=64, num_layers=2, vocab_size=1024, max_position_embeddings=2048)
SMOKE_WORK = dict(PROMPTS=8, WARMUP=4, CANDIDATES=4, TOKENS=8, BATCH=4)  # 4 candidates: the example keeps 2
# rlcore's own keys: the ORM alone (raw vLLM scores nothing), a function on a CPU worker
OWN: dict[str, Any] = {"prm_model": None, "orm_model": "toy", "device_groups.rm_group.device": "CPU",
                       "device_groups.rm_group.ranks": 1, "device_groups.rm_group.workers": ["orm"]}


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


def shared_keys(model: str, data: Path, smoke: bool) -> dict[str, Any]:
    """The keys set on rlcore's example and given to raw vLLM alike: the model, the data, candidates, lengths, batch
    (the example's max_prompt_length, 2048, plus 256 new tokens is longer than the model's context)."""
    _, _, candidates, tokens, batch = work(smoke)
    return {"model": model, "dataset": str(data), "num_return_sequences": candidates, "max_new_tokens": tokens,
            "batch_size": batch, "max_prompt_length": 512}


def rlcore_keys(model: str, data: Path, out: Path, workers: int,
                gpu: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(shared, scaling, own) keys of an rlcore side: the GPU run's (`gpu`), or --smoke's run on the CPU."""
    scale = {**scaled(EXAMPLE, workers if gpu else 0), "output_dir": str(out)}
    if not gpu:
        scale["device_groups.sample_group.ranks"] = workers
    own = {**OWN, **({} if gpu else {"sampler_engine": "hf"})}
    return shared_keys(model, data, smoke=not gpu), scale, own


def flat(parts: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return {k: v for part in parts for k, v in part.items()}


def peer_of(config: Any) -> dict[str, Any]:
    """Raw vLLM's settings with the values rlcore's run resolved."""
    return {"n": config.num_return_sequences, "max_tokens": config.max_new_tokens, "temperature": config.temperature,
            "top_p": config.top_p, "gpu_memory_utilization": config.sampler.vllm_gpu_memory_utilization,
            "max_model_len": config.sampler.vllm_max_model_len}


def run_raw(model: str, data: Path, peer: dict[str, Any], smoke: bool = False) -> dict:
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
        sampling = SamplingParams(n=peer["n"], max_tokens=peer["max_tokens"], temperature=peer["temperature"],
                                  top_p=peer["top_p"], stop_token_ids=stop, logprobs=False)

        def generate(prompts: list[list[int]]) -> list[list[int]]:
            return [g.token_ids for g in engine.generate(prompts, sampling)]
    else:
        import vllm

        llm = vllm.LLM(model=model, gpu_memory_utilization=peer["gpu_memory_utilization"],
                       max_model_len=peer["max_model_len"], seed=0)  # dtype: vLLM's own default, auto
        params = vllm.SamplingParams(n=peer["n"], max_tokens=peer["max_tokens"], temperature=peer["temperature"],
                                     top_p=peer["top_p"], stop_token_ids=stop)

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
            "settings": {**peer, "logprobs": None, "detokenize": True, "batches_of": batch, "seed": 0,
                         "engine": "hf (--smoke)" if smoke else "vllm.LLM"}}


def run_rlcore(keys: dict[str, Any], tmp: Path, name: str, settings: dict[str, Any], smoke: bool) -> dict:
    """An rlcore side, one round: `rlcore run --plugin sample --use-ray` on the example; its timed batches from
    output_dir/metrics.jsonl (the warm-up batch left out)."""
    _, warmup, _, _, batch = work(smoke)
    run = rlcore_run("sample", EXAMPLE, keys, tmp, name, use_ray=True)
    lines = (Path(keys["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    batches = [json.loads(line) for line in lines][warmup // batch:]
    seconds = sum(b["prompts"] / b["prompts_per_s"] for b in batches)
    phases = sorted({k for b in batches for k in b if k.startswith("time/")})
    candidates = sum(b["candidates"] for b in batches)
    return {"seconds": seconds, "candidates": candidates, "candidates_per_s": candidates / seconds,
            "pass_rate": sum(b["pass_rate"] for b in batches) / len(batches), "wall_s": run["wall_s"],
            "phases_s": {k.removeprefix("time/"): round(sum(b.get(k, 0.0) for b in batches), 3) for k in phases},
            "settings": settings}


def raw_child(model: str, data: Path, tmp: Path, name: str, smoke: bool = False) -> dict:
    out = tmp / f"{name}.json"
    run_child([sys.executable, __file__, "--run", "raw", "--model", model, "--data", str(data), "--out", str(out),
               "--peer", str(tmp / "peer.json")] + (["--smoke"] if smoke else []))
    result = json.loads(out.read_text())
    result["candidates_per_s"] = result["candidates"] / result["seconds"]
    return result


def gpu_count() -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                         text=True)
    return int(out.stdout.strip() or 0)


LABELS = {"raw": "raw vllm.LLM.generate", "rlcore1": "rlcore sample, 1 worker", "rlcore2": "rlcore sample, 2 workers"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="default benchmarks/results/sample_gpu-<date>-<kind>.json")
    parser.add_argument("--kind", default=os.environ.get("RLCORE_MACHINE_KIND", "nvidia-h200"), help="for the record")
    parser.add_argument("--only", choices=["raw", "rlcore1", "rlcore2"], action="append", help="run this side (repeatable)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the sides, interleaved (default 2)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, hf engines for vLLM: the code "
                        "paths only (rlcore's GPU config is built there too)")
    parser.add_argument("--run", choices=["raw"], help=argparse.SUPPRESS)
    for flag in ("--model", "--data", "--out", "--peer"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        result = run_raw(args.model, Path(args.data), json.loads(Path(args.peer).read_text()), args.smoke)
        Path(args.out).write_text(json.dumps(result))
        return

    started = time.perf_counter()
    wanted = args.only or ["raw", "rlcore1"] + (["rlcore2"] if not args.smoke and gpu_count() >= 2 else [])
    path = results_path(args.json, f"sample_gpu-{time.strftime('%Y-%m-%d')}-{args.kind}.json", args.smoke)
    kept = json.loads(path.read_text()).get("sides", {}) if args.only and path.exists() else {}
    sides: dict[str, dict] = {}  # sides run in calls of their own (--only) add up in one file
    rounds: list[dict[str, dict]] = []
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_model(tmp / "qwen2-0.5b-shaped", SHAPE, SMOKE_SHAPE if args.smoke else None)
        data = prompts_file(tmp, args.smoke)
        keys, settings = {}, {}
        for what in [w for w in wanted if w != "raw"] or ["rlcore1"]:  # raw's settings are rlcore1's
            workers = int(what[-1])
            # the GPU run's config, loaded and checked as `rlcore config validate` does (on the CPU too, under --smoke)
            gpu = rlcore_keys(model, data, tmp / f"out-{what}", workers, gpu=True)
            gpu_config = user_config("sample", EXAMPLE, flat(gpu))
            run = rlcore_keys(model, data, tmp / f"out-{what}", workers, gpu=not args.smoke)
            config = user_config("sample", EXAMPLE, flat(run)) if args.smoke else gpu_config
            keys[what], runs[what] = flat(run), provenance(EXAMPLE, *run)
            settings[what] = {**peer_of(config), "workers": workers, "sampler": config.sampler.engine,
                              "dtype": config.sampler.dtype, "orm_model": config.orm_model,
                              "prm_model": config.prm_model, "seed_per_prompt": config.seed_per_prompt,
                              "n_best_to_keep": config.n_best_to_keep, "batch_size": config.batch_size}
            if what == "rlcore1" or "rlcore1" not in wanted:
                (tmp / "peer.json").write_text(json.dumps(peer_of(config)))
        for index, what in interleave(wanted, args.rounds):
            while len(rounds) <= index:
                rounds.append({})
            name = f"{what}-{index + 1}"
            try:
                if what == "raw":
                    row = raw_child(model, data, tmp, name, args.smoke)
                else:
                    row = run_rlcore({**keys[what], "output_dir": str(tmp / f"out-{name}")}, tmp, name, settings[what],
                                     args.smoke)
            except Exception as error:  # noqa: BLE001 - the other sides still run; the child's log says why
                row = failure(error)
            row["commit"] = git_commit()
            print(json.dumps({what: row}))
            rounds[index][what] = row
            done = [r[what] for r in rounds if "candidates_per_s" in r.get(what, {})]
            sides[what] = {**row, "rounds": [r[what] for r in rounds if what in r]}
            if done:
                sides[what]["candidates_per_s"] = statistics.median(r["candidates_per_s"] for r in done)
            write_json(path, record({**kept, **sides}, rounds, runs, args, started))
    result = record({**kept, **sides}, rounds, runs, args, started)
    write_json(path, result)
    print(f"\n{'':28} {'round':>6} {'seconds':>8} {'candidates/s':>13}")
    for index, done in enumerate(rounds):
        for what, side in done.items():
            if "failed" in side:
                print(f"{LABELS[what]:28} {index + 1:>6} FAILED: {side['failed']}")
                continue
            print(f"{LABELS[what]:28} {index + 1:>6} {side['seconds']:8.2f} {side['candidates_per_s']:13.1f}"
                  + (f"   phases: {side['phases_s']}" if "phases_s" in side else ""))
    for key, value in result["ratios"].items():
        target = result["targets"][key]
        print(f"{key}: {spread_text(result['ratio_rounds'][key])} (target >= {target} by the median: "
              f"{'met' if result['met'][key] else 'NOT met'})")
    print_provenance({"rlcore_runs": {LABELS[w]: r for w, r in runs.items()}})
    measured = {k: v for k, v in result["sides"].items() if "failed" not in v}
    if "raw" in measured and "rlcore1" in measured:
        raw, one = measured["raw"], measured["rlcore1"]
        gap, generate = one["seconds"] - raw["seconds"], one["phases_s"].get("generate", 0.0)
        print(f"rlcore's extra {gap:.2f} s (last round): generate phase {generate - raw['seconds']:+.2f} s over raw "
              f"(encoding, Ray call, decoding), the rest scoring, selection and writing: {one['phases_s']}")
    print(f"wrote {path}")
    failed = sorted({what for done in rounds for what, side in done.items() if "failed" in side})
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def record(sides: dict[str, dict], rounds: list[dict[str, dict]], runs: dict[str, dict], args: argparse.Namespace,
           started: float) -> dict:
    """The results JSON: every side's row (settings and commit included; each round's under `rounds`), rlcore's
    example and keys, the per-round ratios with their median and range, and the targets met by the median."""
    pairs = {"one_worker_vs_raw": ("rlcore1", "raw", 0.98), "two_workers_vs_one": ("rlcore2", "rlcore1", 1.8)}
    ratios, spreads, met = {}, {}, {}
    for key, (ours, base, target) in pairs.items():
        values = [r[ours]["candidates_per_s"] / r[base]["candidates_per_s"] for r in rounds
                  if "candidates_per_s" in r.get(ours, {}) and "candidates_per_s" in r.get(base, {})]
        if values:
            spreads[key] = spread(values)
            ratios[key] = spreads[key]["median"]
            met[key] = ratios[key] >= target
    prompts, warmup, candidates, tokens, batch = work(args.smoke)
    return {"kind": args.kind, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "smoke": args.smoke,
            "sides": sides, "rlcore_runs": runs, "ratios": ratios, "ratio_rounds": spreads, "met": met,
            "targets": {"one_worker_vs_raw": 0.98, "two_workers_vs_one": 1.8},
            "wall_s": round(time.perf_counter() - started, 1),
            "work": f"{prompts} prompts x {candidates} candidates x <= {tokens} tokens, Qwen2-0.5B shape, bf16 checkpoint, "
                    f"orm 'toy' on a CPU worker, batches of {batch} after a {warmup}-prompt warm-up"}

if __name__ == "__main__":
    main()
