"""A `*ForConditionalGeneration` checkpoint (Qwen3.5 as published: a language model and a vision tower) as rlcore
trains it: the train engines hold the language model alone, as transformers' causal LM of the checkpoint names it
(`model.layers.0...`, `lm_head.weight`), and everything else of the checkpoint (`model.visual.*`, `mtp.*`) rides
along unchanged.

`CheckpointLayout` is read from the checkpoint's own files: the language model's prefix there (where its
`embed_tokens.weight` lies, `model.language_model.` for Qwen3.5) and the names of every tensor. Engines' weights go
into a checkpoint or `final/` through `to_checkpoint` and `with_carried`, so nothing of the checkpoint is dropped
and the written folder loads as what its config says; they come back through `from_checkpoint`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, RlcoreError

CONDITIONAL = "ForConditionalGeneration"
TEXT_PREFIX = "model."  # where a causal LM of transformers holds its decoder
HEAD_PREFIX = "lm_head."  # and its output layer, named alike in the conditional checkpoint


@dataclass(frozen=True)
class CheckpointLayout:
    """Where a conditional-generation checkpoint holds its language model (`prefix`, in place of the causal LM's
    `model.`) and the names of all its tensors (`names`), read from `directory`."""

    directory: Path
    prefix: str
    names: frozenset[str]

    def to_checkpoint(self, name: str) -> str:
        """The checkpoint's name of a causal-LM name (`model.layers.0.x` -> `model.language_model.layers.0.x`); a
        name the checkpoint already has (`lm_head.weight`, or a model loaded whole) stays."""
        if name in self.names or not name.startswith(TEXT_PREFIX):
            return name
        return self.prefix + name[len(TEXT_PREFIX):]

    def from_checkpoint(self, name: str) -> str:
        """The causal-LM name of a checkpoint name of the language model (the inverse of `to_checkpoint`)."""
        return TEXT_PREFIX + name[len(self.prefix):] if name.startswith(self.prefix) else name

    def is_language_model(self, name: str) -> bool:
        """Whether a checkpoint name belongs to the language model (what the train engines train)."""
        return name.startswith((self.prefix, HEAD_PREFIX))

    def carried(self) -> list[str]:
        """The checkpoint's tensors outside the language model (a vision tower, a projector), sorted."""
        return sorted(n for n in self.names if not self.is_language_model(n))

    def with_carried(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """`named` (causal-LM names) in the checkpoint's names, then each tensor outside the language model that
        `named` did not give, read from the checkpoint's files as it is (bit for bit)."""
        given = set()
        for name, tensor in named:
            name = self.to_checkpoint(name)
            given.add(name)
            yield name, tensor
        yield from self.read(n for n in self.carried() if n not in given)

    def language_model(self, weights: dict[str, Any], own: set[str]) -> dict[str, Any]:
        """A folder's tensors (`write`'s, in the checkpoint's names) in the names of a model whose own are `own`,
        the carried ones it does not hold left out."""
        return {name if name in own else self.from_checkpoint(name): tensor for name, tensor in weights.items()
                if name in own or self.is_language_model(name)}

    def write(self, path: Path, named: Iterable[tuple[str, Any]]) -> None:
        """`named` (causal-LM names) and the carried tensors as safetensors in the checkpoint's names into `path`,
        beside a copy of the checkpoint's config, generation config and tokenizer files: a folder that loads as the
        checkpoint does."""
        import shutil

        from huggingface_hub import save_torch_state_dict

        path.mkdir(parents=True, exist_ok=True)
        tensors = dict(self.with_carried((n, t.detach().to("cpu", copy=True).contiguous()) for n, t in named))
        save_torch_state_dict(tensors, path, max_shard_size="5GB")
        for file in self.directory.iterdir():
            if file.is_file() and file.suffix in (".json", ".txt", ".model", ".jinja") and not file.name.endswith(".index.json"):
                shutil.copy2(file, path / file.name)

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors of `names`, as stored."""
        from safetensors import safe_open

        wanted = set(names)
        for file in sorted(self.directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in sorted(wanted & set(handle.keys())):
                    wanted.discard(name)
                    yield name, handle.get_tensor(name)
        if wanted:  # an index names them, but their file is not here (a hub snapshot not fully downloaded)
            raise RlcoreError(f"{self.directory} lacks the files of {len(wanted)} of its tensors (e.g. "
                              f"{sorted(wanted)[0]}), which the written model must carry; download the whole checkpoint")


def checkpoint_layout(model: str | Path) -> CheckpointLayout | None:
    """The layout of `model` (a directory, or a hub id in the local Hugging Face cache: nothing is downloaded) where
    its config names a `*ForConditionalGeneration` architecture; None for any other checkpoint, or one whose files
    are not here. A conditional checkpoint whose language model cannot be found (no `...embed_tokens.weight` beside
    `...layers.`) is a ConfigError: rlcore trains the language model and nothing else."""
    from .model_checks import read_model

    files = read_model(str(model))
    if files is None:
        return None
    directory = files.path
    architectures = files.config.get("architectures") or []
    if not any(str(a).endswith(CONDITIONAL) for a in architectures):
        return None
    names = _tensor_names(directory)
    if not names:
        return None
    embeds = sorted(n[: -len("embed_tokens.weight")] for n in names if n.endswith("embed_tokens.weight"))
    prefix = next((p for p in embeds if any(n.startswith(p + "layers.") for n in names)), None)
    if prefix is None:
        message = (f"{architectures[0]} at {directory}: no language model found (no '<prefix>embed_tokens.weight' beside "
                   "'<prefix>layers.' among its tensors); rlcore trains a conditional-generation checkpoint's language "
                   "model only")
        raise ConfigError(message, [("model", message)])
    return CheckpointLayout(directory=directory, prefix=prefix, names=frozenset(names))


def _tensor_names(directory: Path) -> set[str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    from safetensors import safe_open

    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names
