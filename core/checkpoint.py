"""Checkpoint directories `{output_dir}/checkpoint-{step}`, written atomically and found again for resume."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigError, RlcoreError, RoleFailed
from .log import logger, scrub

_NAME = re.compile(r"^checkpoint-(\d+)$")
_TMP = re.compile(r"^\.checkpoint-(\d+)\.tmp$")
STATE_FILE = "trainer_state.json"
MARKER = "rlcore_checkpoint.json"  # written first into every checkpoint: rlcore removes only folders holding it
FINAL = "final"  # the trained model in Hugging Face format, once a run reached max_steps (with the marker too)
RUN_FILE = "rlcore_run.json"  # rlcore's note of the run in output_dir: {"state": "running"} until it finished


def replace_dir(src: Path, dst: Path) -> None:
    """Put the complete directory `src` at `dst`; an old `dst` is removed only once `src` is in its place."""
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
        os.replace(dst, old / dst.name)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def check_output_dir(output_dir: str | os.PathLike) -> None:
    """`output_dir` is a directory this process can write in, or one it can make: a ConfigError naming the
    fix otherwise (before anything is built in it)."""
    path = Path(output_dir).expanduser()
    if os.path.lexists(path) and not path.is_dir():
        raise ConfigError(f"output_dir '{output_dir}' is a file, not a directory; choose another output_dir",
                          [("output_dir", f"'{output_dir}' is a file")])
    existing = path
    while not existing.is_dir():
        if os.path.lexists(existing):
            raise ConfigError(f"output_dir '{output_dir}' cannot be made: '{existing}' is a file, not a directory; "
                              f"choose another output_dir", [("output_dir", f"'{existing}' is a file")])
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        which = "it is" if existing == path else f"'{existing}' is"
        raise ConfigError(f"output_dir '{output_dir}' is not writable ({which} read-only for this user); "
                          f"choose another output_dir", [("output_dir", f"'{existing}' is read-only")])


def written_by_rlcore(path: Path) -> bool:
    """`path` is a checkpoint folder rlcore wrote: it holds the marker (or, written before the marker was, a
    trainer state with an integer step), or it is an empty folder, which holds nothing to lose."""
    if not path.is_dir() or path.is_symlink():
        return False
    if (path / MARKER).is_file() or not any(path.iterdir()):
        return True
    try:
        return isinstance(json.loads((path / STATE_FILE).read_text()).get("step"), int)
    except (OSError, ValueError, AttributeError):
        return False


def foreign_checkpoints(output_dir: str | os.PathLike, final: bool = True) -> list[Path]:
    """What in `output_dir` is named like a checkpoint (or its temporary folder; with `final`, like the final
    model's folder) but was not written by rlcore."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    ours = (_NAME, _TMP) + ((re.compile(rf"^{FINAL}$"), re.compile(rf"^\.{FINAL}\.tmp$")) if final else ())
    return sorted(p for p in root.iterdir() if any(n.match(p.name) for n in ours) and not written_by_rlcore(p))


def _check_removable(path: Path, overwrite: bool) -> None:
    """An RlcoreError unless rlcore wrote `path` (or `overwrite` lets it replace what is there)."""
    if os.path.lexists(path) and not (overwrite or written_by_rlcore(path)):
        raise RlcoreError(f"{path} was not written by rlcore (no {MARKER} in it), so it is left as it is and "
                          f"{path.name} is not saved; move it away, or set overwrite_output_dir=true to replace it")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with a trainer state), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _NAME.match(child.name)
        if m and (child / STATE_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    state: dict[str, Any],
    write: Callable[[Path], None],
    keep: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `checkpoint-{step}`: the marker first, then `write(tmpdir)` fills a temporary directory, the
    trainer state goes last, then one rename publishes it. `keep` removes all but the newest `keep`
    checkpoints afterwards. Only folders rlcore wrote are replaced or removed (any, with `overwrite`)."""
    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    tmp = root / f".checkpoint-{step}.tmp"
    _check_removable(tmp, overwrite)
    _check_removable(final, overwrite)  # before anything is written
    if os.path.lexists(tmp):
        _remove(tmp)
    tmp.mkdir(parents=True)
    try:
        (tmp / MARKER).write_text(json.dumps({"step": step}) + "\n")
        write(tmp)
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except Exception as exc:  # a full disk, a quota, a worker that failed to write: the old checkpoints stay
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, RoleFailed):  # a worker died or raised while saving: its own message says what happened
            raise
        older = checkpoints(root)
        kept = f"; the newest intact one is {older[-1][1]}" if older else ""
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise RlcoreError(f"cannot write {final.name} in {root}: {reason[:300]} (free disk space?){kept}") from exc
    if os.path.lexists(final):  # the same step saved again (a resumed run): replace it whole
        _remove(final)
    os.replace(tmp, final)
    if keep:
        for _, old in checkpoints(root)[:-keep]:
            if written_by_rlcore(old):  # another's folder named like a checkpoint is never pruned
                shutil.rmtree(old, ignore_errors=True)
    return final


def save_final(output_dir: str | os.PathLike, step: int, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Write `final/` (the marker, then `write(tmpdir)`: the model in Hugging Face format) and publish it with
    one rename; an older `final/` is replaced only if rlcore wrote it (any, with `overwrite`)."""
    root = Path(output_dir)
    final, tmp = root / FINAL, root / f".{FINAL}.tmp"
    _check_removable(tmp, overwrite)
    _check_removable(final, overwrite)
    if os.path.lexists(tmp):
        _remove(tmp)
    tmp.mkdir(parents=True)
    try:
        (tmp / MARKER).write_text(json.dumps({"step": step, "final": True}) + "\n")
        write(tmp)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, RoleFailed):
            raise
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise RlcoreError(f"cannot write the final model {final} (step {step}; checkpoint-{step} holds it too): "
                          f"{reason[:300]}") from exc
    replace_dir(tmp, final)
    return final


