"""Finding a reward function by name or `module:function`, and calling it safely: what every algorithm that
scores completions (GRPO, sampling, a plugin's) shares, whichever plugin registered the function.

A reward function that fails on some completions must not end a long run by default: when a call over the
batch fails, each completion is scored on its own, the ones that still fail get None (left out of the
advantages), and the failures are counted and logged once per function. `strict=True` (the config's
`strict_rewards`) makes any failure fatal. A function that fails on every completion of a call is broken, not
unlucky: that stops the run (`RewardFailed`) whatever `strict` says, as does a `ConfigError` (e.g. a missing
dataset column).

A reward function runs under a time limit (`timeout_s`, the config's `reward_timeout_s`) in a thread of its
own while the caller waits where signal handlers run: a call past its limit is a failure for each completion it
was scoring (the thread is left behind, a daemon), and a SIGINT/SIGTERM/SIGHUP during the call stops the run at
once. A reward that is not a finite number within +-REWARD_LIMIT is a failure, and so is a function that tries
to end the process (`sys.exit`): a reward function cannot end the run.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, RlcoreError, did_you_mean

if TYPE_CHECKING:
    from .manager import Plugins

logger = logging.getLogger("rlcore.rewards")
_logged: set[str] = set()

RewardFn = Callable[..., list[float | None]]
REWARD_LIMIT = 1e15  # beyond this a reward's square overflows the float32 the advantages are computed in
REWARD_TIMEOUT_S = 600.0  # the default limit of one call of a reward function
_POLL_S = 0.1


class RewardFailed(RlcoreError):
    """A reward function failed on every completion it was given, or on any one with `strict_rewards`."""


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


TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")


def _parameters(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return {}


def reward_options(fn: Any) -> list[str]:
    """The options `reward_kwargs` may give a reward: a dataclass reward's fields, or a function's keyword
    arguments (keyword-only or with a default) other than TRL's prompts, completions and completion_ids."""
    if dataclasses.is_dataclass(fn) and not isinstance(fn, type):
        return [f.name for f in dataclasses.fields(fn)]
    return [
        p.name for p in _parameters(fn).values()
        if p.name not in TRL_ARGUMENTS
        and (p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty))
    ]


@dataclasses.dataclass(frozen=True)
class RewardWithOptions:
    """A reward function called with its options from `reward_kwargs` (picklable when the function is).

    Unlike `functools.partial`, an option that is also a dataset column is an error, not silently overridden.
    """

    name: str
    fn: RewardFn
    options: dict[str, Any]

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                 **columns: Any) -> list[float | None]:
        clash = sorted(set(self.options) & set(columns))
        if clash:
            raise ConfigError(f"reward '{self.name}': option '{clash[0]}' (reward_kwargs.{self.name}.{clash[0]}) is "
                              "also a dataset column; rename the option or the column")
        return self.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **self.options)


def _with_options(name: str, fn: Any, options: dict[str, Any]) -> Any:
    """`fn` with `options` over its defaults, each checked against the options it takes."""
    known = reward_options(fn)
    if not known:
        raise ConfigError(
            f"reward '{name}' takes no options (a reward's options are its keyword arguments, or its fields for a "
            f"dataclass); remove reward_kwargs.{name}",
            [(f"reward_kwargs.{name}", "this reward takes no options")],
        )
    unknown = [k for k in options if k not in known]
    if unknown:
        problems = [(f"reward_kwargs.{name}.{k}",
                     f"reward '{name}' has no option '{k}'; it takes {', '.join(known)}.{did_you_mean(k, known)}")
                    for k in unknown]
        raise ConfigError("; ".join(f"{key}: {msg}" for key, msg in problems), problems)
    if dataclasses.is_dataclass(fn) and not isinstance(fn, type):
        return dataclasses.replace(fn, **options)
    return RewardWithOptions(name, fn, dict(options))


def resolve_reward(name_or_path: str, plugins: Plugins, options: dict[str, Any] | None = None) -> RewardFn:
    """The reward function `name_or_path` names: a registered reward, or `module:function` imported.

    `options` (the config's `reward_kwargs[name]`) are checked against the options the reward takes
    (`reward_options`) before the run starts, and override its defaults. A `module:function` without a
    `completions` argument is a factory (like TRL's `get_soft_overlong_punishment`), called with them.
    """
    if ":" not in name_or_path:
        spec = plugins.rewards.get(name_or_path)  # NotRegistered lists the known names
        return _with_options(name_or_path, spec.fn, options) if options else spec.fn
    obj = _import_object(name_or_path)
    if options and "completions" not in _parameters(obj):
        try:
            obj = obj(**options)
        except Exception as exc:
            raise ConfigError(f"reward function factory '{name_or_path}' failed with options {options}: {exc!r}") from exc
    elif options:
        obj = _with_options(name_or_path, obj, options)
    if not callable(obj):
        raise ConfigError(f"reward function '{name_or_path}' is a {type(obj).__name__}, not a function")
    return obj


