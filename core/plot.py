"""`rlcore plot`: metrics.jsonl as curves against the step, one panel per metric, saved as a PNG."""

from __future__ import annotations

import math
from pathlib import Path

from .errors import ConfigError, RlcoreError, did_you_mean
from .metrics import MetricsWriter

DEFAULT_KEYS = ("reward", "kl", "completions/mean_length", "loss", "grad_norm")


def plot_metrics(path: str | Path, keys: list[str] | None = None, out: str | Path | None = None) -> Path:
    """Draw `keys` (default: the usual GRPO curves that the file has) from a metrics.jsonl; return the PNG."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"plot: '{path}' does not exist; pass a run's metrics.jsonl")
    rows = MetricsWriter(path).read()
    if not rows:
        raise ConfigError(f"plot: '{path}' holds no metrics yet")
    known = sorted({k for row in rows for k in row if k != "step"})
    if keys:
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise ConfigError(
                f"plot: {path} has no metric {', '.join(repr(k) for k in unknown)}."
                f"{did_you_mean(unknown[0], known)} It has: {', '.join(known)}"
            )
    else:
        keys = [k for k in DEFAULT_KEYS if k in known] or known[:4]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RlcoreError("plot needs matplotlib: pip install 'rlcore[plot]'") from exc

    out = Path(out) if out else path.with_suffix(".png")
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(str(path.parent.name or path), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
