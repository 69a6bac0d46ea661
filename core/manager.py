"""Plugin loading: built-ins and third-party distributions alike come from one entry-point group.

`load_plugins()` registers every plugin of the `rlcore.plugins` entry-point group (minus those named
in RLCORE_DISABLE_PLUGINS), plus any module or `.py` file given as `extra`, and collects what their
registration hooks yield into registries. A plugin that fails to import is reported by name and
skipped, unless RLCORE_STRICT_PLUGINS=1 makes that fatal.

`plugins()` is the process's own set, loaded on first use, with which workers resolve engines,
dispatchers and collectors by name; a driver hands it over with `use_plugins`, and its worker processes
load the same module and file plugins through RLCORE_EXTRA_PLUGINS.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from . import hookspecs
from .errors import NotRegistered, PluginError, did_you_mean
from .registry import EngineRegistry, Registry

ENTRY_POINT_GROUP = "rlcore.plugins"

# registration hook -> (registry attribute, word used in messages)
REGISTRIES = {
    "rlcore_roles": ("roles", "role"),
    "rlcore_dispatchers": ("dispatchers", "dispatch"),
    "rlcore_collectors": ("collectors", "collect"),
    "rlcore_placements": ("placements", "placement"),
    "rlcore_algorithms": ("algorithms", "algorithm"),
    "rlcore_engines": ("engines", "engine"),
    "rlcore_rewards": ("rewards", "reward"),
    "rlcore_settings": ("settings", "setting"),
}


class PluginLoadWarning(UserWarning):
    """A plugin failed to load and was skipped."""


@dataclass
class PluginInfo:
    name: str
    version: str
    distribution: str
    provides: dict[str, list[str]] = field(default_factory=dict)
    error: str = ""  # why it failed to load, for a plugin in `Plugins.failed`


class Plugins:
    """The loaded plugins: a pluggy manager (`.hook`) plus one registry per registration hook."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager("rlcore")
        self.manager.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}
        self.failed: dict[str, PluginInfo] = {}
        self.extra: tuple[str, ...] = ()  # plugins given as modules or files, which worker processes load too
        for attr, kind in REGISTRIES.values():
            setattr(self, attr, (EngineRegistry if attr == "engines" else Registry)(kind))

    @property
    def hook(self) -> Any:
        return self.manager.hook

    def register(self, plugin: Any, name: str, version: str = "", distribution: str = "") -> None:
        """Register one plugin object and collect what its registration hooks yield.

        All or nothing: a plugin whose hooks fail or clash with a registered name is left out entirely.
        """
        if self.manager.has_plugin(name):
            raise PluginError(f"two plugins are called '{name}'; rename one of them")
        self.manager.register(plugin, name=name)
        try:
            staged = self._collect(name)
            for registry, mine in staged:  # refuse clashes before adding anything
                for key in mine.names():
                    if key in registry:
                        registry.add(mine.get(key), name)  # raises, naming both plugins
        except BaseException:
            self.manager.unregister(name=name)
            raise
        info = PluginInfo(name, version, distribution)
        for registry, mine in staged:
            for item in mine:
                registry.add(item, name)
        for attr, _ in REGISTRIES.values():
            provided = getattr(self, attr).by_plugin(name)
            if provided:
                info.provides[attr] = provided
        self.info[name] = info

    def _collect(self, name: str) -> list[tuple[Registry, Registry]]:
        """Plugin `name`'s registration hooks' yield, staged per kind in a registry of the same type."""
        staged = []
        for hook_name, (attr, _) in REGISTRIES.items():
            registry: Registry = getattr(self, attr)
            mine = type(registry)(registry.kind)
            for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
                if impl.plugin_name != name:
                    continue
                try:
                    items = list(impl.function() or ())
                except Exception as exc:  # a plugin's own bug, reported under its name
                    raise PluginError(f"plugin '{name}' failed in {hook_name}(): {exc!r}") from exc
                for item in items:
                    mine.add(item, name)
            staged.append((registry, mine))
        return staged

    def algorithm_of(self, name: str) -> str:
        """The algorithm `--plugin NAME` selects: the one plugin NAME provides, else the algorithm NAME."""
        if name in self.info:
            mine = self.algorithms.by_plugin(name)
            if len(mine) == 1:
                return mine[0]
            if name in mine:
                return name
            if mine:
                raise PluginError(f"plugin '{name}' provides several algorithms ({', '.join(mine)}); name one")
            if name not in self.algorithms:
                owners = sorted({self.algorithms.owner(a) for a in self.algorithms.names()})
                raise PluginError(
                    f"plugin '{name}' provides no algorithm; plugins with one: {', '.join(owners) or '(none)'}"
                )
        if name not in self.algorithms:
            known = sorted(set(self.algorithms.names()) | {p for p in self.info if self.algorithms.by_plugin(p)})
            raise NotRegistered(
                f"no plugin or algorithm is called '{name}'; known: {', '.join(known) or '(none)'}."
                f"{did_you_mean(name, known)} See `rlcore plugins` for what is installed."
            )
        return name


