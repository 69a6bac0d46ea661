"""SFT from the command line on two GPUs (nvidia-h200-x2), as a user runs it:
`rlcore run --plugin sft --use-ray --config examples/ray/sft/multi_node.yaml key=value`, scaled down from two
nodes of 8 GPUs to one node of 2, with `packing` on and off.

The model is Qwen2-0.5B's shape (hidden 896, 14 heads, 2 KV heads, MLP 4864, vocabulary 32000) with 4 layers
instead of 24, random bf16 weights, built offline; the data is synthetic chat rows of mixed lengths. Each run
must exit 0 after 6 steps, write them to metrics.jsonl with a falling loss, print the placement (two workers on
GPUs 0-1, one data-parallel world), and its workers must have trained over NCCL on their own GPUs: a plugin file
passed with --with records each worker's place (`where()`: rank, world, backend, device) after step 1.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray" / "sft" / "multi_node.yaml"
STEPS = 6
TIMEOUT_S = 420
SHAPE = dict(hidden_size=896, num_layers=4, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")
TWO_GPUS = ["device_groups.nproc_per_node=2", "device_groups.nnodes=1", "device_groups.default.ranks=[0,1]",
            "ray_address=null"]
PLACES = textwrap.dedent('''
    """Writes each worker's place after step 1 to {output_dir}/places.json."""
    import json
    from pathlib import Path

    from rlcore import hookimpl


    @hookimpl
    def rlcore_step_end(trainer, step, metrics):
        if step == 1:
            places = trainer.session["default"].where()
            (Path(trainer.config.output_dir) / "places.json").write_text(json.dumps(places))
''')


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Conversations of mixed lengths (a few words to a few hundred), as synthetic SFT data."""
    rng = random.Random(seed)
    words = "the a model learns to answer questions about numbers and words with care".split()
    rows = []
    for i in range(n):
        question = " ".join(rng.choices(words, k=rng.randint(4, 40)))
        answer = " ".join(rng.choices(words, k=rng.randint(8, 300)))
        rows.append({"messages": [{"role": "user", "content": f"{i}: {question}?"},
                                  {"role": "assistant", "content": answer}]})
    return rows


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    root = tmp_path_factory.mktemp("sft-gpu")
    model = build_tiny_model(root / "qwen2-0.5b-shape-4-layers", **SHAPE)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(512)))
    return str(model), str(data)


@pytest.mark.parametrize("packing", [True, False], ids=["packing", "padding"])
def test_two_workers_train_over_nccl_from_the_cli(model_and_data, tmp_path, packing):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (two data-parallel workers over NCCL); this machine has {torch.cuda.device_count()}")
    model, data = model_and_data
    out = tmp_path / "run"
    (tmp_path / "places.py").write_text(PLACES)
    cmd = [sys.executable, "-m", "rlcore", "run", "--plugin", "sft", "--with", str(tmp_path / "places.py"), "--use-ray",
           "--config", str(EXAMPLE), *TWO_GPUS, f"model={model}", f"dataset={data}", f"output_dir={out}",
           f"max_steps={STEPS}", f"packing={str(packing).lower()}", "max_length=1024", "learning_rate=1e-3",
           "lr_scheduler_type=constant", "warmup_steps=0", "per_device_train_batch_size=4",
           "gradient_accumulation_steps=1", "save_steps=3"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, start_new_session=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "rlcore: default: 2 workers, GPU 0-1, engine build_sft" in done.stderr
    assert "rlcore: sft: 2 data-parallel rank(s), global batch 8" in done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["algorithm"] == "sft" and summary["step"] == STEPS
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [m["loss"] for m in metrics]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert curve[-1] < curve[0], curve
    places = json.loads((out / "places.json").read_text())
    assert [p["rank"] for p in places] == ["0", "1"] and {p["world_size"] for p in places} == {"2"}
    assert {p["backend"] for p in places} == {"nccl"} and {p["device"] for p in places} == {"cuda:0"}  # each its GPU
    for step in (3, STEPS):
        assert (out / f"checkpoint-{step}" / "model" / "optimizer.pt").is_file()
    rows = int(re.search(r"global batch 8, (\d+) training rows", done.stderr).group(1))
    if packing:  # 512 conversations of mixed lengths packed into fewer sequences of up to 1024 tokens
        assert rows < 512, rows
    else:
        assert rows == 512, rows
