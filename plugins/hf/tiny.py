"""The tiny model builder moved to `rlcore.testing`, where every plugin and test can reach it; this name stays."""

from rlcore.testing import build_tiny_model, build_tokenizer

__all__ = ["build_tiny_model", "build_tokenizer"]