def note_run(output_dir: str | os.PathLike, state: str, about: dict[str, Any] | None = None) -> None:
    """Say in output_dir what the run there is doing ("running", "finished", "stopped", "failed"), with `about` (the
    algorithm, its plot's panels, a reason): a run that stops before its first checkpoint leaves only rlcore's own
    partial files, and the next run may start afresh there."""
    _write_note(Path(output_dir) / RUN_FILE, (json.dumps({"state": state, **(about or {})}) + "\n").encode())


def _write_note(path: Path, data: bytes) -> None:
    """`data` into `path` by one rename; on a full disk, where the new file cannot be written, over the old one in
    place (a note fits in the block it has: the final state is said, if not atomically)."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not path.is_file() or path.is_symlink():
            raise
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()


class RunRecord:
    """output_dir's rlcore_run.json over a run's life: "running" from the moment it holds the lock, then its end on
    every exit path, said once: "finished", "stopped" (with the signal), or "failed" (with the first line of why).
    A run refused before it began (`--resume` of a finished run, a checkpoint that does not fit) puts back the
    record it found, byte for byte."""

    def __init__(self, output_dir: str | os.PathLike, about: dict[str, Any]):
        self.path = Path(output_dir) / RUN_FILE
        self.about = about
        self.began = False  # set once the run is restored and steps: a refusal after that is a failure
        self.ended = False
        try:
            self.before: bytes | None = self.path.read_bytes() if not self.path.is_symlink() else None
        except OSError:
            self.before = None

    def running(self) -> None:
        note_run(self.path.parent, "running", self.about)

    def end(self, exc: BaseException | None = None, stopped_by: int | None = None) -> None:
        """The run's end, from what ended it (`exc`; None: it finished) and the signal it had noted."""
        if self.ended:
            return
        self.ended = True
        if exc is None:
            note_run(self.path.parent, "finished", self.about)
            return
        signal_name = _signal_of(exc, stopped_by)
        if signal_name is None and isinstance(exc, ConfigError) and not self.began:
            self._put_back()
            return
        if signal_name is not None:
            state, reason = "stopped", signal_name
        else:
            text = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            state, reason = "failed", scrub(text)[:500]
        with contextlib.suppress(OSError):  # the failure itself says why; a note that cannot be written adds nothing
            note_run(self.path.parent, state, {**self.about, "reason": reason})

    def _put_back(self) -> None:
        with contextlib.suppress(OSError):
            if self.before is None:
                self.path.unlink(missing_ok=True)
            else:
                _write_note(self.path, self.before)