def _strict(strict: bool | None) -> bool:
    return strict if strict is not None else os.environ.get("RLCORE_STRICT_PLUGINS", "") not in ("", "0")


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get("RLCORE_DISABLE_PLUGINS", "").split(",") if n.strip()}


def import_plugin(spec: str) -> tuple[ModuleType, str]:
    """Import a plugin given as a dotted module path or a path to a `.py` file; returns (module, name)."""
    path = Path(spec)
    if spec.endswith(".py") or os.sep in spec:
        if not path.is_file():
            raise PluginError(f"plugin file '{spec}' does not exist")
        name = path.stem
        module_name = f"rlcore_user_plugin_{name}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path.resolve())
        if loader_spec is None or loader_spec.loader is None:
            raise PluginError(f"cannot import plugin file '{spec}'")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise PluginError(f"plugin file '{spec}' failed to import: {exc!r}") from exc
        return module, name
    try:
        return importlib.import_module(spec), spec
    except ImportError as exc:
        raise PluginError(f"plugin module '{spec}' cannot be imported: {exc}") from exc


def load_plugins(extra: tuple[str, ...] = (), strict: bool | None = None) -> Plugins:
    """Load the entry-point plugins and the `extra` ones (dotted modules or `.py` paths)."""
    plugins = Plugins()
    strict = _strict(strict)
    disabled = _disabled()
    for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in disabled:
            continue
        dist = ep.dist.name if ep.dist else ""
        version = ep.dist.version if ep.dist else ""
        try:
            plugins.register(ep.load(), ep.name, version, dist)
        except Exception as exc:
            message = f"plugin '{ep.name}' (distribution {dist or '?'}) failed to load and is skipped: {exc}"
            if strict:
                raise PluginError(message + " (RLCORE_STRICT_PLUGINS is set)") from exc
            plugins.failed[ep.name] = PluginInfo(ep.name, version, dist, error=f"{type(exc).__name__}: {exc}")
            warnings.warn(message, PluginLoadWarning, stacklevel=2)
    for spec in extra:
        module, name = import_plugin(spec)
        if plugins.manager.is_registered(module):
            continue
        plugins.register(module, name, getattr(module, "__version__", ""), "")
    plugins.extra = tuple(str(Path(s).resolve()) if s.endswith(".py") else s for s in extra)
    return plugins


# -------------------------------------------------------------------------
# the process's plugins
# -------------------------------------------------------------------------

EXTRA_PLUGINS_ENV = "RLCORE_EXTRA_PLUGINS"
_plugins: Plugins | None = None


def plugins() -> Plugins:
    """The plugins this process resolves names with: loaded once, on first use."""
    global _plugins
    if _plugins is None:
        _plugins = load_plugins(extra=extra_plugins_from_env())
    return _plugins


def use_plugins(loaded: Plugins | None) -> None:
    """Resolve names with `loaded` (e.g. after `load_plugins(extra=...)`); None reloads on next use."""
    global _plugins
    _plugins = loaded


def extra_plugins_from_env() -> tuple[str, ...]:
    """The module or file plugins the driver loaded, handed to worker processes through the environment."""
    return tuple(p for p in os.environ.get(EXTRA_PLUGINS_ENV, "").split(os.pathsep) if p)
