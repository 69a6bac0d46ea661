"""SFT and pre-training data: local JSONL/JSON/Parquet rows, checked with errors naming the file, the row and
the column, then stored once per node as an Arrow dataset that every worker of the node memory-maps.

- sft: a `messages` column (a conversation ending in the assistant's turn), or `prompt` and `completion`
  columns (TRL's prompt-completion form, where `completion_only_loss` applies); one form per run.
- pt: a `text` column of non-empty strings.

`node_dataset` is called under "global main first, then each node's local main first": the first worker of
a node reads and stores the rows, the others open what it stored, and TRL's / datasets' `map` caches next to
it, so tokenising also happens once per node. The sampler of each rank then reads only its shard's rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlcore import ConfigError
from rlcore.data import conversation_view, dataset_error, dataset_file, load_rows
from rlcore.paths import writable_folder

KINDS = ("sft", "pt")


def self_cognition(row: dict[str, Any], names: dict[str, list[str]]) -> dict[str, Any]:
    """`row` with ms-swift's self-cognition placeholders filled: `{{NAME}}` with `names["NAME"]`, `{{AUTHOR}}` with
    `names["AUTHOR"]`, in every message's text and in `prompt`/`completion`. Given two values, the first is for
    rows tagged `zh` and the second for the others, as ms-swift's (`model_name: [小黄, Xiao Huang]`)."""

    def fill(value: Any) -> Any:
        if isinstance(value, str):
            for placeholder, given in names.items():
                value = value.replace("{{" + placeholder + "}}", given[0] if row.get("tag") == "zh" else given[-1])
            return value
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, dict):
            return {k: fill(v) if k in ("content", "text") else v for k, v in value.items()}
        return value

    return {k: fill(v) if k in ("messages", "prompt", "completion") else v for k, v in row.items()}


def sft_rows(path: str | os.PathLike, names: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
    """The rows of an SFT file as TRL takes them: `{"messages"}` or `{"prompt", "completion"}` (and `tools`),
    with the self-cognition placeholders of `names` filled (`self_cognition`)."""
    rows = load_rows(path)
    if names:
        rows = [self_cognition(row, names) for row in rows]
    conversation_view(rows, path)  # every row is a conversation ending in the assistant's turn, or says why not
    forms: dict[str, list[int]] = {}
    out = []
    for number, row in enumerate(rows, start=1):
        form = ("messages",) if row.get("messages") is not None else ("prompt", "completion")
        forms.setdefault(" and ".join(form), []).append(number)
        out.append({k: row[k] for k in (*form, "tools") if row.get(k) is not None})
    if len(forms) > 1:
        each = "; ".join(f"rows {_few(numbers)} use {form}" for form, numbers in forms.items())
        raise dataset_error(str(path), [("rows", f"mix the two forms of a row ({each}); give every row `messages`, "
                                           "or every row `prompt` and `completion`")])
    kinds = {(type(r.get("prompt")).__name__, type(r.get("completion")).__name__) for r in out if "prompt" in r}
    if len(kinds) > 1:
        raise dataset_error(str(path), [("column 'prompt'/'completion'", "mixes text and message lists between "
                                           "rows; use one of them in every row")])
    return out


def text_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a pre-training file: `{"text"}`, each a non-empty string."""
    problems, out = [], []
    for number, row in enumerate(load_rows(path), start=1):
        text = row.get("text")
        if not isinstance(text, str) or not text:
            got = "is missing" if text is None else f"is {type(text).__name__} {str(text)[:40]!r}"
            hint = "; conversations train with --plugin sft" if row.get("messages") is not None or (
                row.get("prompt") is not None and row.get("completion") is not None) else ""
            problems.append((f"row {number}, column 'text'", f"{got}; a pre-training row needs non-empty text{hint}"))
        else:
            out.append({"text": text})
    if problems:
        raise dataset_error(str(path), problems)
    return out


def read_rows(paths: list[str], kind: str, names: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
    return [row for path in paths for row in (sft_rows(path, names) if kind == "sft" else text_rows(path))]


def check_files(paths: list[str], kind: str) -> list[tuple[str, str]]:
    """Every problem of the data files, as (key, message), before anything is allocated."""
    problems: list[tuple[str, str]] = []
    for path in paths:
        try:
            read_rows([path], kind)
        except ConfigError as exc:
            problems.extend(exc.problems or [("dataset", str(exc))])
    return problems


def _few(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:5])) + (f", ... ({len(numbers)} in all)" if len(numbers) > 5 else "")


def cache_folder(cache_root: str | None = None) -> tuple[Path, str]:
    """Where a node stores its datasets, and what named it (dataset_cache_dir, RLCORE_DATA_CACHE, or the system's
    temporary directory), for a message that says which to change."""
    if cache_root:
        return Path(cache_root), "dataset_cache_dir"
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]), CACHE_ENV
    return Path(tempfile.gettempdir()) / "rlcore-datasets", "the temporary directory (TMPDIR)"


CACHE_ENV = "RLCORE_DATA_CACHE"


def node_dataset(
    paths: list[str], kind: str, cache_root: str | None = None, names: dict[str, list[str]] | None = None
) -> tuple[Any, bool]:
    """The rows of `paths` (self-cognition placeholders filled from `names`) as a memory-mapped
    `datasets.Dataset` stored on this node's disk (once: a later call with the same files, unchanged, opens what
    the first one stored), and whether this call read the files."""
    from datasets import Dataset, load_from_disk

    files = [(dataset_file(p)[0].expanduser().resolve(), dataset_file(p)[1]) for p in paths]  # FILE#N: its first N rows
    key = json.dumps([kind, names or {}] + [[str(f), n, f.stat().st_size, f.stat().st_mtime_ns] for f, n in files])
    root, named = cache_folder(cache_root)
    folder = root / hashlib.sha256(key.encode()).hexdigest()[:20]
    read = not (folder / "dataset_info.json").is_file()
    if read:
        rows = read_rows([str(f) + (f"#{n}" if n is not None else "") for f, n in files], kind, names)
        writable_folder(root, named)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
        try:
            try:
                dataset = Dataset.from_list(rows)
            except Exception as exc:  # arrow: a column whose type differs between rows
                raise ConfigError(f"dataset {', '.join(paths)}: the rows do not share one schema ({exc})") from None
            dataset.save_to_disk(str(tmp))
            try:
                os.replace(tmp, folder)
            except OSError:  # another run of this node stored it first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(folder)), read


