"""Environments: what answers a model's turn in a multi-turn rollout (a tool, a game, a hint).

An `Environment` is one episode's state. `reset(row)` starts it from a dataset row; `step(turn)` takes the
model's turn (its text, token ids and parsed tool calls) and returns a `Step`: the next messages (tool results,
an observation, a hint), a continuation of the model's own message (ms-swift's math tip), "done", and optionally
a reward part. Environments are registered by name with the `rlcore_environments` hook
(`EnvironmentSpec(name, factory)`), or named as `module:Class` / `file.py:Class`. Three spellings map onto one:
ms-swift's `multi_turn_scheduler`, TRL's `tools` (`ToolEnvironment`) and TRL's `environment_factory`
(`FactoryEnvironment`: a class with `reset()` whose documented public methods are the tools).

Tool calls are parsed from the model's text in the Qwen/Hermes format (`<tool_call>{"name": ..., "arguments":
...}</tool_call>`); a malformed call becomes an error message to the model, never an exception.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]

    def message(self) -> dict[str, Any]:
        """The call as a chat template's `tool_calls` entry."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Turn:
    """The model's turn: its text (special tokens dropped), token ids, the calls parsed from the text and the
    calls that did not parse (one error line each), its 1-based index, and the row the episode started from."""

    text: str
    token_ids: list[int]
    tool_calls: list[ToolCall]
    tool_errors: list[str]
    index: int
    row: dict[str, Any]
    finish_reason: str = "stop"


@dataclass
class Step:
    """An environment's answer to a turn.

    - `messages`: chat messages that follow the model's (role `tool`, `user`, ...); their tokens are the next
      turn's prompt and are masked out of the loss;
    - `continuation`: text appended to the model's own message instead (masked too), the model going on in the
      same message (ms-swift's MathTipsScheduler); `keep_text`, a prefix of the message's text, first cuts the
      turn's tokens to the fewest that cover it;
    - `done`: the episode ends (also when neither messages nor a continuation are given);
    - `reward`: a reward part, summed over the episode into the `environment` reward;
    - `tool_calls` / `tool_errors`: what the turn's calls came to, for the metrics.
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    continuation: str | None = None
    keep_text: str | None = None
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0


class Environment:
    """One episode's environment. Subclass it (or write any class with `reset` and `step`) and register it:

    .. code-block:: python

        class Guess(Environment):
            def reset(self, row): self.target = row["target"]
            def step(self, turn):
                if self.target in turn.text: return Step(done=True, reward=1.0)
                return Step(messages=[{"role": "user", "content": "Wrong, try again."}])
    """

    tools: list[Callable[..., Any]] = []

    def reset(self, row: dict[str, Any]) -> str | list[dict[str, Any]] | None:
        """Start an episode from a dataset row; a string is appended to the prompt's last message, a list of
        messages to the prompt."""
        return None

    def step(self, turn: Turn) -> Step:
        """Answer the model's turn."""
        return Step(done=True)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools as chat-template JSON schemas (transformers' `get_json_schema`); None without tools."""
        return [tool_schema(fn) for fn in self.tools] or None

    def close(self) -> None:
        """Release what the episode holds; called once it ends."""


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The `<tool_call>` blocks of `text` (Qwen/Hermes format) as calls, and one error line per block that is not
    a JSON object with a string `name` and object `arguments`."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for block in TOOL_CALL.findall(text):
        try:
            data = json.loads(block.strip())
        except json.JSONDecodeError as exc:
            errors.append(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}): {block.strip()[:200]}")
            continue
        arguments = data.get("arguments", {}) if isinstance(data, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(arguments, dict):
            errors.append('a tool call must be {"name": "<tool>", "arguments": {...}}; got ' + block.strip()[:200])
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls, errors


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """`fn`'s chat-template schema from its signature and docstring (transformers' `get_json_schema`, as TRL);
    a function it cannot describe is a ConfigError naming it."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(f"tool '{name}' cannot be described to the model: {exc}. Give it type hints and a "
                          "Google-style docstring with an Args: section (transformers' get_json_schema)") from None


def call_tools(turn: Turn, tools: dict[str, Callable[..., Any]]) -> Step:
    """Run the turn's tool calls; each result (or error) becomes a `tool` message. A turn without calls, and
    without malformed ones, ends the episode (the model answered)."""
    messages: list[dict[str, Any]] = []
    errors = len(turn.tool_errors)
    for error in turn.tool_errors:
        messages.append({"role": "tool", "name": "error", "content": json.dumps({"error": error})})
    for call in turn.tool_calls:
        fn = tools.get(call.name)
        if fn is None:
            errors += 1
            result: Any = {"error": f"unknown tool '{call.name}'; known: {', '.join(sorted(tools)) or '(none)'}"}
        else:
            try:
                result = fn(**call.arguments)
            except Exception as exc:  # the model's call was wrong; it reads why
                errors += 1
                result = {"error": f"{type(exc).__name__}: {exc}"}
        content = result if isinstance(result, str) else json.dumps(result, default=str)
        messages.append({"role": "tool", "name": call.name, "content": content})
    return Step(messages=messages, done=not messages, tool_calls=len(turn.tool_calls) + len(turn.tool_errors),
                tool_errors=errors)


class ToolEnvironment(Environment):
    """TRL's `tools=[...]`: plain functions the model calls; their results are the next messages."""

    def __init__(self, tools: list[Callable[..., Any]] | list[str] = ()):
        self.tools = [import_object(t, "tool") if isinstance(t, str) else t for t in tools]
        names = [fn.__name__ for fn in self.tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"tools: two tools share a name ({', '.join(names)}); give each function its own")
        self._by_name = dict(zip(names, self.tools))

    def step(self, turn: Turn) -> Step:
        return call_tools(turn, self._by_name)


class FactoryEnvironment(Environment):
    """TRL's `environment_factory`: a fresh instance of `cls` per episode; `reset(**row)` starts it (a string it
    returns is appended to the prompt), its public documented methods are the tools, and a `get_reward()` method,
    where it has one, gives the episode's reward when it ends."""

    def __init__(self, cls: type | str, tools: list[Callable[..., Any]] | list[str] = ()):
        factory = import_object(cls, "environment_factory") if isinstance(cls, str) else cls
        self.instance = factory()
        if not callable(getattr(self.instance, "reset", None)):
            raise ConfigError(f"environment_factory: {getattr(factory, '__name__', factory)!r} has no reset() method; "
                              "an environment starts each episode with reset()")
        methods = [getattr(self.instance, name) for name, _ in inspect.getmembers(type(self.instance), inspect.isfunction)
                   if not name.startswith("_") and name not in ("reset", "get_reward")]
        self._own = ToolEnvironment(list(tools) + methods)
        self.tools = self._own.tools

    def reset(self, row: dict[str, Any]) -> str | None:
        accepted = inspect.signature(self.instance.reset).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        result = self.instance.reset(**{k: v for k, v in row.items() if takes_any or k in accepted})
        return result if isinstance(result, str) else None

    def step(self, turn: Turn) -> Step:
        step = self._own.step(turn)
        if step.done and callable(getattr(self.instance, "get_reward", None)):
            step.reward = float(self.instance.get_reward())
        return step


def import_object(spec: str, key: str) -> Any:
    """`module:name` or `file.py:name`, imported; a ConfigError naming `key` otherwise."""
    from .rewards import _import_object

    try:
        return _import_object(spec)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("reward function", key, 1)) from None


__all__ = [
    "Environment", "FactoryEnvironment", "Step", "ToolCall", "ToolEnvironment", "Turn", "call_tools", "import_object",
    "parse_tool_calls", "tool_schema",
]
