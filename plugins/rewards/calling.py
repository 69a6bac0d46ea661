"""Finding a reward function by name or `module:function`, and calling it safely.

A reward function that raises must not end a long run by default: its rewards for that call become None
(left out of the advantages) and the error is counted and logged once per function. `strict=True` (the
config's `strict_rewards`) makes it fatal. A `ConfigError` (e.g. a missing dataset column) is always fatal:
it would fail on every call.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore import ConfigError, RlcoreError
from rlcore.errors import did_you_mean

if TYPE_CHECKING:
    from rlcore import Plugins

logger = logging.getLogger("rlcore.rewards")
_logged: set[str] = set()

RewardFn = Callable[..., list[float | None]]


def _import_object(spec: str) -> Any:
    """`package.module:function` or `path/to/file.py:function`."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward function '{spec}' must be a registered name or 'module:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"reward function '{spec}': file '{module_name}' does not exist")
            unique = f"rlcore_user_reward_{path.stem}"
            loader = importlib.util.spec_from_file_location(unique, path.resolve())
            module = importlib.util.module_from_spec(loader)
            sys.modules[unique] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"reward function '{spec}': module '{module_name}' cannot be imported: {exc!r}") from exc
    if not hasattr(module, attr):
        raise ConfigError(f"reward function '{spec}': module '{module_name}' has no attribute '{attr}'")
    return getattr(module, attr)


def _with_options(name: str, fn: Any, options: dict[str, Any]) -> Any:
    """A registered parameterised reward (a dataclass) rebuilt with `options` over its defaults."""
    if not dataclasses.is_dataclass(fn) or isinstance(fn, type):
        raise ConfigError(f"reward '{name}' takes no options; remove reward_kwargs.{name}",
                          [(f"reward_kwargs.{name}", "this reward takes no options")])
    known = [f.name for f in dataclasses.fields(fn)]
    unknown = [k for k in options if k not in known]
    if unknown:
        problems = [(f"reward_kwargs.{name}.{k}", f"unknown option; known: {', '.join(known)}.{did_you_mean(k, known)}")
                    for k in unknown]
        raise ConfigError("; ".join(f"{key}: {msg}" for key, msg in problems), problems)
    return dataclasses.replace(fn, **options)


def resolve_reward(name_or_path: str, plugins: Plugins, options: dict[str, Any] | None = None) -> RewardFn:
    """The reward function `name_or_path` names: a registered reward, or `module:function` imported.

    `options` (the config's `reward_kwargs[name]`) override a registered reward's defaults; for a
    `module:function`, the object is a factory (like TRL's `get_soft_overlong_punishment`) called with them.
    """
    if ":" not in name_or_path:
        spec = plugins.rewards.get(name_or_path)  # NotRegistered lists the known names
        return _with_options(name_or_path, spec.fn, options) if options else spec.fn
    obj = _import_object(name_or_path)
    if options:
        try:
            obj = obj(**options)
        except Exception as exc:
            raise ConfigError(f"reward function factory '{name_or_path}' failed with options {options}: {exc!r}") from exc
    if not callable(obj):
        raise ConfigError(f"reward function '{name_or_path}' is a {type(obj).__name__}, not a function")
    return obj


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "item"):  # a numpy or torch scalar
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"a reward must be a number or None; got {type(value).__name__} {value!r}")
    value = float(value)
    return None if math.isnan(value) else value


def call_reward(
    fn: RewardFn,
    name: str,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]] | None,
    columns: dict[str, list[Any]],
    strict: bool = False,
) -> tuple[list[float | None], int]:
    """Call `fn` as TRL does (all keywords, dataset columns as lists); return (rewards, number of errors).

    A raise, a result of the wrong length or a non-number is an error naming `name`: fatal when `strict`,
    otherwise every reward of this call is None and the error counts 1.
    """
    n = len(completions)
    try:
        result = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        if result is None or len(result) != n:
            got = "None" if result is None else f"{len(result)} rewards"
            raise RlcoreError(f"returned {got} for {n} completions; return one reward (or None) per completion")
        return [_as_reward(v) for v in result], 0
    except ConfigError:
        raise
    except Exception as exc:
        detail = str(exc) if isinstance(exc, RlcoreError) else repr(exc)
        message = f"reward function '{name}' failed: {detail}"
        if strict:
            raise RlcoreError(message + " (strict_rewards is set)") from exc
        if name not in _logged:
            _logged.add(name)
            logger.warning("%s; its rewards for this batch are None (left out of the advantages). Further "
                           "errors of '%s' are counted, not logged; strict_rewards=true makes them fatal.", message, name)
        return [None] * n, 1