def _signal_of(exc: BaseException, noted: int | None) -> str | None:
    """The signal that stopped a run ("SIGINT"), from the exception it left with or the one it had noted."""
    import signal as signals

    codes = {130: signals.SIGINT, 143: signals.SIGTERM, 129: signals.SIGHUP, 15: signals.SIGTERM}  # 15: Ray's handler
    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT"
    if isinstance(exc, SystemExit) and exc.code in codes:
        return codes[exc.code].name
    return signals.Signals(noted).name if noted is not None else None


def finished_run(output_dir: str | os.PathLike) -> bool:
    """`output_dir` holds an rlcore run that reached its end: its note says "finished"."""
    try:
        return json.loads((Path(output_dir) / RUN_FILE).read_text()).get("state") == "finished"
    except (OSError, ValueError, AttributeError):
        return False


def remove_previous_run(output_dir: str | os.PathLike) -> list[str]:
    """Remove the checkpoints and the final model an earlier run wrote in `output_dir` (those holding rlcore's
    marker; nothing else), for a fresh run there with `overwrite_output_dir`; the names removed, oldest first."""
    root = Path(output_dir)
    ours = [path for _, path in checkpoints(root) if written_by_rlcore(path)]
    ours += [path for path in (root / FINAL,) if (path / MARKER).is_file() and not path.is_symlink()]
    for path in ours:
        shutil.rmtree(path)
    return [path.name for path in ours]


def partial_run(output_dir: str | os.PathLike) -> bool:
    """`output_dir` holds what an rlcore run left that stopped before it saved a checkpoint (a second Ctrl-C,
    a crash): its note says it did not finish, and there is no checkpoint. Nothing there can be resumed."""
    try:
        state = json.loads((Path(output_dir) / RUN_FILE).read_text()).get("state")
    except (OSError, ValueError, AttributeError):
        return False
    return state in ("running", "stopped", "failed") and not checkpoints(output_dir)


