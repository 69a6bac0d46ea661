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

    from rlcore import RlcoreError

    with pytest.raises(RlcoreError, match="cannot write checkpoint-1 .*disk full"):
        save_checkpoint(tmp_path, 1, {"step": 1}, broken)
    assert checkpoints(tmp_path) == [] and not list(tmp_path.glob(".checkpoint-*"))


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


def test_overwrite_output_dir_starts_afresh_removing_only_what_rlcore_wrote(tmp_path):
    """TRL's meaning of overwrite_output_dir: a new run where another one was; rlcore's checkpoints and final model
    go, a folder it did not write stays (only a checkpoint of the same name would replace it)."""
    from rlcore.checkpoint import remove_previous_run, save_final

    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"step": step}, write_model)
    save_final(tmp_path, 2, write_model)
    MetricsWriter(tmp_path / "metrics.jsonl").write({"step": 1})
    theirs = tmp_path / "checkpoint-9"
    theirs.mkdir()
    (theirs / "trainer_state.json").write_text(json.dumps({"global_step": 9}))
    with pytest.raises(ConfigError, match="set overwrite_output_dir=true to let this run replace it"):
        resolve_resume(tmp_path, "no")
    theirs.rename(tmp_path / "kept")
    with pytest.raises(ConfigError, match="already holds checkpoint-2.*or set overwrite_output_dir=true to start afresh"):
        resolve_resume(tmp_path, "no")
    assert resolve_resume(tmp_path, "no", overwrite=True) is None
    (tmp_path / "kept").rename(theirs)
    assert remove_previous_run(tmp_path) == ["checkpoint-1", "checkpoint-2", "final"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-9", "metrics.jsonl"]


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


def test_a_run_lock_tells_a_live_owner_from_a_reused_pid_and_names_the_file(tmp_path, capsys):
    import json
    import os
    import socket
    import subprocess
    import sys

    from rlcore.checkpoint import RunLock, _started

    lock = tmp_path / RunLock.NAME
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        host = socket.gethostname()
        lock.write_text(json.dumps({"host": host, "pid": sleeper.pid, "started": _started(sleeper.pid)}))
        with pytest.raises(ConfigError, match="in use by another run"):
            RunLock(tmp_path).__enter__()
        # the same pid, but a process that started at another time: the lock's owner is gone
        lock.write_text(json.dumps({"host": host, "pid": sleeper.pid, "started": _started(sleeper.pid) - 100}))
        with RunLock(tmp_path):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert "left by a run that is gone" in capsys.readouterr().err and not lock.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    lock.write_text(json.dumps({"host": "a-node-that-died", "pid": 4242}))
    with pytest.raises(ConfigError, match=f"If host a-node-that-died is gone, remove {lock}"):
        RunLock(tmp_path).__enter__()


def test_a_failed_checkpoint_write_names_the_checkpoint_and_keeps_the_old_ones(tmp_path):
    from rlcore import RlcoreError

    save_checkpoint(tmp_path, 1, {"step": 1}, lambda tmp: None)

    def full(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(RlcoreError, match="cannot write checkpoint-2 .*No space left on device.*newest intact one is"):
        save_checkpoint(tmp_path, 2, {"step": 2}, full)
    assert [step for step, _ in checkpoints(tmp_path)] == [1] and not list(tmp_path.glob(".checkpoint-2*"))


def test_a_worker_that_fails_while_saving_is_reported_as_itself_not_as_a_full_disk(tmp_path):
    from rlcore import RoleFailed

    save_checkpoint(tmp_path, 1, {"step": 1}, lambda tmp: None)

    def dies(tmp):
        raise RoleFailed("role 'default' rank 1 on node 10.0.0.2 (pid 7) died during save()", role="default", rank=1)

    with pytest.raises(RoleFailed, match=r"^role 'default' rank 1 on node 10.0.0.2 \(pid 7\) died during save\(\)$"):
        save_checkpoint(tmp_path, 2, {"step": 2}, dies)
    assert [step for step, _ in checkpoints(tmp_path)] == [1] and not list(tmp_path.glob(".checkpoint-2*"))


def test_rlcore_removes_only_the_checkpoint_folders_it_wrote(tmp_path):
    from rlcore import RlcoreError
    from rlcore.checkpoint import MARKER

    thesis = tmp_path / "checkpoint-2" / "thesis.txt"
    thesis.parent.mkdir()
    thesis.write_text("mine")
    hf = tmp_path / "checkpoint-1"  # another trainer's checkpoint, with a state file of its own
    hf.mkdir()
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    with pytest.raises(ConfigError, match="checkpoint-1, checkpoint-2, which rlcore did not write.*overwrite_output_dir"):
        resolve_resume(tmp_path, "no")
    with pytest.raises(RlcoreError, match="checkpoint-2 was not written by rlcore"):
        save_checkpoint(tmp_path, 2, {"step": 2}, write_model)
    assert thesis.read_text() == "mine" and not list(tmp_path.glob(".checkpoint-*"))
    for step in (3, 4):
        save_checkpoint(tmp_path, step, {"step": step}, write_model, keep=1)
    assert (hf / "trainer_state.json").is_file() and thesis.is_file()  # never pruned
    assert (tmp_path / "checkpoint-4" / MARKER).is_file() and not (tmp_path / "checkpoint-3").exists()
    assert resolve_resume(tmp_path, "auto", overwrite=True) == tmp_path / "checkpoint-4"  # never another's
    save_checkpoint(tmp_path, 2, {"step": 2}, write_model, overwrite=True)  # overwrite_output_dir=true
    assert not thesis.exists() and load_state(tmp_path / "checkpoint-2") == {"step": 2}


def test_an_output_dir_that_cannot_be_one_is_a_config_error(tmp_path):
    from rlcore.checkpoint import check_output_dir

    (tmp_path / "a-file").write_text("notes")
    check_output_dir(tmp_path / "new" / "run")
    with pytest.raises(ConfigError, match="'.*a-file' is a file, not a directory"):
        check_output_dir(tmp_path / "a-file")
    with pytest.raises(ConfigError, match="cannot be made: '.*a-file' is a file"):
        check_output_dir(tmp_path / "a-file" / "run")


def test_a_run_is_refused_before_it_builds_and_checks_again_once_it_holds_the_lock(tmp_path):
    from types import SimpleNamespace

    from rlcore import Trainer
    from rlcore.checkpoint import RunLock

    config = SimpleNamespace(output_dir=str(tmp_path / "out"), max_steps=1)
    with RunLock(config.output_dir), pytest.raises(ConfigError, match="in use by another run"):
        Trainer(config, plugins=None)  # refused in Trainer.__init__, before a subclass builds anything
    trainer = Trainer(config, plugins=None)  # built while output_dir held no run
    save_checkpoint(config.output_dir, 3, {"step": 3}, write_model)  # another run finished there meanwhile
    with pytest.raises(ConfigError, match="already holds checkpoint-3"):
        trainer.fit()
    assert not (tmp_path / "out" / RunLock.NAME).exists()


@pytest.mark.parametrize("step", [-1, True, 2.0, "3", 7])
def test_a_state_whose_step_is_negative_not_an_int_or_not_its_folders_is_damaged(tmp_path, step):
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    with pytest.raises(Exception, match="trainer_state.json is (damaged|not a trainer state)"):
        load_state(folder)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 3}))
    assert load_state(folder)["step"] == 3


def test_metrics_and_run_log_are_never_written_through_a_symlink_nor_left_torn(tmp_path):
    import subprocess
    import sys

    from rlcore import RlcoreError, log

    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file\n")
    for name in ("metrics.jsonl", "run.log"):
        (tmp_path / name).symlink_to(mine)
    with pytest.raises(RlcoreError, match=r"metrics.jsonl is a symbolic link; rlcore never writes"):
        MetricsWriter(tmp_path / "metrics.jsonl").write({"step": 1})
    with pytest.raises(RlcoreError, match=r"run.log is a symbolic link"):
        with log.to_file(tmp_path):
            pass
    assert mine.read_text() == "a user's file\n"
    # a file size limit (as a full disk) mid-line: the line is taken back, the error names the file
    full = tmp_path / "full"
    full.mkdir()
    code = ("import resource, signal; from rlcore.metrics import MetricsWriter; signal.signal(signal.SIGXFSZ, "
            "signal.SIG_IGN); w = MetricsWriter('metrics.jsonl'); w.write({'step': 1}); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (60, resource.RLIM_INFINITY)); w.write({'step': 2, 'x': 'y' * 200})")
    done = subprocess.run([sys.executable, "-c", code], cwd=full, capture_output=True, text=True, timeout=60)
    assert "cannot write metrics.jsonl: File too large; the step's metrics are not in it" in done.stderr, done.stderr
    assert (full / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_rlcore_run_json_says_how_every_run_ended_and_a_refused_run_leaves_it_as_it_was(example_plugin, tmp_path,
                                                                                       monkeypatch):
    """The example plugin's trainer (real, in this process): stopped by SIGINT at step 2 -> "stopped" (it said
    "running"); resumed to the end -> "finished"; a --resume of the finished run (nothing to train) -> the record byte
    for byte; a run that fails at step 2 -> "failed" with the first line of why."""
    import os
    import signal

    from rlcore import RlcoreError, hookimpl, load_plugins
    from rlcore_example.trainer import LineFitConfig, LineFitTrainer

    class At:
        def __init__(self, step, act):
            self.step, self.act = step, act

        @hookimpl
        def rlcore_step_end(self, trainer, step, metrics):
            if step == self.step:
                self.act()

    def fit(*hooks, **keys):
        plugins = load_plugins()
        for i, hook in enumerate(hooks):
            plugins.register(hook, f"at-{i}")
        config = LineFitConfig(output_dir=str(out), steps=4, save_steps=1, num_workers=1, **keys)
        return LineFitTrainer(config, plugins).fit()

    def record():
        return json.loads((out / "rlcore_run.json").read_text())

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        fit(At(2, lambda: os.kill(os.getpid(), signal.SIGINT)))
    assert record() == {"state": "stopped", "algorithm": "example", "plot_keys": ["loss", "w", "b"], "reason": "SIGINT"}
    fit(resume="auto")
    assert record()["state"] == "finished"
    before = (out / "rlcore_run.json").read_bytes()
    fit(resume="auto")  # a --resume of the finished run trains nothing, says so, and leaves the record
    assert (out / "rlcore_run.json").read_bytes() == before

    def disk_full():
        raise RlcoreError(f"cannot write {out / 'metrics.jsonl'}: No space left on device\nmore detail")

    out = tmp_path / "failing"
    with pytest.raises(RlcoreError):
        fit(At(2, disk_full))
    assert record()["state"] == "failed"
    assert record()["reason"] == f"cannot write {out / 'metrics.jsonl'}: No space left on device"


def test_on_a_full_disk_the_run_record_still_ends_true(example_plugin, tmp_path):
    """A real file size limit (as a full disk) reached by metrics.jsonl at step 3, in a child process: the run fails
    in one line, and rlcore_run.json, rewritten in place where a new file cannot be written, says "failed"."""
    import subprocess
    import sys

    limited = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (350, resource.RLIM_INFINITY)); "
               "from rlcore.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", limited, "run", "--plugin", "example", "steps=6", "save_steps=0",
                           "num_workers=1", f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    record = json.loads((tmp_path / "run" / "rlcore_run.json").read_text())
    assert record["state"] == "failed" and "metrics.jsonl" in record["reason"], (record, done.stderr)
