"""rlcore's optional parts (the extras of `pip install 'rlcore[EXTRA]'`) and the modules each brings, so that
a run missing one stops before anything starts with one line naming the install, and `rlcore plugins` marks
the built-in plugins whose libraries are not importable.

Whether a module is there is asked of the import system (`importlib.util.find_spec`), without importing it:
TRL, Ray or megatron-core take seconds to import and the run imports them where it needs them.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from pydantic import BaseModel

from .errors import ConfigError, did_you_mean

# extra -> the modules it installs that rlcore imports (the first one missing is named)
EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("torch", "transformers"),
    "sft": ("trl", "datasets"),
    "ray": ("ray",),
    "megatron": ("megatron.core",),
    "vllm": ("vllm",),
}
# built-in plugin -> the extra what it registers needs (its algorithms, or its engines)
PLUGIN_EXTRAS: dict[str, str] = {"hf": "hf", "sft": "sft", "megatron": "megatron", "vllm": "vllm"}


class MissingExtra(ConfigError):
    """A part of rlcore a run asks for is not installed; the message names the `pip install`."""


def missing(extra: str) -> str | None:
    """The first module of `extra` that cannot be imported here, or None when all can."""
    for module in EXTRAS[extra]:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):  # a parent package missing (megatron for megatron.core)
            return module
    return None


def require(extra: str, what: str, key: str = "(environment)") -> None:
    """Raise `MissingExtra` when `extra` is not installed: "`what` needs ...: pip install 'rlcore[extra]'"."""
    module = missing(extra)
    if module is not None:
        fix = f"pip install 'rlcore[{extra}]'"
        raise MissingExtra(f"{what} needs the '{extra}' extra ({module} is not installed): {fix}",
                           [(key, f"needs {module}: {fix}")])


def plugin_needs(plugin: str) -> str | None:
    """What `rlcore plugins` says of a built-in plugin whose extra is missing, else None."""
    extra = PLUGIN_EXTRAS.get(plugin)
    module = missing(extra) if extra else None
    return f"{module} is not importable: pip install 'rlcore[{extra}]'" if module else None


def check_run(plugins: Any, algorithm: str, config: BaseModel, use_ray: bool = False, engines: bool = True) -> None:
    """Every extra a run of `algorithm` with `config` needs is installed: the algorithm's plugin's, each role's
    engine's (`train.engine=megatron`; `engines=False` for `config validate`, which may check a GPU cluster's
    config where vLLM is not installed), and Ray's with --use-ray; else one `MissingExtra`, before anything
    starts."""
    extra = PLUGIN_EXTRAS.get(plugins.algorithms.owner(algorithm))
    if extra:
        require(extra, f"--plugin {algorithm}")
    for path, engine in _engines(config) if engines else ():
        owners = {plugins.engines.owner(key) for key in plugins.engines.names() if key.endswith(f"/{engine}")}
        for owner in sorted(owners):
            if PLUGIN_EXTRAS.get(owner):
                require(PLUGIN_EXTRAS[owner], f"{path}={engine}", path)
    if use_ray:
        require("ray", "--use-ray")


def engine_name_problems(config: BaseModel, plugins: Any, roles: Any) -> list[tuple[str, str]]:
    """(key, message) for each section of a role in `roles` that builds registered engines (a `RoleConfig` with
    `engine_kinds`) and names an `engine` no plugin registers for those kinds. A section without kinds is the
    algorithm's own business (its setups may give engine factories of their own)."""
    problems = []
    for path, section in _sections(config):
        kinds = getattr(section, "engine_kinds", ())
        if not kinds or path.split(".")[0] not in roles:
            continue
        known = sorted({spec.name for spec in plugins.engines if spec.kind in kinds})
        if known and section.engine not in known:
            problems.append((f"{path}.engine", f"'{section.engine}' is not a registered {'/'.join(kinds)} engine; "
                             f"known: {', '.join(known)}{did_you_mean(section.engine, known)}"))
    return problems


def _sections(config: BaseModel, prefix: str = "") -> list[tuple[str, BaseModel]]:
    """(key path, section) of every role section of `config` that names an engine."""
    found = []
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            if isinstance(getattr(value, "engine", None), str):
                found.append((f"{prefix}{name}", value))
            found.extend(_sections(value, f"{prefix}{name}."))
    return found


def _engines(config: BaseModel) -> list[tuple[str, str]]:
    """(key path, engine name) of every role section of `config` that names an engine."""
    return [(f"{path}.engine", section.engine) for path, section in _sections(config)]
