"""Fixtures the template's test modules share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray with 2 CPUs, unless one is running already; shut down afterwards if started here."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    if started:
        ray.shutdown()
