"""`output_dir/final`: after every run that trains, the model in Hugging Face format, loadable by
`AutoModelForCausalLM.from_pretrained` (vLLM reads the same folder), with its tokenizer, and the weights the
run trained: the same as the last checkpoint's (a LoRA adapter merged into its base)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


def rlcore(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m rlcore ARGS` in tmp_path, as a user types it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    return subprocess.run([sys.executable, "-m", "rlcore", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


@pytest.fixture
def run_ok(tmp_path, unlisted_metrics):
    """`run_ok(ALGORITHM, KEY=VALUE ...)`: `rlcore run` in tmp_path that trains 2 steps into out/ and keeps to the
    README's metric names; returns out/ and the completed process."""

    def run(algorithm: str, *overrides: str) -> tuple[Path, subprocess.CompletedProcess]:
        done = rlcore(tmp_path, "run", "--plugin", algorithm, "output_dir=out", *overrides)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines()[0].startswith(f'{{"algorithm": "{algorithm}"')
        out = tmp_path / "out"
        assert "the trained model (step 2) is in out/final, in Hugging Face format" in done.stderr
        assert unlisted_metrics(out / "metrics.jsonl") == []  # one vocabulary: README's table of metric names
        return out, done

    return run


@pytest.mark.parametrize("engine", ["hf", "megatron"])
def test_grpo_writes_the_trained_model_as_a_hugging_face_folder(run_ok, engine):
    if engine == "megatron":
        pytest.importorskip("megatron.core")
    out, done = run_ok("grpo", "max_steps=2", f"train.engine={engine}")
    if engine == "megatron":  # megatron-core's import warnings: in run.log, each text once, not on the console
        assert "Transformer Engine and Apex are not installed" not in done.stderr
        log = (out / "run.log").read_text()
        fallback = "Transformer Engine and Apex are not installed. Falling back to local implementations of " \
                   "multi_tensor_applier and multi_tensor_scale"  # megatron-core warns it from two modules
        assert log.count(fallback) == 1 and "WARNING rlcore.warnings: UserWarning from megatron/core/" in log
    model, tokenizer = load(out / "final")
    assert tokenizer("ab").input_ids  # the tokenizer came along
    saved = out / "checkpoint-2" / "model" / "model"
    assert_same_weights(state(model), state(load(saved)[0]))  # the weights the run trained, not the start's
    start = load(out / "tiny-model")[0]
    assert any(not torch.equal(a, b) for a, b in zip(state(model).values(), state(start).values()))
    assert json.loads((out / "final" / "rlcore_checkpoint.json").read_text()) == {"step": 2, "final": True}


def test_grpo_with_lora_writes_the_merged_model_and_the_adapter(run_ok):
    from peft import PeftModel

    out, _ = run_ok("grpo", "max_steps=2", "train.lora_rank=4")
    model, _ = load(out / "final")
    base = load(out / "tiny-model")[0]
    merged = PeftModel.from_pretrained(base, out / "checkpoint-2" / "model" / "model").merge_and_unload()
    assert not any("lora" in k for k in state(model))
    assert_same_weights(state(model), state(merged))
    adapter = PeftModel.from_pretrained(load(out / "tiny-model")[0], out / "final" / "adapter").merge_and_unload()
    assert_same_weights(state(model), state(adapter))  # final/adapter: the trained adapter, which peft loads


@pytest.mark.parametrize("algorithm", ["sft", "pt"])
def test_sft_and_pt_write_the_trained_model_and_name_their_engine_as_a_user_knows_it(run_ok, algorithm):
    pytest.importorskip("trl")
    out, done = run_ok(algorithm, "max_steps=2")
    trainer = "TRL's SFTTrainer" if algorithm == "sft" else "transformers' Trainer"  # never the internal build_sft
    placement = f"rlcore: default: 1 worker, in this process, engine hf ({trainer}), float32"  # dtype auto on the CPU
    assert done.stderr.splitlines()[0] == placement
    assert all("learning_rate" in json.loads(row) for row in (out / "metrics.jsonl").read_text().splitlines())
    model, tokenizer = load(out / "final")
    assert tokenizer("ab").input_ids
    assert_same_weights(state(model), state(load(out / "checkpoint-2" / "model")[0]))


def test_sft_with_lora_writes_the_merged_model(run_ok):
    pytest.importorskip("trl")
    from peft import PeftModel

    out, _ = run_ok("sft", "max_steps=2", "lora_rank=4")
    model, _ = load(out / "final")
    base = load(out / "tiny-model")[0]
    merged = PeftModel.from_pretrained(base, out / "checkpoint-2" / "model").merge_and_unload()
    assert_same_weights(state(model), state(merged))


def test_gkd_writes_the_student(run_ok):
    out, _ = run_ok("gkd", "max_steps=2")
    model, _ = load(out / "final")
    assert_same_weights(state(model), state(load(out / "checkpoint-2" / "model" / "model")[0]))


def test_a_final_folder_rlcore_did_not_write_is_refused(tmp_path):
    (tmp_path / "out" / "final").mkdir(parents=True)
    (tmp_path / "out" / "final" / "mine.txt").write_text("a user's file")
    done = rlcore(tmp_path, "run", "--plugin", "grpo", "output_dir=out", "max_steps=1")
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith("rlcore: error: output_dir 'out' holds final, which rlcore did not write")
    assert (tmp_path / "out" / "final" / "mine.txt").read_text() == "a user's file"


def test_an_algorithm_without_a_model_writes_no_final_and_leaves_a_users_final_alone(tmp_path):
    (tmp_path / "out" / "final").mkdir(parents=True)
    (tmp_path / "out" / "final" / "mine.txt").write_text("a user's file")
    done = rlcore(tmp_path, "run", "--plugin", "example", "output_dir=out")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[0].startswith('{"algorithm": "example"')
    assert sorted(p.name for p in (tmp_path / "out" / "final").iterdir()) == ["mine.txt"]
