"""Metrics as JSONL: one object per optimizer step, appended and fsynced so a crash loses at most a line.

A last line torn by a crash is dropped (with a warning) when a run resumes; a bad line anywhere else is an
error naming the file and the line."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from .errors import RlcoreError
from .log import logger, open_own, scrub_data


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as strict JSON values: tensors to numbers, NaN and infinities to null."""
    return {k: _plain(v) for k, v in metrics.items()}


class MetricsWriter:
    """Appends step metrics to `path`. `resume_at(step)` drops lines of steps after `step` (a resumed run
    recomputes them) by rewriting the file atomically; nothing before it is touched."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def resume_at(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line, row in self._rows(drop_torn_tail=True) if row.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, metrics: dict[str, Any]) -> None:
        line = json.dumps(scrub_data(jsonable(metrics)))  # a hook's or a reward's text: no secret, in any encoding
        data = (line + "\n").encode("utf-8")
        with open_own(self.path, "ab", buffering=0) as f:  # unbuffered: nothing is left to write at close
            start = os.fstat(f.fileno()).st_size
            try:
                while data:
                    data = data[f.write(data):]
                os.fsync(f.fileno())
            except OSError as exc:  # a full disk, a file size limit: no torn line is left behind
                with contextlib.suppress(OSError):
                    os.truncate(self.path, start)
                raise RlcoreError(f"cannot write {self.path}: {exc.strerror or exc}; the step's metrics are not "
                                  f"in it (free space, then --resume)") from None

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [row for _, row in self._rows(drop_torn_tail=False)]

    def _rows(self, drop_torn_tail: bool) -> list[tuple[str, dict[str, Any]]]:
        """(line, parsed object) of every line; the last line, when torn by a crash, is dropped if asked."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            line = self.path.read_bytes().count(b"\n", 0, exc.start) + 1
            raise RlcoreError(f"{self.path} line {line} is not UTF-8 text (byte {exc.object[exc.start]:#04x}): the "
                              f"file is damaged") from None
        lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
        rows = []
        for i, (number, line) in enumerate(lines):
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"a {type(row).__name__}, not an object")
            except ValueError as exc:
                if drop_torn_tail and i == len(lines) - 1:
                    logger.warning(f"{self.path} line {number} is torn (a crash while writing); dropped it")
                    break
                raise RlcoreError(f"{self.path} line {number} is not a JSON object of metrics: {exc}") from None
            rows.append((line, row))
        return rows