def resolve_resume(output_dir: str | os.PathLike, resume: str, overwrite: bool = False, final: bool = True) -> Path | None:
    """The checkpoint to resume from: 'no' gives None, 'auto' the newest one, anything else is a checkpoint
    path. A fresh run into a directory that holds checkpoints or another run's metrics is refused, and so is
    resuming where there is nothing to resume: nothing a user trained or logged is silently overwritten.
    `overwrite` (`overwrite_output_dir`) lets a fresh run start there anyway (it replaces the earlier run: see
    `remove_previous_run`), and lets it replace folders named like checkpoints that rlcore did not write. What a run left that stopped before its first checkpoint (`partial_run`) is
    rlcore's own: a fresh run starts there, and so does `resume=auto`, with nothing to resume. `final`: the
    run writes `final/` at its end, so one rlcore did not write is refused too."""
    foreign = foreign_checkpoints(output_dir, final)
    if foreign and not overwrite:
        names = ", ".join(p.name for p in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        them = "it" if len(foreign) == 1 else "them"
        raise ConfigError(
            f"output_dir '{output_dir}' holds {names}, which rlcore did not write (no {MARKER} in {them}); a run "
            f"would replace {them} with its own checkpoints or final model. Move {them} away, choose another output_dir, or set "
            f"overwrite_output_dir=true to let this run replace {them}",
            [("output_dir", f"holds {names}, not written by rlcore")],
        )
    found = [(step, path) for step, path in checkpoints(output_dir) if written_by_rlcore(path)]
    if resume == "no":
        if found and not overwrite:
            raise ConfigError(
                f"output_dir '{output_dir}' already holds {found[-1][1].name}; resume it with --resume "
                f"(resume=auto), choose another output_dir, or set overwrite_output_dir=true to start afresh there"
            )
        metrics = Path(output_dir) / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size and not partial_run(output_dir) and not overwrite:
            raise ConfigError(
                f"output_dir '{output_dir}' holds the metrics.jsonl of another run (and no checkpoint to resume); "
                f"choose another output_dir, move that file away, or set overwrite_output_dir=true to replace it"
            )
        return None
    if resume == "auto":
        if not found and partial_run(output_dir):
            return None
        if not found:
            raise ConfigError(
                f"--resume (resume=auto): output_dir '{output_dir}' holds no checkpoint to continue from; "
                f"drop --resume to start a new run there"
            )
        return found[-1][1]
    return check_resume_path(resume)


def check_resume_path(resume: str | None) -> Path | None:
    """The checkpoint folder `resume` names where it names one (not `no` or `auto`): a ConfigError unless it
    holds a trainer state (what `config validate` checks, as a run does)."""
    if resume in (None, "", "no", "auto"):
        return None
    path = Path(resume)
    try:
        found = (path / STATE_FILE).is_file()
    except OSError:  # a name the file system refuses
        found = False
    if not found:
        raise ConfigError(f"resume: '{resume}' is not a checkpoint directory (no {STATE_FILE} in it)",
                          [("resume", f"'{resume}' holds no {STATE_FILE}")])
    return path


def load_state(path: Path) -> dict[str, Any]:
    """The trainer state that `save_checkpoint` wrote into the checkpoint folder `path`."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise RlcoreError(f"{file} cannot be read as a trainer state: {exc}") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise RlcoreError(f"{file} is not a trainer state (no integer 'step')")
    named = re.fullmatch(r"checkpoint-(\d+)", Path(path).name)
    if step < 0 or (named and int(named[1]) != step):
        raise RlcoreError(f"{file} is damaged: its step {step} is not the {Path(path).name}'s")
    return state


class RunLock:
    """`output_dir` belongs to one run at a time: a lock file with the owner's host and pid, taken for the
    run's life and removed on exit. A lock whose process is gone (a killed run) is taken over, with a
    warning; one held by a live process is a ConfigError naming it."""

    NAME = ".rlcore.lock"

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / self.NAME
        self.held = False

    def __enter__(self) -> RunLock:
        import socket
        
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"output_dir '{self.path.parent}' cannot be made ({exc.strerror or exc}); choose "
                              f"another output_dir") from None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid())}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and _alive(owner, me["host"]):
                    raise self._in_use(owner, me["host"]) from None
                logger.warning(f"{self.path} was left by a run that is gone ({owner}); taking it over")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise ConfigError(f"output_dir '{self.path.parent}': another run took {self.path} at the same moment")

    def refuse_if_held(self) -> None:
        """The ConfigError `__enter__` would raise if a live run holds the lock now, without taking it: a run
        checks this before it builds anything in output_dir (a demo model), then takes the lock to train."""
        import socket

        owner = self._owner() if self.path.is_file() else None
        if owner is not None and _alive(owner, socket.gethostname()):
            raise self._in_use(owner, socket.gethostname())

    def _in_use(self, owner: dict[str, Any], host: str) -> ConfigError:
        elsewhere = owner.get("host") != host
        return ConfigError(
            f"output_dir '{self.path.parent}' is in use by another run (pid {owner.get('pid')} on "
            f"{owner.get('host')}); wait for it, or choose another output_dir"
            + (f". If host {owner.get('host')} is gone, remove {self.path}" if elsewhere else "")
        )

    def _owner(self) -> dict[str, Any] | None:
        try:
            owner = json.loads(self.path.read_text())
            return owner if isinstance(owner, dict) else None
        except (OSError, ValueError):
            return None  # torn or unreadable: nobody we could wait for

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _started(pid: int) -> float | None:
    """When process `pid` started (seconds since boot, from /proc), to tell it from a later one with its pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _alive(owner: dict[str, Any], host: str) -> bool:
    """The lock's owner still runs: its pid exists and started when the lock says (a reused pid, or this
    very process after a container restart, is not the owner). Another host's owner cannot be checked
    from here and is taken as alive."""
    if owner.get("host") != host:
        return True
    try:
        pid = int(owner.get("pid", -1))
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    started = owner.get("started")
    return started is None or _started(pid) is None or abs(_started(pid) - float(started)) < 1.0
