"""Shared fixtures. Ray tests use one real local Ray (fake GPUs declared for placement) per session."""

from __future__ import annotations

import os

import pytest

# Keep Ray small and local on a 2-core machine; no dashboard, no usage stats, loopback only.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RAY_CPUS = 8
RAY_GPUS = 8  # fake: placement only; nothing runs CUDA here


def start_local_ray(num_cpus: int = RAY_CPUS, num_gpus: int = RAY_GPUS) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
    )


@pytest.fixture
def ray_local():
    """A running local Ray with RAY_CPUS CPUs and RAY_GPUS fake GPUs, shared by consecutive tests.

    A test that needs another cluster shape shuts Ray down itself; the next user of this fixture
    starts a fresh one.
    """
    import ray

    ctx = ray.get_runtime_context() if ray.is_initialized() else None
    if ctx is None or ray.cluster_resources().get("GPU", 0) != RAY_GPUS or ray.cluster_resources().get("CPU", 0) != RAY_CPUS:
        start_local_ray()
    yield ray


def pytest_sessionfinish(session, exitstatus):
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass
