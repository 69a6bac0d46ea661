"""Plugin loading: built-ins and third-party distributions alike come from one entry-point group.

`load_plugins()` registers every plugin of the `rlcore.plugins` entry-point group (minus those named
in RLCORE_DISABLE_PLUGINS), then the modules and `.py` files named in RLCORE_PLUGINS and given as
`extra`, and collects what their registration hooks yield into registries. A plugin that fails to
import is reported by name and skipped, unless RLCORE_STRICT_PLUGINS=1 makes that fatal. A plugin given
for the run (RLCORE_PLUGINS, `extra`) may register a name an installed one has: its own replaces that
one for the run (`Plugins.replaced` says so); two installed plugins sharing a name are an error.

`plugins()` is the process's own set, loaded on first use. Workers resolve engines, dispatchers and
collectors by name with the plugins their worker runtime was given (`rlcore.worker_plugins()`: a
`RoleSession` gives its run's), else with this set; a Ray actor's own set loads the module and file
plugins of its driver's run, which the runtime hands over through RLCORE_EXTRA_PLUGINS.
"""

from __future__ import annotations

import dataclasses

import importlib
import importlib.metadata as md
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
from pydantic import BaseModel

from . import hookspecs
from .config import config_error, with_engine_keys, with_settings
from .config import load_config as load_config_as_defined
from .errors import NotRegistered, PluginError, did_you_mean
from .paths import file_kind
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
    "rlcore_environments": ("environments", "environment"),
    "rlcore_settings": ("settings", "setting"),
}


@dataclass(frozen=True)
class Registered:
    """Marks a config key whose value names a registered item (or is a list of such names), so that a
    misspelled one is a configuration error before the run starts, with the known names:
    `dispatch: Annotated[str, Registered("dispatchers")] = Field("slice", description=...)`."""

    registry: str  # the Plugins registry: roles, dispatchers, collectors, placements, algorithms or rewards

    def __post_init__(self) -> None:
        known = [attr for attr, _ in REGISTRIES.values() if attr != "engines"]
        if self.registry not in known:
            raise PluginError(f"Registered({self.registry!r}): no such registry; use one of {', '.join(known)}")


