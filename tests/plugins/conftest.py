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


@pytest.fixture
def stale_weight_export(monkeypatch):
    """The hf train engine keeps exporting the weights it first exported (as a LoRA merge that leaves the adapter
    out, whose B starts at zero): the first weight sync is right, every later one sends stale weights."""
    from rlcore.plugins.hf.train import HFTrainEngine

    export = HFTrainEngine.export_weights

    def first_weights_always(self, bucket_bytes=512 << 20):
        if not hasattr(self, "first_weights"):
            self.first_weights = [[(n, t.clone()) for n, t in bucket] for bucket in export(self, bucket_bytes)]
        yield from self.first_weights

    monkeypatch.setattr(HFTrainEngine, "export_weights", first_weights_always)
