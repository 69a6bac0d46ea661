"""`rlcore.conditional`: where a `*ForConditionalGeneration` checkpoint (Qwen3.5 as published) holds its language
model, read from its own files. The engines' use of it: tests/plugins/test_conditional_generation.py."""

from __future__ import annotations

import json

import pytest
import torch

from rlcore import ConfigError
from rlcore.engines import checkpoint_layout
from rlcore.testing import build_tiny_model


def test_the_layout_is_read_from_the_checkpoint(tmp_path):
    layout = checkpoint_layout(build_tiny_model(tmp_path / "published", arch="qwen3_5", vision=True))
    assert layout.prefix == "model.language_model."
    assert layout.carried() and all(n.startswith("model.visual.") for n in layout.carried())
    assert layout.to_checkpoint("model.layers.0.mlp.down_proj.weight") == "model.language_model.layers.0.mlp.down_proj.weight"
    assert layout.to_checkpoint("lm_head.weight") == "lm_head.weight"
    assert layout.from_checkpoint("model.language_model.norm.weight") == "model.norm.weight"
    assert checkpoint_layout(build_tiny_model(tmp_path / "text", arch="qwen3_5")) is None  # a causal LM: as it is


def test_a_conditional_checkpoint_without_a_language_model_is_refused(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForConditionalGeneration"]}))
    save_file({"model.vision.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="FooForConditionalGeneration at .*: no language model found"):
        checkpoint_layout(tmp_path)
