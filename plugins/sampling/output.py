"""The sampler's output: a JSONL file written through a temporary file, committed batch by batch.

Each batch's lines are appended to `.{name}.partial` and fsynced; then a small state file (written to a
temporary name, fsynced, renamed) records the partial file's committed length and the next row. A kill -9
at any moment leaves either the old state (the batch's bytes past the committed length are cut off on
resume and the batch is made again) or the new one (the batch is done). The last commit marks the state
`done` and renames the partial file to `name`, so the final file appears whole or not at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlcore import ConfigError, RlcoreError
from rlcore.runtime import logger, open_own


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ResumableJsonl:
    """`output_dir/name` built batch by batch; `start()` for a fresh run, `resume()` to continue one."""

    def __init__(self, output_dir: str | os.PathLike, name: str):
        self.dir = Path(output_dir)
        self.final = self.dir / name
        self.partial = self.dir / f".{name}.partial"
        self.state_path = self.dir / f".{name}.state.json"
        self.state: dict[str, Any] = {}

    # -- starting ----------------------------------------------------------------------------------

    def start(self, meta: dict[str, Any]) -> None:
        """A fresh output; anything a previous run left (the file, its partial, its state) is an error."""
        self.refuse_existing()
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.partial, "wb") as f:
            os.fsync(f.fileno())
        self._write_state({**meta, "bytes": 0, "next_row": 0, "batches": 0, "done": False})

    def refuse_existing(self) -> None:
        """A ConfigError if a previous run left the file, or an unfinished one (its partial or state)."""
        if self.final.exists():
            raise ConfigError(
                f"{self.final} already exists; a fresh run never overwrites it. Choose another output_dir or "
                f"output_file, or move the file away",
                [("output_file", f"'{self.final}' exists")],
            )
        if self.partial.exists() or self.state_path.exists():
            raise ConfigError(
                f"output_dir '{self.dir}' holds an unfinished {self.final.name} ({self.partial.name}); continue it "
                f"with --resume (resume=auto), or choose another output_dir",
                [("resume", f"'{self.partial}' exists")],
            )

    def remove_own(self) -> None:
        """For a fresh run with overwrite_output_dir: remove what an earlier run wrote (its state file proves it
        did: the file, its partial, the state); a file without that state is not rlcore's and stays."""
        if not self.state_path.exists():
            return
        for path in (self.final, self.partial, self.state_path):
            if path.exists():
                path.unlink()
        logger.warning(f"overwrite_output_dir: this run replaces the earlier run's {self.final.name} in '{self.dir}'")

    def resume(self) -> dict[str, Any]:
        """The committed state; the partial file is cut back to its committed length (a batch a kill
        interrupted is made again). A finished output is returned as it is (`done`)."""
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"--resume (resume=auto): output_dir '{self.dir}' holds no unfinished {self.final.name} to continue "
                f"(no {self.state_path.name}); drop --resume to start a new run there"
            ) from None
        except ValueError as exc:
            raise RlcoreError(f"{self.state_path} cannot be read as the sampler's state: {exc}") from None
        self.state = state
        if state.get("done"):
            if self.partial.exists():  # killed between marking it done and the rename
                os.replace(self.partial, self.final)
                _fsync_dir(self.dir)
            if not self.final.exists():
                raise RlcoreError(f"{self.state_path} says {self.final.name} is finished, but it is missing")
            return state
        if not self.partial.exists():
            raise RlcoreError(f"{self.partial} is missing; the state {self.state_path} cannot be continued")
        size = self.partial.stat().st_size
        if size < state["bytes"]:
            raise RlcoreError(
                f"{self.partial} has {size} bytes, fewer than the {state['bytes']} committed; it was changed "
                "outside rlcore and cannot be continued"
            )
        if size > state["bytes"]:  # an uncommitted batch
            with open(self.partial, "r+b") as f:
                f.truncate(state["bytes"])
                os.fsync(f.fileno())
        return state

    # -- writing -----------------------------------------------------------------------------------

    def commit(self, lines: list[str], next_row: int) -> None:
        """Append one batch's lines and record that rows before `next_row` are done."""
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        with open_own(self.partial, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._write_state({**self.state, "bytes": self.state["bytes"] + len(data), "next_row": next_row,
                           "batches": self.state["batches"] + 1})

    def finish(self) -> Path:
        """Mark the output done, then publish it under its final name in one rename."""
        self._write_state({**self.state, "done": True})
        os.replace(self.partial, self.final)
        _fsync_dir(self.dir)
        return self.final

    def _write_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_path)
        _fsync_dir(self.dir)
        self.state = state
