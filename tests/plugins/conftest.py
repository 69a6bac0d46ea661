"""Fixtures shared by the plugin tests."""

from __future__ import annotations

import pytest

from rlcore.testing import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The default tiny model (2 layers, hidden 64, byte-level tokenizer), built once per test session."""
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen2")
