"""Datasets: local JSONL, JSON or Parquet rows, loaded once, seen through the view an algorithm needs,
and the order a run draws them in.

- `load_rows(path)`: the file's rows as they are. A path ending in `#N` (ms-swift's `dataset: NAME#N`) is
  the first N rows of the file before it, unless a file of that very name exists.
- `prompt_view(rows)` (RL, sampling): a row needs a `prompt` (a string, or a conversation: a list of
  `{"role", "content"}` messages) or a `messages` column (a conversation; a final assistant message, the
  reference answer, is dropped from the prompt). Every other column (`solution`, ...) travels with the
  row to the reward functions. `load_prompts(path)` is both at once.
- `conversation_view(rows)` (SFT, distillation): a row's whole conversation in `messages`, assistant turn
  kept, from a `messages` column or a `prompt` with a `completion` (TRL's prompt-completion form).
- `PromptEncoder`: a model's tokenizer turning prompts into token ids (chat template, length cut).
- `completion_text(completion)`: a completion's text, whether a string or a conversation.

Mistakes in the file are `ConfigError`s naming the file, the row (1-based; the line for JSONL) and the
column, all at once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from .errors import ConfigError, RlcoreError

logger = logging.getLogger("rlcore")

FORMATS = (".jsonl", ".json", ".parquet")
MAX_REPORTED = 10
_FIRST_ROWS = re.compile(r"^(?P<file>.+)#(?P<rows>[0-9]+)$")


def dataset_file(path: str | os.PathLike) -> tuple[Path, int | None]:
    """(the file, how many of its first rows to take, or None for all) of a dataset path: `data.jsonl#100`
    is the first 100 rows of data.jsonl (ms-swift's spelling), unless a file named `data.jsonl#100` exists."""
    match = _FIRST_ROWS.match(str(path))
    if match is None or Path(path).is_file():
        return Path(path), None
    return Path(match["file"]), int(match["rows"])


def completion_text(completion: Any) -> str:
    """The text of a completion: the string itself, or the content of the last message of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    raise RlcoreError(f"a completion must be a string or a list of messages; got {type(completion).__name__}")


def _read_jsonl(path: Path, problems: list[tuple[str, str]]) -> list[tuple[int, Any]]:
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.append((f"row {line_no}", f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                 f"{exc.start + 1}); save the file as UTF-8"))
                continue
            if not line.strip():
                continue
            try:
                rows.append((line_no, json.loads(line)))
            except json.JSONDecodeError as exc:
                problems.append((f"row {line_no}", f"is not valid JSON ({exc.msg} at column {exc.colno})"))
    return rows


def _read_json(path: Path) -> list[tuple[int, Any]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"dataset '{path}' is not UTF-8 text: byte 0x{raw[exc.start]:02x} on line {line}; "
                          "save the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"dataset '{path}' is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise ConfigError(f"dataset '{path}' must hold a list of objects or {{\"data\": [...]}}; it holds a {type(data).__name__}")
    return list(enumerate(data, start=1))


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(f"dataset '{path}' is Parquet, which needs pyarrow: pip install 'rlcore[data]'") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise ConfigError(f"dataset '{path}' cannot be read as Parquet: {exc}") from exc
    return list(enumerate(table.to_pylist(), start=1))


def _conversation_problem(value: Any) -> str | None:
    """Why `value` is not a list of messages, or None when it is one."""
    if not isinstance(value, list) or not value:
        return f"must be a non-empty list of messages; got {type(value).__name__}"
    for i, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, not an object with 'role' and 'content'"
        if not isinstance(message.get("role"), str):
            return f"message {i} has no 'role' string"
        if not isinstance(message.get("content"), (str, list)):
            return f"message {i} has no 'content' (a string, or a list of content parts)"
    return None


def _prompt_of(row: dict[str, Any]) -> tuple[str, Any, str | None]:
    """(column, prompt, problem): the row's prompt taken from `prompt` or `messages`."""
    if row.get("prompt") is not None:  # a null prompt (a Parquet column other rows fill) means "use messages"
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return "prompt", prompt, None if prompt else "is an empty string"
        return "prompt", prompt, _conversation_problem(prompt)
    if row.get("messages") is not None:
        messages = row["messages"]
        problem = _conversation_problem(messages)
        if problem is None and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
            problem = None if messages else "has only an assistant message; a prompt needs a user turn"
        return "messages", messages, problem
    return "prompt", None, "is missing or null (a row needs a 'prompt' or a 'messages' column)"


def _numbered_rows(path: str | os.PathLike, problems: list[tuple[str, str]]) -> list[tuple[int, dict[str, Any]]]:
    """(row number in the file, row) of every object row (the first N of them for `FILE#N`); other rows
    become problems."""
    file, first = dataset_file(path)
    try:
        found = file.is_file()
    except OSError as exc:  # a name the file system refuses (too long): the key's problem, as validate says
        raise ConfigError(f"dataset '{path}' cannot be read: {exc.strerror or exc}; give a readable file",
                          [("dataset", f"'{path}': {exc.strerror or exc}")]) from None
    if not found:
        raise ConfigError(
            f"dataset '{path}' is not a file; rlcore reads local {', '.join(FORMATS)} files",
            [("dataset", f"'{path}' does not exist")],
        )
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        raw = _read_jsonl(file, problems)
    elif suffix == ".json":
        raw = _read_json(file)
    elif suffix == ".parquet":
        raw = _read_parquet(file)
    else:
        raise ConfigError(f"dataset '{path}' has suffix '{suffix}'; rlcore reads {', '.join(FORMATS)}")
    rows = []
    for number, row in raw[:first]:
        if isinstance(row, dict):
            rows.append((number, row))
        else:
            problems.append((f"row {number}", f"is a {type(row).__name__}, not an object with named columns"))
    return rows


def load_rows(path: str | os.PathLike | list[str]) -> list[dict[str, Any]]:
    """The rows of a local `.jsonl`, `.json` or `.parquet` file, as objects; anything else is an error. A list of
    files is their rows one file after another (ms-swift's `dataset: [a#N, b#M]`)."""
    if isinstance(path, list):
        return [row for one in path for row in load_rows(one)]
    problems: list[tuple[str, str]] = []
    rows = [row for _, row in _numbered_rows(path, problems)]
    _raise(path, problems)
    if not rows:
        raise ConfigError(f"dataset '{path}' has no rows")
    return rows


_ROW = re.compile(r"^row (?P<number>[0-9]+)(?P<rest>.*)$")
FIRST_ROWS_SHOWN = 5


def summarised(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Row problems with one message (and column) as one problem naming the first rows and the count:
    `("rows 1, 2, 3, 4, 5, ... (5000 in all), column 'text'", message)`; others as they are, in order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for where, what in problems:
        match = _ROW.match(where)
        rest, number = (match["rest"], match["number"]) if match else (where, None)
        groups.setdefault((rest if match else where, what), []).append(number)
    out = []
    for (rest, what), numbers in groups.items():
        if numbers == [None] * len(numbers):
            out.extend([(rest, what)] * len(numbers))
        elif len(numbers) == 1:
            out.append((f"row {numbers[0]}{rest}", what))
        else:
            more = f", ... ({len(numbers)} in all)" if len(numbers) > FIRST_ROWS_SHOWN else ""
            out.append((f"rows {', '.join(numbers[:FIRST_ROWS_SHOWN])}{more}{rest}", what))
    return out


def dataset_error(path: Any, problems: list[tuple[str, str]]) -> ConfigError:
    """One `ConfigError` for a file's problems, repeated row problems summarised (`summarised`)."""
    problems = summarised(problems)
    shown = "; ".join(f"{where} {what}" for where, what in problems[:MAX_REPORTED])
    more = f" (and {len(problems) - MAX_REPORTED} more)" if len(problems) > MAX_REPORTED else ""
    return ConfigError(f"dataset '{path}': {shown}{more}", [(f"{path}: {where}", what) for where, what in problems])


def _raise(path: Any, problems: list[tuple[str, str]]) -> None:
    if problems:
        raise dataset_error(path, problems)


def _prompts(numbered: list[tuple[int, dict[str, Any]]], problems: list[tuple[str, str]]) -> list[dict[str, Any]]:
    out = []
    for number, row in numbered:
        column, prompt, problem = _prompt_of(row)
        if problem:
            problems.append((f"row {number}, column '{column}'", problem))
        else:
            out.append({**row, "prompt": prompt})
    return out


def prompt_view(rows: list[dict[str, Any]], path: Any = "dataset") -> list[dict[str, Any]]:
    """Each row with its `prompt` (from `prompt` or `messages`, see the module docstring)."""
    problems: list[tuple[str, str]] = []
    out = _prompts(list(enumerate(rows, start=1)), problems)
    _raise(path, problems)
    return out


def conversation_view(rows: list[dict[str, Any]], path: Any = "dataset") -> list[dict[str, Any]]:
    """Each row with its whole conversation in `messages`, ending in an assistant turn: a `messages`
    column as it is, or a `prompt` (text or messages) followed by its `completion` (text or messages)."""
    out, problems = [], []
    for number, row in enumerate(rows, start=1):
        if row.get("messages") is not None:
            column, messages = "messages", row["messages"]
            problem = _conversation_problem(messages)
        elif row.get("prompt") is not None and row.get("completion") is not None:
            column = "prompt/completion"
            prompt, completion = row["prompt"], row["completion"]
            messages = (prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]) + (
                completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            )
            problem = _conversation_problem(messages)
        else:
            hint = "; plain text trains with --plugin pt" if isinstance(row.get("text"), str) else ""
            problems.append((f"row {number}", f"has neither a 'messages' column nor 'prompt' and 'completion' "
                             f"columns{hint}"))
            continue
        if problem is None and messages[-1]["role"] != "assistant":
            problem = f"ends with a '{messages[-1]['role']}' message; a training conversation ends with the assistant's"
        if problem:
            problems.append((f"row {number}, column '{column}'", problem))
            continue
        out.append({**row, "messages": messages})
    _raise(path, problems)
    return out


def load_prompts(path: str | os.PathLike | list[str]) -> list[dict[str, Any]]:
    """The rows of a local `.jsonl`, `.json` or `.parquet` file (or of a list of them, one after another), each
    with a `prompt` and its other columns; every problem of a file is reported at once, by the row's number in it."""
    if isinstance(path, list):
        return [row for one in path for row in load_prompts(one)]
    problems: list[tuple[str, str]] = []
    rows = _prompts(_numbered_rows(path, problems), problems)
    _raise(path, problems)
    if not rows:
        raise ConfigError(f"dataset '{path}' has no rows")
    return rows


def has_conversations(path: str | os.PathLike | list[str] | None) -> bool:
    """Whether a row of the dataset(s) has a conversation for its prompt (a list of messages in `prompt`, or a
    `messages` column), which only a chat template turns into tokens; False where the files cannot be read (the
    data checks say why)."""
    try:
        rows = load_rows(path) if path else []
    except RlcoreError:
        return False
    return any(isinstance(row.get("prompt"), list) or (row.get("prompt") is None and row.get("messages") is not None)
               for row in rows)


class PromptEncoder:
    """A model's tokenizer for prompts: a conversation goes through the chat template (with the
    generation prompt and `template_kwargs`, e.g. enable_thinking), plain text too when `use_chat_template` and the
    tokenizer has one. A prompt longer than `max_prompt_length` keeps its last tokens (`truncation` left), its
    first (right), or its row is dropped (delete: `keep`). `stop_ids` are the tokens that end a completion."""

    def __init__(
        self, model_path: str, use_chat_template: bool = True, max_prompt_length: int | None = None,
        system: str | None = None, truncation: str = "left", template_kwargs: dict[str, Any] | None = None,
    ):
        try:
            self.tokenizer = _tokenizer(model_path)
        except (OSError, ValueError) as exc:  # transformers chains several tracebacks: one line says it
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"model '{model_path}' cannot be loaded: no tokenizer there ({reason[:300]}). Give a model "
                f"directory or the id of a model in the local Hugging Face cache",
                [("model", f"'{model_path}' has no loadable tokenizer ({reason[:200]})")],
            ) from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model_path = model_path
        self.use_chat_template, self.max_prompt_length, self.system = use_chat_template, max_prompt_length, system
        self.truncation, self.template_kwargs = truncation, dict(template_kwargs or {})
        _check_chat_template(self.tokenizer, model_path)
        ids = (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        self.stop_ids = sorted({i for i in ids if i is not None})

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def encode(self, prompt: Any, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's ids; `system`, when set, opens a prompt that has no system message of its own; `tools`
        (JSON schemas) go to the chat template."""
        tok = self.tokenizer
        if self.system is not None and (isinstance(prompt, list) or (self.use_chat_template and tok.chat_template)):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if not any(m.get("role") == "system" for m in messages):
                prompt = [{"role": "system", "content": self.system}, *messages]
        elif self.system is not None:
            prompt = f"{self.system}\n\n{prompt}"
        template = {**self.template_kwargs, **({"tools": tools} if tools else {})}
        if isinstance(prompt, list) or (self.use_chat_template and tok.chat_template):
            from jinja2 import TemplateError

            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            try:
                ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template)
            except TemplateError as exc:  # the template's own raise_exception("..."), or a render error
                raise RlcoreError(f"model '{self.model_path}': its chat template refused a prompt: {exc}; fix the "
                                  "prompt (its roles, their order) or the template (chat_template.jinja or "
                                  "tokenizer_config.json's chat_template)") from None
        else:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        if not self.max_prompt_length or self.truncation == "delete":  # delete: `keep` dropped the long rows
            return ids
        return ids[: self.max_prompt_length] if self.truncation == "right" else ids[-self.max_prompt_length :]

    @classmethod
    def of(cls, model_path: str, config: Any) -> PromptEncoder:
        """The encoder a config's prompt keys (`rlcore.sections.PromptKeys`) describe."""
        return cls(model_path, config.use_chat_template, config.max_prompt_length, config.system,
                   config.truncation_strategy, config.chat_template_kwargs)

    def keep(self, rows: list[dict[str, Any]], column: str = "prompt") -> list[dict[str, Any]]:
        """`rows` without those whose prompt is longer than max_prompt_length, under truncation delete (ms-swift's);
        the others cut their prompts in `encode`. How many were dropped is said once."""
        if self.truncation != "delete" or not self.max_prompt_length:
            return rows
        kept = [row for row in rows if len(self.encode(row[column])) <= self.max_prompt_length]
        if not kept:
            raise ConfigError(f"every prompt of the dataset is longer than max_prompt_length ({self.max_prompt_length} "
                              "tokens), and truncation_strategy delete drops such rows; raise max_prompt_length, or "
                              "use truncation_strategy left or right", [("truncation_strategy", "drops every row")])
        if len(kept) < len(rows):
            logger.info("truncation_strategy delete: %d of %d rows have a prompt longer than max_prompt_length (%d "
                        "tokens) and are left out", len(rows) - len(kept), len(rows), self.max_prompt_length)
        return kept


class PromptSampler:
    """Batches of rows, epoch after epoch, reshuffled each epoch; deterministic for a seed, resumable exactly.

    Batches run across epoch ends (a batch may end one epoch and start the next), so every batch is full
    even when `batch_size` does not divide the dataset. The position is (epoch, index into that epoch's order).
    """

    def __init__(self, rows: list[dict[str, Any]], batch_size: int, seed: int = 0):
        if not rows:
            raise ConfigError("PromptSampler needs at least one row")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"rlcore-data:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[dict[str, Any]]:
        """The next `batch_size` rows (copies: callers may add columns)."""
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            batch.append(dict(self.rows[self._order[self.index]]))
            self.index += 1
        return batch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is: what a checkpoint saves."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly where `state_dict()` was taken; refuse a different dataset size or seed."""
        if state.get("num_rows") != len(self.rows) or state.get("seed") != self.seed:
            raise ConfigError(
                f"the checkpoint's data position was taken with {state.get('num_rows')} rows and seed "
                f"{state.get('seed')}; this run has {len(self.rows)} rows and seed {self.seed}. Resume with the "
                "same dataset and seed, or start a new run"
            )
        if not 0 <= state["index"] <= len(self.rows) or state["epoch"] < 0:
            raise ConfigError(f"the checkpoint's data position {state} is out of range for {len(self.rows)} rows")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)


def _check_chat_template(tokenizer: Any, model_path: str) -> None:
    """A tokenizer's chat template (or each of its named ones) compiles as Jinja, as transformers compiles it; else
    one line naming the model, the line and the fix (what `apply_chat_template` raised was a 49-line traceback)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    templates = tokenizer.chat_template
    named = templates.items() if isinstance(templates, dict) else [("", templates)] if templates else []
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    for name, text in named:
        try:
            environment.parse(text)
        except TemplateSyntaxError as exc:
            which = f"chat template '{name}'" if name else "chat template"
            problem = (f"its {which} is not valid Jinja: line {exc.lineno}: {exc.message}; fix chat_template.jinja "
                       "(or tokenizer_config.json's chat_template) there, or give another model")
            raise ConfigError(f"model '{model_path}': {problem}", [("model", problem)]) from None


def _tokenizer(model_path: str) -> Any:
    """The tokenizer of a model directory, or of a hub id: from the Hub as transformers loads it when the Hub
    answers; else (HF_HUB_OFFLINE, or no connection) from the local cache alone, or at once a ConfigError
    naming the fix, instead of after the hub client's retries (and before transformers is imported)."""
    if os.path.exists(os.path.expanduser(model_path)) or not _is_repo_id(model_path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    problem = model_problem(model_path)
    if problem is not None:
        raise ConfigError(f"model {problem}", [("model", problem)])
    from transformers import AutoTokenizer

    unreachable = _hub_unreachable(model_path)
    if unreachable is None:
        return AutoTokenizer.from_pretrained(model_path)
    try:
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError):
        fix = (f"download it where there is a network (`hf download {model_path}`) into this machine's Hugging Face "
               f"cache, or give a local model directory")
        if "HF_HUB_OFFLINE" not in unreachable:
            fix += "; with HF_HUB_OFFLINE=1 only the cache is asked"
        why = f"'{model_path}' is neither a local directory nor in the local Hugging Face cache, and {unreachable}"
        raise ConfigError(f"model {why}: {fix}", [("model", f"{why}: {fix}")]) from None


def model_problem(model: str) -> str | None:
    """Why `model` cannot be loaded here, found without loading it, or None: not a local directory and not in
    the Hugging Face cache, while the Hub cannot be reached (said at once, not after the hub client's retries)."""
    if os.path.exists(os.path.expanduser(model)):
        return None
    if not _is_repo_id(model):
        return f"'{model}' is neither a local directory nor a Hugging Face hub id; give a model directory"
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return None
    unreachable = _hub_unreachable(model)
    if unreachable is None:
        return None
    fix = (f"download it where there is a network (`hf download {model}`) into this machine's Hugging Face cache, "
           "or give a local model directory")
    return f"'{model}' is neither a local directory nor in the local Hugging Face cache, and {unreachable}: {fix}"


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _hub_unreachable(model_id: str, repo_type: str = "model") -> str | None:
    """Why the Hub cannot be asked for `model_id` (a model, or a dataset with `repo_type`) now (HF_HUB_OFFLINE is
    set, or one request does not connect: this machine is offline), or None when it answers (also with an error of
    its own, which loading then reports). Asked once per process: every check after the first reads the answer."""
    from huggingface_hub import constants, repo_info
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        repo_info(model_id, repo_type=repo_type, timeout=10)
    except HfHubHTTPError:  # the Hub answered (no such model, gated)
        return None
    except Exception as exc:  # no connection: no DNS, refused, timed out, a proxy that fails
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return f"this machine is offline: the Hub ({constants.ENDPOINT}) cannot be reached ({reason})"
    return None


SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")


def split_files(name: str, config: str | None = None, split: str = "train") -> list[str]:
    """The data files of split `split` (of configuration `config`) of the dataset `name`, as TRL's `dataset_name`,
    `dataset_config` and `dataset_train_split` pick them: a file (its one split, train); a folder laid out as the
    Hub's datasets are (`train.jsonl`, `data/train-00000-of-00001.parquet`, `CONFIG/train-*.parquet`; files named
    for no split are all train); or a Hub dataset's id, read from the local Hugging Face cache, or downloaded where
    the Hub answers. A ConfigError says in one line why there are none."""
    file, _ = dataset_file(name)
    if file.is_file():
        if config:
            _refuse("dataset_config", f"'{config}' names a configuration of a Hub dataset, but '{name}' is one file; "
                    "drop dataset_config")
        if split != "train":
            _refuse("dataset_train_split", f"'{split}': the file '{name}' has one split, train; give the split's "
                    "file as dataset_name, or a folder with a file per split")
        return [str(name)]
    folder = Path(os.path.expanduser(name))
    if not folder.is_dir():
        folder = _hub_dataset(name)
    if config:
        if not (folder / config).is_dir():
            found = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
            _refuse("dataset_config", f"'{config}': '{name}' has no folder '{config}' (configurations there: "
                    f"{', '.join(found) or 'none'})")
        folder = folder / config
    data = sorted(p for p in folder.rglob("*") if p.suffix.lower() in FORMATS and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    chosen = [p for p in data if _split_of(p.relative_to(folder)) == split]
    if not chosen and split == "train":
        chosen = [p for p in data if _split_of(p.relative_to(folder)) is None]
    depth = min((len(p.relative_to(folder).parts) for p in chosen), default=0)
    chosen = [p for p in chosen if len(p.relative_to(folder).parts) == depth]  # a configuration's folder is deeper
    tops = sorted({p.relative_to(folder).parts[0] for p in chosen if depth > 1} - {"data", split})
    if len(tops) > 1:
        _refuse("dataset_config", f"is not given, but '{name}' has several configurations ({', '.join(tops)}); set "
                "it to one of them")
    if not chosen:
        shown = ", ".join(str(p.relative_to(folder)) for p in data[:5]) or f"no {', '.join(FORMATS)} file"
        _refuse("dataset_train_split", f"'{split}': '{name}' has no file of that split (a file or folder named "
                f"{split}, or {split}-*.parquet; found: {shown}); set it to one of the dataset's splits")
    return [str(p) for p in chosen]


def _refuse(key: str, message: str) -> NoReturn:
    raise ConfigError(f"{key}: {message}", [(key, message)])


def _split_of(relative: Path) -> str | None:
    """The split a data file's path names (`train.jsonl`, `data/test-00000.parquet`, `train/0.jsonl`), or None."""
    names = [*relative.parts[:-1], relative.name.split(".")[0]]
    for part in reversed(names):
        for word in re.split(r"[-_]", part):
            if word in SPLIT_NAMES:
                return word
    return None


def _hub_dataset(name: str) -> Path:
    """The folder of the Hub dataset `name`: its snapshot in the local Hugging Face cache, else downloaded (its
    data files only) where the Hub answers; else a ConfigError naming the fix."""
    if not _is_repo_id(name):
        _refuse("dataset_name", f"'{name}' is neither a local file or folder nor a Hub dataset's id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except Exception:  # not in the cache: ask the Hub, where it answers
        pass
    unreachable = _hub_unreachable(name, repo_type="dataset")
    if unreachable is not None:
        _refuse("dataset_name", f"'{name}' is neither a local file or folder nor in the local Hugging Face cache, and "
                f"{unreachable}: download it where there is a network (`hf download {name} --repo-type dataset`), or "
                "give a local file")
    patterns = [f"*{suffix}" for suffix in FORMATS]
    try:
        return Path(snapshot_download(name, repo_type="dataset", allow_patterns=patterns))
    except Exception as exc:  # no such dataset, gated, or the download failed
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        _refuse("dataset_name", f"'{name}' cannot be downloaded from the Hub: {reason}")


__all__ = [
    "FORMATS", "PromptEncoder", "PromptSampler", "completion_text", "conversation_view", "dataset_error", "dataset_file",
    "has_conversations", "load_prompts", "load_rows", "model_problem", "prompt_view", "split_files",
]
