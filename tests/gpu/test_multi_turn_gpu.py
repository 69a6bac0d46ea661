"""Multi-turn GRPO on one GPU with vLLM colocated (examples/multi_turn/vllm_colocate.yaml, scaled): the hint
environment of the CPU demo on a random Qwen2-0.5B-shaped model, episodes run by vLLM's request loop. The run
must exit 0, take more than one turn per episode, and the train engine's log-probs of the generated tokens must
match vLLM's across turns (the sampling difference)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def test_multi_turn_grpo_on_vllm_colocated(tmp_path):
    from rlcore.testing import build_tiny_model

    model = build_tiny_model(tmp_path / "model", hidden_size=896, num_layers=4, num_heads=14, num_kv_heads=2,
                             intermediate_size=4864, vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say a word {i}:", "target": "aeiou"}) + "\n" for i in range(64)))
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", "--plugin", "grpo", "--use-ray", "--config",
         "examples/multi_turn/vllm_colocate.yaml", f"model={model}", f"dataset={data}", f"output_dir={out}",
         "multi_turn_scheduler=examples/multi_turn/vowel_hint.py:VowelHint", "max_turns=3", "max_turn_length=16",
         "max_completion_length=160", "reward_funcs=[environment]", "max_steps=3", "learning_rate=1e-4"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["episodes/turns"] > 1 and row["episodes/environment_errors"] == 0
        assert row["sampling/sampling_logp_difference/mean"] < 0.05  # bf16 vLLM vs the hf train engine
        print("step time", row["time/generate"] + row["time/train"], "generate", row["time/generate"])