def check_reward(name_or_path: str, plugins: Plugins, options: dict[str, Any] | None = None) -> None:
    """What `resolve_reward` would find wrong, found without running a user's code (`rlcore config validate`):
    a registered reward and its options; for `file.py:function` or `module:function`, that the source exists
    and defines the function at its top level (parsed, not imported: `run` imports it)."""
    if ":" not in name_or_path:
        resolve_reward(name_or_path, plugins, options)  # the plugin's own code, loaded with the plugins
        return
    module_name, _, attr = name_or_path.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward function '{name_or_path}' must be a registered name or 'module:function'")
    source = _source_of(name_or_path, module_name)
    if source is None:  # a compiled module: there is no source to read, only code to run
        return
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except SyntaxError as exc:
        raise ConfigError(f"reward function '{name_or_path}': {source} line {exc.lineno}: {exc.msg}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"reward function '{name_or_path}': {source} cannot be read: {exc}") from None
    defined = _top_level_names(tree)
    if attr not in defined:
        raise ConfigError(f"reward function '{name_or_path}': {source} defines no '{attr}' at its top level."
                          f"{did_you_mean(attr, defined)}")
    node = defined[attr]
    if options and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.args.kwarg:
        arguments = node.args
        given = [a.arg for a in arguments.args + arguments.posonlyargs]
        if "completions" in given:  # a reward, not a factory: its options are its keyword arguments
            known = [a.arg for a in arguments.kwonlyargs] + given[len(given) - len(arguments.defaults):]
            known = [k for k in known if k not in TRL_ARGUMENTS]
            unknown = [k for k in options if k not in known]
            if unknown:
                problems = [(f"reward_kwargs.{name_or_path}.{k}", f"reward '{name_or_path}' has no option '{k}'; it "
                             f"takes {', '.join(known) or 'none'}.{did_you_mean(k, known)}") for k in unknown]
                raise ConfigError("; ".join(f"{key}: {msg}" for key, msg in problems), problems)


def _source_of(spec: str, module_name: str) -> Path | None:
    """The source file of `module_name` (a path ending in .py, or a dotted module), found as the import
    system would find it, without importing it or its packages; None for a module without source."""
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise ConfigError(f"reward function '{spec}': file '{module_name}' does not exist")
        return path
    parts = module_name.split(".")
    found, search = None, None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        found = getattr(loaded, "__spec__", None) if loaded is not None else None
        if found is None:
            found = _find_spec(name, search)
        if found is None:
            raise ConfigError(f"reward function '{spec}': no module '{name}' is installed here; install it, or "
                              f"give 'path/to/file.py:function'")
        search = found.submodule_search_locations
        if search is None and i + 1 < len(parts):
            raise ConfigError(f"reward function '{spec}': '{name}' is a module, not a package holding '{module_name}'")
    origin = found.origin if found is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _find_spec(name: str, search: Any) -> Any:
    """The import system's spec of module `name` inside the package path `search` (None: sys.path), asked of
    its finders directly: `importlib.util.find_spec` would import (run) the parent packages."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        found = find(name, search) if find is not None else None
        if found is not None:
            return found
    return None


def _top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """What a module defines at its top level (functions, classes, assignments, imports), by name."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "item"):  # a numpy or torch scalar
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"a reward must be a number or None; got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or abs(value) > REWARD_LIMIT:
        raise ValueError(f"a reward must be a finite number within +-{REWARD_LIMIT:g}; got {value!r} (return None "
                         "for a completion the function cannot score)")
    return value


class RewardTimeout(RlcoreError):
    """A call of a reward function that did not return within its time limit."""


class RewardInterrupted(RlcoreError):
    """A signal to stop arrived while a reward function ran: the run stops at once."""


def _timed(fn: RewardFn, timeout_s: float | None, **kwargs: Any) -> Any:
    """`fn(**kwargs)` in a thread of its own, waited for at most `timeout_s` (None: no limit); raises
    RewardTimeout past it and RewardInterrupted as soon as the run is asked to stop. A BaseException the
    function raises (SystemExit, KeyboardInterrupt from its own code) comes back as a plain error."""
    import threading

    from . import watchdog

    result: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            result["value"] = fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = exc
        except BaseException as exc:  # noqa: BLE001 - sys.exit() in a reward function does not end the run
            result["error"] = RuntimeError(f"tried to end the process ({type(exc).__name__}"
                                           f"{'(' + repr(exc.args[0]) + ')' if exc.args else ''})")
        finally:
            done.set()

    started = time.monotonic()
    threading.Thread(target=run, daemon=True, name="rlcore-reward").start()
    while not done.wait(_POLL_S):
        if watchdog.stop_asked():
            raise RewardInterrupted("a signal to stop arrived while a reward function ran")
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise RewardTimeout(f"did not return within reward_timeout_s={timeout_s:g}s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


class _BadResult(RlcoreError):
    """The function returned something that is not one reward per completion."""


def _call(fn: RewardFn, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None,
          columns: dict[str, list[Any]], timeout_s: float | None = None) -> tuple[list[float | None], list[Exception]]:
    """The rewards of one call, and the failures among them (a non-number is None and a failure)."""
    n = len(completions)
    result = _timed(fn, timeout_s, prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    if result is None or len(result) != n:
        got = "None" if result is None else f"{len(result)} rewards"
        raise _BadResult(f"returned {got} for {n} completions; return one reward (or None) per completion")
    values: list[float | None] = []
    failures: list[Exception] = []
    for value in result:
        try:
            values.append(_as_reward(value))
        except (TypeError, ValueError) as exc:
            values.append(None)
            failures.append(exc)
    return values, failures


def _one_by_one(fn: RewardFn, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None,
                columns: dict[str, list[Any]], timeout_s: float | None) -> tuple[list[float | None], list[Exception]]:
    """Each completion scored by a call of its own, so that one bad completion costs only its reward."""
    values: list[float | None] = []
    failures: list[Exception] = []
    for i in range(len(completions)):
        try:
            (value,), failed = _call(
                fn, prompts[i : i + 1], completions[i : i + 1],
                None if completion_ids is None else completion_ids[i : i + 1],
                {k: v[i : i + 1] for k, v in columns.items()}, timeout_s,
            )
        except (ConfigError, RewardInterrupted):
            raise
        except Exception as exc:
            value, failed = None, [exc]
        values.append(value)
        failures += failed
    return values, failures


def _describe(exc: Exception) -> str:
    return str(exc) if isinstance(exc, RlcoreError) else repr(exc)


def call_reward(
    fn: RewardFn,
    name: str,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]] | None,
    columns: dict[str, list[Any]],
    strict: bool = False,
    timeout_s: float | None = REWARD_TIMEOUT_S,
) -> tuple[list[float | None], int]:
    """Call `fn` as TRL does (all keywords, dataset columns as lists); return (rewards, completions it failed on).

    A raise, a result of the wrong length, a non-number, a reward that is not finite (or beyond REWARD_LIMIT), a
    call past `timeout_s` and `sys.exit` are failures naming `name`. When the call over the batch raises, each
    completion is scored on its own and only those `fn` still fails on get None; a batch call past its time
    limit fails each of its completions (scoring them one by one could take as long again for each).
    Raises `RewardFailed` on any failure when `strict`, and on a failure for every completion regardless.
    """
    n = len(completions)
    first: Exception | None = None  # the batch call's error, named in messages
    try:
        values, failures = _call(fn, prompts, completions, completion_ids, columns, timeout_s)
    except (ConfigError, RewardInterrupted):
        raise
    except Exception as exc:
        first = exc
        if strict or n <= 1 or isinstance(exc, (_BadResult, RewardTimeout)):  # fatal anyway, nothing to isolate, or no reward to keep
            values, failures = [None] * n, [exc] * n
        else:
            values, failures = _one_by_one(fn, prompts, completions, completion_ids, columns, timeout_s)
    if not failures:
        return values, 0
    cause = first or failures[0]
    if strict:
        raise RewardFailed(f"reward function '{name}' failed: {_describe(cause)} (strict_rewards is set)") from cause
    if len(failures) == n:
        raise RewardFailed(
            f"reward function '{name}' failed on all {n} completions of this step: {_describe(cause)}; "
            "fix it, or remove it from reward_funcs"
        ) from cause
    if name not in _logged:
        _logged.add(name)
        logger.warning("reward function '%s' failed on %d of %d completions: %s; their rewards are None (left out "
                       "of the advantages). Further failures of '%s' are counted, not logged; strict_rewards=true "
                       "makes them fatal.", name, len(failures), n, _describe(cause), name)
    return values, len(failures)


__all__ = [
    "RewardFailed", "RewardFn", "RewardWithOptions", "call_reward", "check_reward", "reward_options", "resolve_reward",
]
