"""Metrics as JSONL: one object per optimizer step, appended and fsynced so a crash loses at most a line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


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
        kept = [
            line for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, metrics: dict[str, Any]) -> None:
        line = json.dumps(jsonable(metrics))
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