class _RegisteredNames:
    """The core's own `rlcore_configure`, run after the plugins' ones: keys marked `Registered` must
    name registered items."""

    def __init__(self, plugins: Plugins):
        self.plugins = plugins

    @hookspecs.hookimpl(trylast=True)
    def rlcore_configure(self, config: Any) -> None:
        problems = list(self.unregistered(config))
        if problems:
            raise config_error(problems)

    def unregistered(self, config: BaseModel, prefix: str = "") -> Iterator[tuple[str, str]]:
        """(key path, message) for every name a `Registered` key of `config` gives that is not registered."""
        for key, info in type(config).model_fields.items():
            value, path = getattr(config, key), f"{prefix}{key}"
            marks = [m for m in info.metadata if isinstance(m, Registered)]
            if isinstance(value, BaseModel):
                yield from self.unregistered(value, f"{path}.")
            elif marks:
                registry = getattr(self.plugins, marks[0].registry)
                for name in value if isinstance(value, (list, tuple)) else [value]:
                    try:
                        if isinstance(name, str):
                            registry.get(name)
                    except NotRegistered as exc:
                        yield path, str(exc)


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
        self.replaced: list[str] = []  # one line per installed name a plugin given for the run replaced
        self._config_models: dict[type, type] = {}  # config_model's, per algorithm config model
        self._given: dict[str, str] = {}  # plugins given for the run: name -> module or file, as given
        for attr, kind in REGISTRIES.values():
            setattr(self, attr, (EngineRegistry if attr == "engines" else Registry)(kind))
        self.manager.register(_RegisteredNames(self), name="rlcore-registered-names")

    @property
    def hook(self) -> Any:
        return self.manager.hook

    def register(
        self, plugin: Any, name: str, version: str = "", distribution: str = "", *, given: str = ""
    ) -> None:
        """Register one plugin object and collect what its registration hooks yield.

        All or nothing: a plugin whose hooks fail or clash with a registered name is left out entirely.
        `given`: the module or file the plugin was given as for this run; a name it shares with an
        installed plugin replaces that plugin's for the run, and a line in `replaced` says so.
        """
        if self.manager.has_plugin(name):
            raise PluginError(f"two plugins are called '{name}'; rename one of them")
        self.manager.register(plugin, name=name)
        try:
            staged = self._collect(name)
            replacing = []
            for attr, mine in staged:  # refuse clashes before adding anything
                registry = getattr(self, attr)
                for key in mine.names():
                    if key not in registry:
                        continue
                    previous = registry.owner(key)
                    if given and previous not in self._given:
                        replacing.append((attr, key, mine.get(key)))
                    elif given:
                        raise PluginError(
                            f"{registry.kind} '{key}' is registered twice: by plugin '{previous}' "
                            f"({self._given[previous]}) and by plugin '{name}' ({given}), both given for this run; "
                            f"give one of them"
                        )
                    else:
                        registry.add(mine.get(key), name)  # raises, naming both plugins
        except BaseException:
            self.manager.unregister(name=name)
            raise
        for attr, key, item in replacing:
            self._replace(attr, key, item, name, given)
        for attr, mine in staged:
            for item in mine:
                if mine.key_of(item) not in getattr(self, attr):
                    getattr(self, attr).add(item, name)
        if given:
            self._given[name] = given
        self.info[name] = PluginInfo(name, version, distribution)
        self._update_provides(name)

    def _replace(self, attr: str, key: str, item: Any, plugin: str, given: str) -> None:
        """Put `plugin`'s `item` in place of the installed one registered under `key`."""
        old = getattr(self, attr)
        previous = old.owner(key)
        replaced = old.get(key)
        if getattr(item, "demo", "missing") is None and getattr(replaced, "demo", None):
            # an algorithm put in place of another without a preset of its own runs that one's demo preset
            item = dataclasses.replace(item, demo=replaced.demo)
        fresh = type(old)(old.kind)
        for kept in old:
            if old.key_of(kept) != key:
                fresh.add(kept, old.owner(old.key_of(kept)))
        fresh.add(item, plugin)
        setattr(self, attr, fresh)
        self._update_provides(previous)
        trainer = getattr(item, "trainer", None)
        what = f" ({trainer.__name__})" if isinstance(trainer, type) else ""
        dist = self.info[previous].distribution
        whose = "the built-in one" if dist == "rlcore" else f"the one of plugin '{previous}' ({dist or 'not installed'})"
        self.replaced.append(f"{old.kind} '{key}' from {given}{what} replaces {whose} for this run")

    def _update_provides(self, name: str) -> None:
        self.info[name].provides = {
            attr: provided for attr, _ in REGISTRIES.values() if (provided := getattr(self, attr).by_plugin(name))
        }

    def describe(self, name: str) -> str:
        """What plugin `name` provides, in a few words: 'algorithms: grpo; hooks: rlcore_configure'."""
        parts = [f"{attr}: {', '.join(names)}" for attr, names in self.info[name].provides.items()]
        callers = self.manager.get_hookcallers(self.manager.get_plugin(name)) or []
        hooks = sorted(c.name for c in callers if c.name not in REGISTRIES)
        if hooks:
            parts.append(f"hooks: {', '.join(hooks)}")
        return "; ".join(parts) or "nothing"

    def _collect(self, name: str) -> list[tuple[str, Registry]]:
        """Plugin `name`'s registration hooks' yield, staged per registry attribute in one of the same type."""
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
            staged.append((attr, mine))
        return staged

    def config_model(self, algorithm: str | type[BaseModel]) -> type[BaseModel]:
        """The config model a run of `algorithm` (a registered name, or a config model) validates with: its own keys,
        the settings plugins add (`with_settings`) and the keys of the engines its role sections build
        (`with_engine_keys`). Built once per model."""
        name = algorithm if isinstance(algorithm, str) else ""
        model = self.algorithms.get(algorithm).config if isinstance(algorithm, str) else algorithm
        if model not in self._config_models:
            self._config_models[model] = with_engine_keys(with_settings(model, self.settings, name), self.engines)
        return self._config_models[model]

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


def is_file_or_module(spec: str) -> bool:
    """`spec` names a plugin by a `.py` path or a dotted module, not by an installed plugin's name."""
    return spec.endswith(".py") or os.sep in spec or "." in spec


def plugin_name(spec: str) -> str:
    """The name a plugin given as `spec` is registered under: a file's stem, or the module or plugin name."""
    return Path(spec).stem if spec.endswith(".py") or os.sep in spec else spec


