import json

import pytest

from rlcore import ConfigError
from rlcore.checkpoint import checkpoints, load_state, resolve_resume, save_checkpoint
from rlcore.metrics import MetricsWriter


def write_model(tmp):
    (tmp / "model.bin").write_text("weights")


def test_save_is_atomic_and_found_again(tmp_path):
    save_checkpoint(tmp_path, 3, {"step": 3}, write_model)
    save_checkpoint(tmp_path, 6, {"step": 6}, write_model)
    (tmp_path / "checkpoint-9").mkdir()  # an interrupted save left no trainer state: not a checkpoint
    assert [s for s, _ in checkpoints(tmp_path)] == [3, 6]
    assert load_state(tmp_path / "checkpoint-6") == {"step": 6}
    assert (tmp_path / "checkpoint-6" / "model.bin").read_text() == "weights"
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_a_failed_write_publishes_nothing(tmp_path):
    def broken(tmp):
        raise OSError("disk full")

    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 1, {"step": 1}, broken)
    assert checkpoints(tmp_path) == []


def test_keep_removes_only_older_checkpoints(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step}, write_model, keep=2)
    assert [s for s, _ in checkpoints(tmp_path)] == [2, 3]


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    assert resolve_resume(tmp_path, "no") is None
    save_checkpoint(tmp_path, 2, {"step": 2}, write_model)
    with pytest.raises(ConfigError, match="already holds checkpoint-2.*--resume"):
        resolve_resume(tmp_path, "no")
    assert resolve_resume(tmp_path, "auto") == tmp_path / "checkpoint-2"
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        resolve_resume(tmp_path, str(tmp_path / "nowhere"))


def test_metrics_append_and_resume_trims_later_steps(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        writer.write({"step": step, "reward": step / 10, "kl": float("nan")})
    assert writer.read()[1] == {"step": 2, "reward": 0.2, "kl": None}
    writer.resume_at(2)
    assert [m["step"] for m in writer.read()] == [1, 2]
    writer.write({"step": 3, "reward": 1.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
