"""Checkpoint directories `{output_dir}/checkpoint-{step}`, written atomically and found again for resume."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigError, RlcoreError

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


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
) -> Path:
    """Write `checkpoint-{step}`: `write(tmpdir)` fills a temporary directory, the trainer state goes last,
    then one rename publishes it. `keep` removes all but the newest `keep` checkpoints afterwards."""
    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    tmp = root / f".checkpoint-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write(tmp)
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step saved again (a resumed run): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep:
        for _, old in checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_resume(output_dir: str | os.PathLike, resume: str) -> Path | None:
    """The checkpoint to resume from: 'no' gives None, 'auto' the newest one (None when there is none),
    anything else is a checkpoint path. A fresh run into a directory that holds checkpoints is refused,
    so nothing a user trained is silently overwritten."""
    found = checkpoints(output_dir)
    if resume == "no":
        if found:
            raise ConfigError(
                f"output_dir '{output_dir}' already holds {found[-1][1].name}; resume it with --resume "
                f"(resume=auto), or choose another output_dir"
            )
        return None
    if resume == "auto":
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"resume: '{resume}' is not a checkpoint directory (no {STATE_FILE} in it)")
    return path


def load_state(path: Path) -> dict[str, Any]:
    """The trainer state that `save_checkpoint` wrote into the checkpoint folder `path`."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise RlcoreError(f"{file} cannot be read as a trainer state: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise RlcoreError(f"{file} is not a trainer state (no integer 'step')")
    return state
