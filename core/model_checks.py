"""What a model's own files say about a run, read before any GPU is taken: its context length (with rope
scaling), its weights and tokenizer files, its chat template, its vocabulary, its heads and layers.

An algorithm names the models a run loads and what it asks of each (`ModelUse`, from `RoleTrainer.models`); the
base checks them with `model_problems` in `rlcore config validate` and before `rlcore run` allocates anything.
Nothing is loaded: config.json and the tokenizer's JSON files are read as text. A hub id is read from the local
Hugging Face cache only (no network call); a model that is not there is left to the checks that load it.
Engines read the same `ModelFiles` in their `EngineSpec.check` (heads against tensor sizes).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# config.json keys that bound the positions a model takes (vLLM reads the same ones and takes the smallest)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
# rope types whose max_position_embeddings already counts the scaling (vLLM does not multiply these)
SCALED_ALREADY = ("llama3", "longrope", "su")


@dataclass(frozen=True)
class ModelUse:
    """A model a run loads and what the run asks of it.

    `key` is the config key naming it (`model`, `teacher_model`, `teacher.model`), `name` its value. `lengths`:
    the tokens a sequence may take with it, each as `(keys, values)`:
    `(("max_prompt_length", "max_completion_length"), (512, 256))`, their sum being the length (an engine checks its
    own context key, vLLM's `vllm_max_model_len`, in its `EngineSpec.check`). `conversations`:
    called only where the tokenizer has no chat template, says which key holds conversation prompts (the dataset's
    messages, which need one), or None. `tokenizer_of`: the key of the model whose token ids this one reads (a GKD
    teacher reads the student's), with `same_vocabulary_size` where logits are compared over the whole vocabulary.
    `roles`: the generate roles' sections that serve it, whose engine checks its options against it.
    """

    key: str
    name: str
    lengths: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = ()
    conversations: Callable[[], str | None] | None = None
    tokenizer_of: str | None = None
    same_vocabulary_size: bool = False
    roles: tuple[str, ...] = ()  # the role sections whose engines load it (their `EngineSpec.check` reads it too)


@dataclass
class ModelFiles:
    """A model's files as found on disk: a local directory, or a hub id's snapshot in the Hugging Face cache
    (`cached`: then a missing file may only not be downloaded yet, so none is reported missing)."""

    name: str
    path: Path
    cached: bool = False
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's keys (a multimodal config nests them in `text_config`)."""
        return self.config.get("text_config") or self.config

    def value(self, key: str) -> Any:
        return self.text_config.get(key, self.config.get(key))

    def has_weights(self) -> bool:
        return any(next(self.path.glob(pattern), None) is not None for pattern in WEIGHTS)

    def has_tokenizer(self) -> bool:
        return any((self.path / name).is_file() for name in TOKENIZER_FILES)

    @cached_property
    def tokenizer_config(self) -> dict[str, Any]:
        return _json(self.path / "tokenizer_config.json") or {}

    def has_chat_template(self) -> bool:
        """A chat template in tokenizer_config.json, chat_template.jinja or chat_template.json (transformers'
        places for it)."""
        if self.tokenizer_config.get("chat_template"):
            return True
        if (self.path / "chat_template.jinja").is_file() or (self.path / "additional_chat_templates").is_dir():
            return True
        return bool((_json(self.path / "chat_template.json") or {}).get("chat_template"))

    def context(self) -> tuple[int, str] | None:
        """(the positions the model takes, how that was read), or None where config.json says nothing."""
        found = [(self.value(k), k) for k in POSITION_KEYS if isinstance(self.value(k), int) and self.value(k) > 0]
        if not found:
            return None
        limit, key = min(found)
        rope = self.value("rope_scaling") or self.value("rope_parameters") or {}
        factor = rope.get("factor") if isinstance(rope, dict) else None
        kind = rope.get("rope_type") or rope.get("type") if isinstance(rope, dict) else None
        if isinstance(factor, (int, float)) and factor > 1 and kind not in SCALED_ALREADY:
            original = rope.get("original_max_position_embeddings") if kind == "yarn" else None
            base = original if isinstance(original, int) else limit
            return int(base * factor), f"{key} {limit}, rope scaling '{kind}' x{factor:g}"
        return limit, key

    @cached_property
    def vocabulary(self) -> tuple[str, dict[str, int]] | None:
        """The tokenizer's token -> id map (tokenizer.json's model vocabulary and added tokens) with its file, or a
        sentencepiece model's digest; None where neither file is there."""
        data = _json(self.path / "tokenizer.json")
        if isinstance(data, dict) and isinstance((data.get("model") or {}).get("vocab"), (dict, list)):
            vocab = data["model"]["vocab"]
            ids = dict(vocab) if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}
            ids.update({t["content"]: t["id"] for t in data.get("added_tokens") or () if "content" in t and "id" in t})
            return "tokenizer.json", ids
        model = self.path / "tokenizer.model"
        if model.is_file():
            return "tokenizer.model", {hashlib.sha256(model.read_bytes()).hexdigest(): 0}
        return None


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_model(name: str) -> ModelFiles | None:
    """The files of the model `name` (a directory, or a hub id in the local Hugging Face cache), without loading
    anything or asking the network; None where they are not here (the checks that load the model report that)."""
    local = Path(os.path.expanduser(str(name)))
    if local.is_dir():
        return ModelFiles(str(name), local, config=_json(local / "config.json") or {})
    if local.exists() or str(name).startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(name), "config.json")
    except Exception:  # not a repo id, or no huggingface_hub: nothing to read here
        return None
    if not isinstance(cached, str):
        return None
    return ModelFiles(str(name), Path(cached).parent, cached=True, config=_json(Path(cached)) or {})