def import_plugin(spec: str) -> tuple[ModuleType, str]:
    """Import a plugin given as a dotted module path or a path to a `.py` file; returns (module, name)."""
    path = Path(spec)
    if spec.endswith(".py") or os.sep in spec:
        if not path.is_file():
            kind = file_kind(path.stat().st_mode) if path.exists() else ""
            raise PluginError(f"plugin file '{spec}' " + (f"is {kind}, not a .py file" if kind else "does not exist"))
        name = plugin_name(spec)
        module_name = f"rlcore_user_plugin_{name}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path.resolve())
        if loader_spec is None or loader_spec.loader is None:
            raise PluginError(f"plugin file '{spec}' is not a .py file; give a path ending in .py or a dotted module")
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
    """Load the entry-point plugins, then the RLCORE_PLUGINS and `extra` ones (dotted modules or `.py`
    paths), which are given for the run: a name one of them registers replaces an installed plugin's."""
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
    from_env = _plugins_from_env()
    given = {_absolute(s): s for s in (*from_env, *extra)}  # each once, in order
    for spec in given.values():
        try:
            module, name = import_plugin(spec)
        except PluginError as exc:
            if spec not in from_env or spec in extra:
                raise
            raise PluginError(f"{PLUGINS_ENV} names {spec!r}: {exc}") from exc.__cause__
        if plugins.manager.is_registered(module):
            continue
        plugins.register(module, name, getattr(module, "__version__", ""), "", given=spec)
    plugins.extra = tuple(given)
    return plugins


def _absolute(spec: str) -> str:
    """A plugin file as an absolute path (worker processes may start elsewhere); a module as it is."""
    return str(Path(spec).resolve()) if spec.endswith(".py") or os.sep in spec else spec


def _plugins_from_env() -> tuple[str, ...]:
    """RLCORE_PLUGINS: modules and files every run loads. A worker process takes its driver's list
    (RLCORE_EXTRA_PLUGINS, which holds them) instead, so relative paths resolve where the driver runs."""
    if EXTRA_PLUGINS_ENV in os.environ:
        return ()
    return tuple(p.strip() for p in os.environ.get(PLUGINS_ENV, "").split(os.pathsep) if p.strip())


# -------------------------------------------------------------------------
# the process's plugins
# -------------------------------------------------------------------------

PLUGINS_ENV = "RLCORE_PLUGINS"  # modules and files (os.pathsep-separated) that every run loads
EXTRA_PLUGINS_ENV = "RLCORE_EXTRA_PLUGINS"
_plugins: Plugins | None = None


def plugins() -> Plugins:
    """The plugins this process resolves names with: loaded once, on first use."""
    global _plugins
    if _plugins is None:
        _plugins = load_plugins(extra=extra_plugins_from_env())
    return _plugins


_process_plugins = plugins  # for functions whose `plugins` argument hides the name


def use_plugins(loaded: Plugins | None) -> None:
    """Resolve names with `loaded` (e.g. after `load_plugins(extra=...)`); None reloads on next use."""
    global _plugins
    _plugins = loaded


def config_model(algorithm: str | type[BaseModel], plugins: Plugins | None = None) -> type[BaseModel]:
    """`Plugins.config_model` of `plugins` (default: this process's): the model a run of `algorithm` validates
    with, which takes the engines' keys (`config_model(GRPOConfig)(rollout={"engine": "vllm", "vllm_max_model_len":
    4096})`)."""
    return (plugins if plugins is not None else _process_plugins()).config_model(algorithm)


def load_config(model: type[BaseModel], path: str | os.PathLike | None = None, overrides: Any = (), *,
                algorithm: str = "", plugins: Plugins | None = None) -> BaseModel:
    """`rlcore.config.load_config` into `model` as a run has it (`Plugins.config_model`: with the keys plugins and
    engines add, `rollout.vllm_max_model_len`, `report_to`), with `plugins` (default: this process's)."""
    return load_config_as_defined(config_model(model, plugins), path, overrides, algorithm=algorithm)


def extra_plugins_from_env() -> tuple[str, ...]:
    """The module or file plugins the driver loaded, handed to worker processes through the environment."""
    return tuple(p for p in os.environ.get(EXTRA_PLUGINS_ENV, "").split(os.pathsep) if p)
