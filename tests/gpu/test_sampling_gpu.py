"""Sampling and distillation on GPUs (nvidia-h200-x2), from the command line as a user runs them:

- examples/ray/sample/sampling.yaml scaled to two GPUs: vLLM samplers on GPU 0, a PRM and a reward model (ORM)
  sharing GPU 1; the run writes samples.jsonl, each row with a rejected partner, and places the roles as asked;
- the same run with seed_per_prompt on (the ORM on a CPU worker), once with one sampler worker and once with
  two: the same bytes;
- distill against `vllm serve` started here on 127.0.0.1, with examples/ray/sample/distill.yaml.

Models are built offline: the Qwen2-0.5B shape with 4 layers, random bf16 weights (as test_grpo_cli.py builds
it), a one-label reward model and a two-label token-classification PRM of the tiny shape.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray" / "sample"
SHAPE = dict(hidden_size=896, num_layers=4, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {"policy": str(build_tiny_model(root / "policy", **SHAPE)),
            "orm": str(build_tiny_model(root / "orm", num_labels=1, seed=1)),
            "prm": str(build_tiny_model(root / "prm", num_labels=2, seed=2))}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {a + 1}?"},
                          {"role": "assistant", "content": str(2 * a + 1)}], "solution": str(2 * a + 1)} for a in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rlcore(*args, timeout=TIMEOUT_S):
    done = subprocess.run([sys.executable, "-m", "rlcore", "run", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


TWO_GPUS = ["device_groups.nproc_per_node=2", "device_groups.sample_group.ranks=[0]", "device_groups.rm_group.ranks=[1]",
            "sampler.vllm_gpu_memory_utilization=0.5", "sampler.vllm_max_model_len=1024", "prm.engine_kwargs={}",
            "prm_step_token=null", "num_return_sequences=4", "n_best_to_keep=1", "max_new_tokens=64", "batch_size=8",
            "max_prompt_length=512"]  # with max_new_tokens, within vllm_max_model_len


def needs_two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (a sampler group and a reward group); this machine has {torch.cuda.device_count()}")


def test_the_sampling_example_on_two_gpus(models, dataset, tmp_path):
    needs_two_gpus()
    out = tmp_path / "run"
    done = rlcore("--plugin", "sample", "--use-ray", "--config", str(EXAMPLES / "sampling.yaml"), *TWO_GPUS,
                  f"model={models['policy']}", f"prm_model={models['prm']}", f"orm_model={models['orm']}",
                  f"dataset={dataset}", f"output_dir={out}", "orm_threshold=-1e9", "prm_threshold=0")
    assert "rlcore: sampler: 1 worker, GPU 0, engine vllm" in done.stderr
    assert "rlcore: prm: 1 worker, GPU 1 (shared with orm), engine scorer" in done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert summary["prompts"] == 24 and summary["rows"] == len(rows) > 0
    assert all("rejected_response" in r and len(r["id"]) == 32 and r["solution"] for r in rows)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(m["prompts_per_s"] > 0 and 0 <= m["pass_rate"] <= 1 for m in metrics)


def test_seeded_prompts_give_the_same_file_on_one_or_two_sampler_workers(models, dataset, tmp_path):
    needs_two_gpus()
    outputs = []
    for ranks in ("[0]", "[0,1]"):
        out = tmp_path / f"ranks{len(json.loads(ranks))}"
        rlcore("--plugin", "sample", "--use-ray", "--config", str(EXAMPLES / "sampling.yaml"), *TWO_GPUS,
               f"device_groups.sample_group.ranks={ranks}", "device_groups.rm_group.device=CPU",
               "device_groups.rm_group.ranks=1", "device_groups.rm_group.workers=[orm]", "orm.engine_kwargs={}",
               "seed_per_prompt=true", "prm_model=null",
               f"model={models['policy']}", f"orm_model={models['orm']}", f"dataset={dataset}", f"output_dir={out}",
               "orm_threshold=-1e9")
        outputs.append((out / "samples.jsonl").read_bytes())
    assert outputs[0] == outputs[1] and outputs[0].count(b"\n") == 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distill_against_vllm_serve(models, dataset, tmp_path):
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", models["policy"], "--host", "127.0.0.1",
         "--port", str(port), "--gpu-memory-utilization", "0.4", "--max-model-len", "1024", "--dtype", "bfloat16"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not answer in time"
                time.sleep(2)
        out = tmp_path / "distill"
        done = rlcore("--plugin", "distill", "--config", str(EXAMPLES / "distill.yaml"), f"api_base=http://127.0.0.1:{port}/v1",
                      f"model={models['policy']}", f"dataset={dataset}", f"output_dir={out}", "max_new_tokens=32",
                      "num_return_sequences=2", "batch_size=8")
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert json.loads(done.stdout.splitlines()[-1])["rows"] == len(rows) == 48
        assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][0]["content"].startswith("What is")
                   for r in rows)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
