"""Everything under tests/gpu is marked `gpu` (CI deselects it) and skips, saying why, without CUDA.

On the GPU machine: `python3 -m pytest -m gpu tests/gpu`. Modules here import vLLM, Ray and CUDA code
inside fixtures and tests only, so that collecting them on a CPU machine works.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True, scope="session")  # session: before the modules' engine fixtures
def _needs_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (torch.cuda.is_available() is False); run on the GPU machine")

