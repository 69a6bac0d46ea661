"""`rlcore plot`: a run's metrics.jsonl as curves against the step, one panel per metric, saved as a PNG.

The default panels are the algorithm's own (`Trainer.plot_keys`, which the run notes in output_dir's
rlcore_run.json), those the file has; a metric null at every step (GRPO's `kl` with beta 0) gets no blank
panel, nor one that repeats an earlier panel (GKD's `jsd` is its `loss` with sft_alpha 0): a line under the
panels names each. A metric's `KEY_start` (GKD's `eval/jsd_start`, before training) is the first point of its
panel, at step 0."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from .checkpoint import RUN_FILE
from .errors import ConfigError, RlcoreError, did_you_mean
from .extras import MissingExtra
from .metrics import MetricsWriter
from .paths import file_kind, folder_problem

DEFAULT_KEYS = ("reward", "kl", "completions/mean_length", "loss", "grad_norm")  # a run without a note


def metrics_file(path: str | Path) -> Path:
    """A run's metrics.jsonl, given it or its output_dir."""
    path = Path(path)
    if path.is_dir():
        if not (path / "metrics.jsonl").is_file():
            raise ConfigError(f"plot: '{path}' holds no metrics.jsonl; pass a run's output_dir or its metrics.jsonl")
        return path / "metrics.jsonl"
    if not path.is_file():
        kind = f"is {file_kind(path.stat().st_mode)}" if path.exists() else "does not exist"
        raise ConfigError(f"plot: '{path}' {kind}; pass a run's output_dir or its metrics.jsonl")
    return path


def _png_target(out: Path) -> Path:
    """`out`, a PNG to write: refused in one line naming it where it is a folder, a FIFO or a device, or where its
    folder is not one rlcore can write into."""
    if out.exists() and not out.is_file():
        raise ConfigError(f"plot: -o {out}: is {file_kind(out.stat().st_mode)}, not a file; give a .png path")
    problem = folder_problem(out.parent if str(out.parent) else Path("."))
    if problem:
        raise ConfigError(f"plot: -o {out}: its folder {out.parent} {problem}; give a .png path in a writable folder")
    return out


def _save(fig: Any, out: Path) -> None:
    """The figure into `out` by one rename: a full disk or a file size limit leaves no torn PNG and is one line."""
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise RlcoreError(f"plot: cannot write {out}: {exc.strerror or exc}; free some space, or give -o elsewhere") from None


def run_note(metrics: Path) -> dict[str, Any]:
    """What the run noted beside its metrics (algorithm, plot_keys); {} for a run that noted nothing."""
    try:
        note = json.loads((metrics.parent / RUN_FILE).read_text())
        return note if isinstance(note, dict) else {}
    except (OSError, ValueError):
        return {}


def plot_metrics(path: str | Path, keys: list[str] | None = None, out: str | Path | None = None) -> Path:
    """Draw `keys` (default: the algorithm's panels that the file has) from a run's metrics.jsonl or its
    output_dir; return the PNG (default: beside the metrics)."""
    path = metrics_file(path)
    rows = MetricsWriter(path).read()
    if not rows:
        raise ConfigError(f"plot: '{path}' holds no metrics yet")
    known = sorted({k for row in rows for k in row if k != "step"})
    note = run_note(path)
    if keys:
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise ConfigError(
                f"plot: {path} has no metric {', '.join(repr(k) for k in unknown)}."
                f"{did_you_mean(unknown[0], known)} It has: {', '.join(known)}"
            )
    else:
        keys = [k for k in note.get("plot_keys") or DEFAULT_KEYS if k in known] or known[:4]
    out = _png_target(Path(out) if out else path.with_suffix(".png"))
    name, algorithm = path.parent.name or str(path), note.get("algorithm")
    title = f"{name}{f' ({algorithm})' if algorithm and algorithm != name else ''}: {len(rows)} steps"
    fig = figure(rows, keys, title)
    import matplotlib.pyplot as plt

    try:
        _save(fig, out)
    finally:
        plt.close(fig)
    return out


def figure(rows: list[dict[str, Any]], keys: list[str], title: str) -> Any:
    """The matplotlib figure of `keys` over the rows' steps: a panel for each that has a value, integer step ticks."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise MissingExtra(f"rlcore plot needs the 'plot' extra (matplotlib cannot be imported: {exc}): "
                           "pip install 'rlcore[plot]'") from None

    def values(key: str) -> list[tuple[Any, float]]:
        return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]

    # `KEY_start` (GKD's eval/jsd_start: measured before training) is KEY's point at the step before its row's
    points = {key: [(step - 1, v) for step, v in values(f"{key}_start")][:1] + values(key) for key in keys}
    empty = [key for key in keys if not points[key]]
    drawn: list[str] = []
    same: dict[str, str] = {}  # a metric equal to an earlier panel's at every step -> that panel
    for key in (k for k in keys if points[k]):
        twin = next((k for k in drawn if _same(points[k], points[key])), None)
        if twin is None:
            drawn.append(key)
        else:
            same[key] = twin
    drawn = drawn or keys[:1]
    notes = [f"null at every step (not computed in this run), so not drawn: {', '.join(empty)}"] if empty else []
    notes += [f"{key}: the same as {twin} at every step, so not drawn" for key, twin in same.items()]
    fig, axes = plt.subplots(len(drawn), 1, figsize=(7, 1.9 * len(drawn) + 0.6 + 0.2 * len(notes)), sharex=True,
                             squeeze=False)
    steps = [x for key in drawn for x, _ in points[key]]
    for ax, key in zip(axes[:, 0], drawn):
        xy = points[key]
        ax.plot([p[0] for p in xy], [p[1] for p in xy], marker="." if len(xy) < 50 else None)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axis = axes[-1, 0]
    axis.set_xlabel("step")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if steps:
        axis.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    fig.suptitle(title, fontsize=9)
    for i, note in enumerate(reversed(notes)):  # what is not drawn, and why, one line each under the panels
        fig.text(0.01, (0.05 + 0.2 * i) / fig.get_figheight(), note, fontsize=7, color="0.35", va="bottom")
    fig.tight_layout(rect=(0, 0.2 * len(notes) / fig.get_figheight(), 1, 1))
    return fig


def _same(a: list[tuple[Any, float]], b: list[tuple[Any, float]]) -> bool:
    """The same steps and, to float32's precision, the same values."""
    return len(a) == len(b) and all(sa == sb and math.isclose(va, vb, rel_tol=1e-6, abs_tol=1e-12)
                                    for (sa, va), (sb, vb) in zip(a, b))
