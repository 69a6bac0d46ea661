"""Shared fixtures. Ray tests use one real local Ray (fake GPUs declared for placement) per session."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

# Keep Ray small and local on a 2-core machine: no dashboard, no usage stats, no log dedup.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RAY_CPUS = 8
RAY_GPUS = 8  # fake: placement only; nothing runs CUDA here


def start_local_ray(num_cpus: int = RAY_CPUS, num_gpus: int = RAY_GPUS) -> None:
    """A fresh local Ray of this shape (`address="local"`: never a cluster left running on the machine)."""
    from rlcore.runtime import cluster

    cluster.shutdown()
    cluster.init("local", num_cpus=num_cpus, num_gpus=num_gpus)


@pytest.fixture
def ray_local():
    """A running local Ray with RAY_CPUS CPUs and RAY_GPUS fake GPUs, shared by consecutive tests.

    A test that needs another cluster shape shuts Ray down itself; the next user of this fixture
    starts a fresh one.
    """
    import ray

    from rlcore.runtime import cluster

    resources = ray.cluster_resources() if cluster.is_initialized() else {}
    if (resources.get("CPU", 0), resources.get("GPU", 0)) != (RAY_CPUS, RAY_GPUS):
        start_local_ray()
    yield ray


@pytest.fixture(scope="session")
def unlisted_metrics() -> Callable[[Path], list[str]]:
    """`unlisted_metrics(path)`: the names in a metrics.jsonl that docs/outputs.md's table of metric names does
    not list (a `<part>` there stands for any one part of a name): [] for a run that keeps to the vocabulary."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "outputs.md").read_text()
    start = text.index("| quantity | name | algorithms |", text.index("## Metric names"))
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    names = [name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[2])]
    patterns = [re.compile("/".join("[^/]+" if re.fullmatch(r"<\w+>", part) else re.escape(part)
                                    for part in name.split("/"))) for name in names]

    def unlisted(path: Path) -> list[str]:
        keys = {key for line in Path(path).read_text().splitlines() for key in json.loads(line)}
        return sorted(key for key in keys if not any(p.fullmatch(key) for p in patterns))

    return unlisted


def pytest_sessionfinish(session, exitstatus):
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass
