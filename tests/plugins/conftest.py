"""Fixtures shared by the plugin tests."""

from __future__ import annotations

import pytest

from rlcore.testing import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The default tiny model (2 layers, hidden 64, byte-level tokenizer), built once per test session."""
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen2")


@pytest.fixture(scope="session")
def published_qwen3_5(tmp_path_factory):
    """Qwen3.5 as published (`Qwen3_5ForConditionalGeneration`: the tiny language model and a vision tower) and its
    MoE sibling, by arch, built once per test session."""
    root = tmp_path_factory.getbasetemp()
    return {arch: build_tiny_model(root / f"tiny-{arch}-vision", arch=arch, vision=True) for arch in ("qwen3_5", "qwen3_5_moe")}
