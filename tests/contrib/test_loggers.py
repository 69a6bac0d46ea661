"""The contrib loggers: `report_to: [tensorboard, wandb]` through the real CLI, read back with each tool's reader."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from rlcore import ConfigError, Plugins, RunConfig, SettingSpec, Trainer, hookimpl, load_config
from rlcore.cli import main
from rlcore.config import with_settings
from rlcore.contrib import loggers

RLCORE = Path(sys.executable).with_name("rlcore")
TINY_GRPO = ["max_steps=2", "max_completion_length=8", "per_device_train_batch_size=16", "num_generations=4"]


def rlcore(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed `rlcore` console script with every installed plugin, as a user runs it."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RLCORE_", "WANDB_"))}
    full_env.update(env or {})
    return subprocess.run([str(RLCORE), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def metrics_of(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: every scalar tag's (step, value) pairs, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_report_to_tensorboard_writes_event_files_that_tensorboard_loads(tmp_path):
    out = tmp_path / "run"
    done = rlcore(tmp_path, "run", "--plugin", "grpo", "report_to=[tensorboard]", *TINY_GRPO, f"output_dir={out}")
    assert done.returncode == 0, done.stderr
    assert list((out / "runs").glob("events.out.tfevents.*"))
    shown = scalars(out / "runs")
    rewards = [m["reward"] for m in metrics_of(out)]
    assert [step for step, _ in shown["reward"]] == [1, 2]
    assert [value for _, value in shown["reward"]] == pytest.approx(rewards, rel=1e-6)
    assert {"loss", "grad_norm", "time/generate"} <= set(shown)
    assert "step" not in shown  # the x-axis


def wandb_records(path: Path):
    """The records of an offline W&B run file (`run-ID.wandb`): W&B's LevelDB-style log of protobufs,
    a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (length, kind) == (0, 0):
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_report_to_wandb_writes_an_offline_run_with_the_metrics(tmp_path):
    out = tmp_path / "run"
    home = tmp_path / "wandb-home"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "config"),
           "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data")}
    done = rlcore(tmp_path, "run", "--plugin", "grpo", "report_to=[wandb]", "wandb_project=rlcore-test",
                  "run_name=tiny", *TINY_GRPO, f"output_dir={out}", env=env)
    assert done.returncode == 0, done.stderr
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("rlcore-test", "tiny")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["num_generations"] == 4 and config["report_to"] == ["wandb"]
    history = [
        {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
        for r in records if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [1, 2]
    assert [h["reward"] for h in history] == pytest.approx([m["reward"] for m in metrics_of(out)])
    assert all("loss" in h and "step" not in h for h in history)


# -------------------------------------------------------------------------
# in one process: a small trainer with the loggers as its only plugin
# -------------------------------------------------------------------------


class CountConfig(RunConfig):
    """A loop that counts."""

    max_steps: int = Field(3, ge=1)
    resume: str = "no"


class CountTrainer(Trainer):
    def train_step(self) -> dict:
        return {"reward": float(self.step + 1) / 10, "note": "not a number", "kl": None, "done": False}


def count_run(*overrides: str, extra: object = None) -> dict:
    """A CountTrainer run with the loggers (and `extra`, registered first) as its plugins."""
    plugins = Plugins()
    if extra is not None:
        plugins.register(extra, "extra")
    plugins.register(loggers, "loggers")
    config = load_config(with_settings(CountConfig, plugins.settings), None, overrides)
    return CountTrainer(config, plugins).fit()


def test_logging_dir_holds_the_numeric_metrics_only(tmp_path):
    count_run(f"output_dir={tmp_path / 'run'}", f"logging_dir={tmp_path / 'tb'}", "report_to=tensorboard")
    assert not (tmp_path / "run" / "runs").exists()
    assert scalars(tmp_path / "tb") == {"reward": [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)),
                                                  (3, pytest.approx(0.3))]}


def test_a_resumed_run_shows_each_step_once(tmp_path):
    out = tmp_path / "run"
    count_run(f"output_dir={out}", "report_to=[tensorboard]", "max_steps=2")
    count_run(f"output_dir={out}", "report_to=[tensorboard]", "max_steps=4", "resume=auto")
    assert len(list((out / "runs").glob("events.out.tfevents.*"))) == 2
    assert [step for step, _ in scalars(out / "runs")["reward"]] == [1, 2, 3, 4]


class EveryOther:
    """A hook-only plugin with a key of its own, beside the loggers' keys."""

    def __init__(self):
        self.seen: list[tuple[int, list[str]]] = []

    @hookimpl
    def rlcore_settings(self):
        yield SettingSpec("print_every", int, default=2, description="note every N-th step")

    @hookimpl
    def rlcore_step_end(self, trainer, step, metrics):
        metrics["steps_left"] = trainer.max_steps - step
        if step % trainer.config.print_every == 0:
            self.seen.append((step, trainer.config.report_to))


def test_hooks_read_the_keys_plugins_add_from_the_config(tmp_path):
    plugin = EveryOther()
    count_run(f"output_dir={tmp_path}", "max_steps=4", "report_to=[tensorboard]", extra=plugin)
    assert plugin.seen == [(2, ["tensorboard"]), (4, ["tensorboard"])]
    # the loggers run after the other step-end hooks: what those add is logged too
    assert scalars(tmp_path / "runs")["steps_left"] == [(1, 3.0), (2, 2.0), (3, 1.0), (4, 0.0)]
    plugin = EveryOther()
    count_run(f"output_dir={tmp_path / 'again'}", "max_steps=4", "print_every=3", extra=plugin)
    assert plugin.seen == [(3, [])]


def test_without_report_to_no_logger_library_is_needed(tmp_path, monkeypatch):
    for module in ("torch.utils.tensorboard", "tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it fails
    count_run(f"output_dir={tmp_path}")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "checkpoint-3", "metrics.jsonl", "rlcore_run.json", "run.log"]  # no logger's folder (runs/, wandb/)


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_missing_library_names_the_extra_to_install(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=rf"report_to: {name} needs {name}, not installed here: "
                                          rf"pip install 'rlcore\[{name}\]'"):
        count_run(f"output_dir={tmp_path}", f"report_to=[{name}]")
    config = tmp_path / "config.yaml"
    config.write_text(f"report_to: [{name}]\n")
    assert main(["config", "validate", "--plugin", "grpo", "--config", str(config)]) == 2
    assert f"pip install 'rlcore[{name}]'" in capsys.readouterr().err


def test_config_show_and_validate_know_the_logger_keys(tmp_path, capsys):
    assert main(["config", "show", "--plugin", "grpo", "report_to=all"]) == 0
    shown = capsys.readouterr().out
    assert "# loggers for the metrics besides metrics.jsonl: tensorboard, wandb (default: none)\n" in shown
    assert "report_to: [tensorboard, wandb]\n" in shown
    assert "# where TensorBoard writes its event files (default: {output_dir}/runs)\nlogging_dir: null\n" in shown
    config = tmp_path / "config.yaml"
    config.write_text("report_to: [tensorbord]\nreprot_to: none\nwandb_projet: x\n")
    assert main(["config", "validate", "--plugin", "grpo", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "report_to.0: Input should be 'tensorboard' or 'wandb' (got 'tensorbord')" in err
    assert "reprot_to: unknown key 'reprot_to'. Did you mean 'report_to'?" in err
    assert "wandb_projet: unknown key 'wandb_projet'. Did you mean 'wandb_project'?" in err