def model_problems(uses: list[ModelUse]) -> list[tuple[str, str]]:
    """Every problem the models' files show with the run's keys, one (key, message) each."""
    problems: list[tuple[str, str]] = []
    read = {use.key: read_model(use.name) for use in uses if use.name}
    shortest: dict[str, int] = {}  # a length two models must hold is reported once, against the shorter context
    for use in uses:
        files = read.get(use.key)
        if files is None:
            continue
        problems += _file_problems(use, files)
        for key, limit, message in _length_problems(use, files):
            if key in shortest and shortest[key] <= limit:
                continue
            problems = [p for p in problems if p[0] != key] + [(key, message)]
            shortest[key] = limit
        # (a hub id's snapshot may hold tokenizer_config.json without its chat_template.jinja yet)
        chatless = not files.cached and files.has_tokenizer() and not files.has_chat_template()
        if use.conversations is not None and chatless:
            where = use.conversations()
            if where:
                problems.append((where, f"holds conversation prompts (messages), but the tokenizer of {use.key} "
                                 f"'{use.name}' has no chat template (none in tokenizer_config.json, no "
                                 "chat_template.jinja) to turn them into tokens; give text prompts, or a model "
                                 "whose tokenizer has a chat template"))
        other = read.get(use.tokenizer_of) if use.tokenizer_of else None
        if other is not None:
            problems += _vocabulary_problems(use, files, use.tokenizer_of, other)
    return problems


def _file_problems(use: ModelUse, files: ModelFiles) -> list[tuple[str, str]]:
    if files.cached:  # a hub id's snapshot may be partly downloaded: the workers fetch the rest
        return []
    missing = []
    if not (files.path / "config.json").is_file():
        missing.append("config.json")
    if not files.has_weights():
        missing.append("weights (*.safetensors, *.bin or their index)")
    if not files.has_tokenizer():
        missing.append(f"tokenizer ({', '.join(TOKENIZER_FILES)})")
    if not missing:
        return []
    return [(use.key, f"'{use.name}' is a directory without {' and without '.join(missing)}; give the directory "
             "of a saved model (save_pretrained writes the model, its tokenizer too)")]


def _length_problems(use: ModelUse, files: ModelFiles) -> list[tuple[str, int, str]]:
    """(key, the model's limit, message) for each length of `use` longer than the model's context."""
    context = files.context()
    if context is None:
        return []
    limit, how = context
    problems = []
    for keys, values in use.lengths:
        total = sum(values)
        if total <= limit:
            continue
        named = " + ".join(keys)
        given = str(total) if len(values) == 1 else f"{' + '.join(map(str, values))} = {total}"
        fix = (f"set it to at most {limit}" if len(keys) == 1 else f"lower them to {limit} in all")
        problems.append((named, limit, f"{given} tokens is longer than the context of {use.key} '{use.name}': {limit} "
                         f"positions ({how}, config.json); {fix}, or use a model with a longer context"))
    return problems


def _vocabulary_problems(use: ModelUse, files: ModelFiles, other_key: str, other: ModelFiles) -> list[tuple[str, str]]:
    problems = []
    size, other_size = files.value("vocab_size"), other.value("vocab_size")
    if use.same_vocabulary_size and isinstance(size, int) and isinstance(other_size, int) and size != other_size:
        problems.append((use.key, f"'{use.name}' has a vocabulary of {size} ids (vocab_size), {other_key} "
                         f"'{other.name}' {other_size}; full-vocabulary distillation compares their logits id by "
                         "id: use a model of the same vocabulary, or set gkd_logits_topk"))
    mine, theirs = files.vocabulary, other.vocabulary
    if mine and theirs and mine[0] == theirs[0] and mine[1] != theirs[1]:
        moved = sum(1 for token, i in theirs[1].items() if mine[1].get(token) != i)
        problems.append((use.key, f"'{use.name}' has another tokenizer than {other_key} '{other.name}' ({mine[0]}: "
                         f"{moved} of its {len(theirs[1])} tokens have another id or none); it reads {other_key}'s "
                         "token ids, so both need one tokenizer: use a model of the same family"))
    return problems


__all__ = ["ModelFiles", "ModelUse", "model_problems", "read_model"]
