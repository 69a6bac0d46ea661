"""Configuration: the models every algorithm shares, YAML loading with dotted overrides (the YAML itself, in and
out, is `yaml_io`'s).

A config is a YAML file plus `key=value` overrides on the command line (the command line wins),
validated into an algorithm's pydantic model with every problem reported at once. Nothing is evaluated.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Iterable
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    create_model,
    field_validator,
)
from pydantic.fields import FieldInfo

from .bounds import MAX_GIB, MAX_SEED, MAX_TIMEOUT_S, MAX_WORKERS
from .errors import ConfigError, PluginError, RlcoreError
from .paths import read_regular_file
from .yaml_io import MAX_CONFIG_BYTES, _Loader

if TYPE_CHECKING:
    from .specs import EngineSpec, SettingSpec


class ConfigProblems(ValueError):
    """Raised by a config model's cross-field validator with `(key path, message)` pairs, so that each
    problem is reported under its own key beside pydantic's, not as one line under "(top level)"."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{key} {message}" for key, message in self.problems))


class BaseConfig(BaseModel):
    """Every config section forbids unknown keys, so a typo is an error, never silently ignored, and a
    number is never given as a boolean (`beta: true` would otherwise be 1.0)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            if _takes_number_not_bool(cls.model_fields[info.field_name].annotation):
                raise ValueError("is a number, not a boolean; write a number, e.g. 0.1")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _one_as_a_list(cls, value: Any, info: ValidationInfo) -> Any:
        """A list key given one value (`--reward_funcs accuracy`, `reward_funcs: accuracy`) is a list of it, unless
        the key reads such values itself (a validator of its own: `report_to: all`)."""
        field = cls.model_fields.get(info.field_name)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and field is not None:
            own = any(isinstance(m, (BeforeValidator, PlainValidator, WrapValidator)) for m in field.metadata)
            if _takes_only_lists(field.annotation) and not own:
                return [value]
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _finite_numbers(cls, value: Any) -> Any:
        """NaN and infinities nowhere, also inside free-form options (engine_kwargs, device_groups): a run
        given one trains NaN weights; nor an integer beyond 64 bits there, which no library takes."""
        where = _nonfinite_at(value)
        if where is not None:
            raise ValueError(f"holds {where}: not a finite number; write a finite one")
        where = _huge_int_at(value)
        if where is not None:
            raise ValueError(f"holds {where}: beyond a 64-bit integer; write one from {-MAX_INT} to {MAX_INT}")
        return value


GPUS_HELP = ("GPUs for this role, one worker each: auto (default) the visible GPUs (Ray: the cluster's), shared by "
             "colocated roles, the CPU where none is visible; 0 the CPU (one worker, or `cpus` workers); N that many")
MAX_RESTARTS = 1000  # Ray restarts of one worker a run may ask: a worker lost more often is broken, not unlucky


def gpu_count(value: Any) -> int:
    """The GPUs a role's `gpus` asks as a number: an `auto` not yet resolved (`rlcore.runtime.devices.resolve_gpus`)
    asks none, as on a machine without GPUs; a bad value (reported by validation) none either."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class DeviceKeys(BaseConfig):
    """A role's devices: `gpus` (auto, or a count; 0: the CPU) and its CPU workers."""

    gpus: Annotated[int, Field(ge=0, le=MAX_WORKERS)] | Literal["auto"] = Field("auto", description=GPUS_HELP)
    cpus: int = Field(1, ge=1, le=MAX_WORKERS, description="CPU workers when the role has no GPU (Ray only)")

    @field_validator("gpus", mode="before")
    @classmethod
    def _auto_or_count(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str) or not isinstance(value, (int, float)):
            raise ValueError(f"is {value!r}; write auto (the visible GPUs) or a number of GPUs (0: the CPU)")
        return value

    @property
    def gpu_count(self) -> int:
        """`gpus` as a number (`gpu_count`): 0 for an unresolved auto."""
        return gpu_count(self.gpus)


class RoleConfig(DeviceKeys):
    """A role's section (`train:`, `rollout:`, `teacher:` ...): its devices and its engine's options.

    An engine's own keys (vLLM's `vllm_max_model_len`, megatron's `tensor_model_parallel_size`) are declared by its
    plugin (`EngineSpec.keys`) and added to the sections of the kinds it serves (`engine_kinds`) by
    `with_engine_keys`; `engine_options()` gives the keys of the section's engine, as that engine takes them.
    """

    # the engine kinds (`EngineSpec.kind`) this section's role builds: whose keys it takes
    engine_kinds: ClassVar[tuple[str, ...]] = ()
    # an algorithm's own defaults for an engine's keys ({"vllm": {"vllm_gpu_memory_utilization": 0.9}})
    engine_defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    # set by `with_engine_keys`: {(engine, kind): the keys that engine declares for that kind}
    engine_keys: ClassVar[dict[tuple[str, str], tuple[str, ...]]] = {}

    engine: str = Field("hf", description="engine implementation (see `rlcore plugins`)")

    def engine_options(self, kind: str | None = None) -> dict[str, Any]:
        """The keys of this section's engine that it declares for `kind` (default: the section's first kind), with
        their values here; a key left None is left out (the engine's own default holds). In a section built
        without the plugins' keys (a config model used as the plugin defined it) only the algorithm's
        `engine_defaults` for the engine."""
        kind = kind or (self.engine_kinds[0] if self.engine_kinds else "")
        options = dict(self.engine_defaults.get(self.engine, {}))
        fields = type(self).model_fields
        for key in self.engine_keys.get((self.engine, kind), ()):
            if key in fields and getattr(self, key) is not None:
                options[key] = getattr(self, key)
        return options


class RunConfig(BaseConfig):
    """Keys every algorithm has: where outputs go, seeding, and how roles are placed on devices."""

    _auto_gpus: dict[str, int] = PrivateAttr(default_factory=dict)  # set by rlcore.runtime.devices.resolve_gpus

    output_dir: str = Field("output", description="metrics.jsonl, checkpoints and samples go here")
    overwrite_output_dir: bool = Field(
        False, description="start afresh in an output_dir that holds an earlier run (the checkpoints and final model "
        "rlcore wrote there are removed, metrics.jsonl replaced), and let this run replace folders named like its "
        "checkpoints that rlcore did not write; without it such an output_dir is refused"
    )
    seed: int = Field(42, ge=0, le=MAX_SEED, description="seed for data order, sampling and initialisation")
    nnodes: int | None = Field(
        None, ge=1, le=MAX_WORKERS, description="nodes of the Ray cluster the plan spans (default: 1, or in device_groups what the ranks need)"
    )
    nproc_per_node: int | None = Field(None, ge=1, le=MAX_WORKERS, description="GPUs per node (default: the role form's largest need)")
    device_groups: dict[str, Any] | None = Field(
        None, description="ms-swift's per-group form: {nproc_per_node, GROUP: {device, ranks, workers}}"
    )
    colocate_groups: list[list[str]] = Field(
        default_factory=list, description="roles that share GPUs, e.g. [[train, rollout]]"
    )
    placement: str = Field("pack", description="placement policy (see `rlcore plugins`)")
    placement_timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S, description="fail if the placement group is not ready by then")
    worker_timeout_s: float = Field(
        1800.0, gt=0, le=MAX_TIMEOUT_S, description="a Ray group call with no result for this many seconds stops the run with RoleFailed "
        "naming the worker that did not answer (hung, stopped or deadlocked)"
    )
    ray_address: str | None = Field(None, description="attach to this Ray cluster ('auto' for a running one)")
    max_restarts: int = Field(
        0, ge=0, le=MAX_RESTARTS, description="Ray restarts of each worker of a role that holds no training state "
        "(rollout, reward, teacher, reference, sampler): a lost one is restarted, its weights restored from the train "
        "side and its call retried; 0: a lost worker stops the run. Needs --use-ray"
    )
    sleep_level: Literal[0, 1, 2] = Field(1, description="rollout sleep level while colocated training runs")
    offload_model: bool = Field(False, description="offload train weights while colocated rollout runs")
    offload_optimizer: bool = Field(False, description="offload optimizer state while colocated rollout runs")
    gpu_memory_gib: float | None = Field(
        None, gt=0, le=MAX_GIB, description="each GPU's memory for the memory plan (rlcore plan); unset: this machine's GPU "
        "(nvidia-smi), else 80 (an A100/H100; an H200: 140)"
    )
    memory_check: bool = Field(
        True, description="refuse a run whose memory plan predicts a GPU out of memory (false: a warning only)"
    )


# -------------------------------------------------------------------------
# plugin settings: config keys that plugins add to every algorithm (rlcore_settings)
# -------------------------------------------------------------------------


def with_settings(model: type[BaseModel], settings: Iterable[SettingSpec], algorithm: str = "") -> type[BaseModel]:
    """`model` extended with the keys plugins add (`plugins.settings`), so they validate with its own.

    A setting named like one of the model's keys (or aliases) is a `PluginError` naming the plugin and
    the algorithm; `settings` may be a `Registry`, whose owners the message names.
    """
    owner = getattr(settings, "owner", None)
    added = getattr(model, "__rlcore_settings__", frozenset())  # a model extended before: its settings are in
    specs = [spec for spec in settings if spec.name not in added]
    if not specs:
        return model
    taken = _names_and_aliases(model)
    whose = f"algorithm '{algorithm}' ({model.__name__})" if algorithm else model.__name__
    clashes = []
    for name in (spec.name for spec in specs if spec.name in taken):
        plugin = owner(name) if owner else "?"
        clashes.append(
            f"plugin '{plugin}' adds the setting '{name}', but {whose} already has a key '{name}': rename "
            f"the setting, or leave the plugin out with RLCORE_DISABLE_PLUGINS={plugin}"
        )
    if clashes:
        raise PluginError("\n".join(clashes))
    fields: dict[str, Any] = {
        spec.name: (spec.type, Field(spec.default, description=spec.description or None)) for spec in specs
    }
    extended = create_model(  # same name and docstring: `config show` and error messages read as before
        model.__name__, __base__=model, __module__=model.__module__, __doc__=model.__doc__, **fields
    )
    extended.__rlcore_settings__ = added | set(fields)
    return extended


def with_engine_keys(model: type[BaseModel], engines: Iterable[EngineSpec]) -> type[BaseModel]:
    """`model` with each role section (a `RoleConfig` field) extended by the keys its engines declare
    (`EngineSpec.keys`, a pydantic model) for the kinds the section builds (`engine_kinds`), at the section's
    top (`rollout.vllm_max_model_len`), with the section's `engine_defaults`. They validate, show and render as
    the section's own keys; the engine reads those of its name (`RoleConfig.engine_options`).

    An engine key named like a key the section has already, or like another engine's key declared by another
    model, is a `PluginError` naming both; `engines` may be a `Registry`, whose owners the message names.
    """
    owner = getattr(engines, "owner", None)
    specs = [spec for spec in engines if getattr(spec, "keys", None) is not None]
    if not specs:
        return model
    sections: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        section = info.annotation
        if not (isinstance(section, type) and issubclass(section, RoleConfig) and section.engine_kinds):
            continue
        if section.engine_keys:  # extended before
            continue
        built = _section_with_engine_keys(section, specs, owner)
        if built is not section:
            sections[name] = (built, FieldInfo.merge_field_infos(info, default_factory=built, annotation=built))
    if not sections:
        return model
    return create_model(  # same name and docstring: `config show` and error messages read as before
        model.__name__, __base__=model, __module__=model.__module__, __doc__=model.__doc__, **sections
    )


def _section_with_engine_keys(section: type[RoleConfig], specs: list[EngineSpec], owner: Any) -> type[RoleConfig]:
    taken = _names_and_aliases(section)
    fields: dict[str, Any] = {}
    declared: dict[str, tuple[type, str]] = {}  # key -> (the keys model declaring it, its engine)
    keys: dict[tuple[str, str], tuple[str, ...]] = {}
    problems = []
    for spec in specs:
        keys[(spec.name, spec.kind)] = tuple(spec.keys.model_fields)
        if spec.kind not in section.engine_kinds:
            continue
        defaults = section.engine_defaults.get(spec.name, {})
        for key, info in spec.keys.model_fields.items():
            plugin = owner(f"{spec.kind}/{spec.name}") if owner else "?"
            if key in taken:
                problems.append(f"engine '{spec.name}' (plugin '{plugin}') declares the key '{key}', but "
                                f"{section.__name__} already has a key '{key}': rename the engine's key")
                continue
            first = declared.setdefault(key, (spec.keys, spec.name))
            if first[0] is not spec.keys:
                problems.append(f"engine '{spec.name}' (plugin '{plugin}') declares the key '{key}', which engine "
                                f"'{first[1]}' declares too: one of them renames it (prefix it with the engine's name)")
                continue
            if key not in fields:
                fields[key] = (info.annotation, FieldInfo.merge_field_infos(info, default=defaults[key]) if key in defaults else info)
    if problems:
        raise PluginError("\n".join(problems))
    built = create_model(section.__name__, __base__=section, __module__=section.__module__, __doc__=section.__doc__, **fields)
    built.engine_keys = keys
    return built


def _names_and_aliases(model: type[BaseModel]) -> set[str]:
    """Every name a key of `model` is read under: its field names and their aliases."""
    names = set(model.model_fields)
    for info in model.model_fields.values():
        aliases = [info.alias, info.validation_alias]
        if isinstance(info.validation_alias, AliasChoices):
            aliases.extend(info.validation_alias.choices)
        names.update(alias for alias in aliases if isinstance(alias, str))
    return names


# -------------------------------------------------------------------------
# loading: a YAML file plus dotted key=value overrides, validated all at once
# -------------------------------------------------------------------------


def load_config(
    model: type[BaseModel],
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    *,
    algorithm: str = "",
) -> BaseModel:
    """Load `path` (YAML) with `overrides` (`key.sub=value`, values parsed as YAML) on top, into `model`.

    The command line wins over the file. Every problem is reported at once in one `ConfigError` whose
    `problems` lists `(dotted key path, message)`; an unknown key suggests the closest known one, or points to
    `rlcore config show --plugin ALGORITHM`. ms-swift's and TRL's keys are rlcore's once `rlcore.compat.ms_swift`
    translated them (`rlcore.compat.ms_swift.load_translated`, what the CLI reads a file with).
    """
    data, problems, from_cli = read_config_data(path, overrides)
    return config_from_data(model, data, problems, from_cli, algorithm=algorithm, source=path)


def config_from_data(
    model: type[BaseModel],
    data: dict[str, Any],
    problems: Iterable[tuple[str, str]] = (),
    from_cli: Iterable[str] = (),
    *,
    algorithm: str = "",
    source: str | os.PathLike | None = None,
) -> BaseModel:
    """`data` (a config's keys) validated into `model`; `problems` found before (reading, translating) are reported
    with pydantic's, all at once, in one `ConfigError` naming `source`."""
    problems = list(problems)
    try:
        config = model.model_validate(data)
    except ValidationError as exc:
        problems.extend(validation_problems(exc, model, from_cli, algorithm))
        config = None
    if problems:
        raise config_error(problems, source=str(source) if source is not None else "")
    return config


def read_config_data(
    path: str | os.PathLike | None, overrides: Iterable[str] = ()
) -> tuple[dict[str, Any], list[tuple[str, str]], set[str]]:
    """(the file's keys with the overrides set, the overrides' problems, the keys set on the command line)."""
    data = _read_yaml(path) if path is not None else {}
    problems: list[tuple[str, str]] = []
    from_cli: set[str] = set()
    for override in overrides:
        key, value, problem = _parse_override(override)
        if problem:
            problems.append((key or override, problem))
            continue
        problem = _set_dotted(data, key, value)
        if problem:
            problems.append((key, problem))
        from_cli.add(key)
    return data, problems, from_cli


def validation_problems(
    exc: ValidationError, model: type[BaseModel], from_cli: Iterable[str] = (), algorithm: str = ""
) -> list[tuple[str, str]]:
    """Pydantic's errors as `(dotted key path, message)` pairs. An unknown key gets the closest known one,
    else a pointer to `rlcore config show --plugin ALGORITHM` (without `algorithm`, the keys known there,
    listed once)."""
    from_cli = tuple(from_cli)
    problems = []
    listed: set[tuple] = set()
    for error in exc.errors():
        loc = tuple(error["loc"])
        raised = (error.get("ctx") or {}).get("error")
        if isinstance(raised, ConfigProblems):  # a cross-field rule: one problem per key, without the input
            prefix = ".".join(str(part) for part in loc)
            problems.extend((f"{prefix}.{key}" if prefix else key, message) for key, message in raised.problems)
            continue
        path = ".".join(str(part) for part in loc) or "(top level)"
        if error["type"] == "extra_forbidden":
            message = f"unknown key '{loc[-1]}'." + _unknown_key_hint(str(loc[-1]), model, loc[:-1], algorithm, listed)
        else:
            msg = error["msg"].removeprefix("Value error, ")
            message = f"{msg} (got {error['input']!r})" if "input" in error else msg
        if any(path == key or path.startswith(key + ".") or key.startswith(path + ".") for key in from_cli):
            message += " [set on the command line]"
        problems.append((path, message))
    return problems


def _unknown_key_hint(name: str, model: type[BaseModel], section: tuple, algorithm: str, listed: set[tuple]) -> str:
    known = _known_keys(model, section)
    close = closest_key(name, _candidates(model, section))
    if close:
        return f" Did you mean '{close}'?"
    where = " under " + ".".join(map(str, section)) if section else ""
    if algorithm:
        return f" `rlcore config show --plugin {algorithm}` lists every key{where}."
    if section in listed:
        return " The known keys here are listed above."
    listed.add(section)
    return f" Known keys here: {', '.join(known) or '(none)'}."


def config_error(problems: list[tuple[str, str]], source: str = "") -> ConfigError:
    """One `ConfigError` listing every problem, each on its own line under a one-line summary."""
    where = f" in {source}" if source else ""
    count = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
    lines = "\n".join(f"  {path}: {message}" for path, message in problems)
    return ConfigError(f"invalid configuration{where} ({count}):\n{lines}", problems)


def problems_of(checks: Iterable[tuple[str, Callable[[], Any]]]) -> list[tuple[str, str]]:
    """Run every check of `(key, check)`; what an `RlcoreError` says becomes its problems (its own list
    where it has one, else one under `key`), so a trainer's `check` reports everything at once."""
    problems: list[tuple[str, str]] = []
    for key, check in checks:
        try:
            check()
        except RlcoreError as exc:
            problems.extend(getattr(exc, "problems", None) or [(key, str(exc))])
    return problems


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    raw = read_regular_file(path, "--config", "a YAML config file", MAX_CONFIG_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        problem = f"not UTF-8 text: byte 0x{raw[exc.start]:02x} on line {line}; save the file as UTF-8"
        raise config_error([("(file)", problem)], source=str(path)) from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except RecursionError:
        raise config_error([("(file)", "not valid YAML: nested too deep (lists or mappings inside each other "
                             "hundreds of levels down); flatten it")], source=str(path)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise config_error([("(file)", f"not valid YAML: {line}{problem}")], source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise config_error(
            [("(top level)", f"must be a mapping of keys to values, got {type(data).__name__}")], source=str(path)
        )
    return data


def _parse_override(override: str) -> tuple[str, Any, str]:
    """`key.sub=value` -> (key, YAML-parsed value, problem or '')."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        return key, None, f"override '{override}' is not of the form key=value (dotted keys: train.gpus=8)"
    try:
        return key, yaml.load(text, Loader=_Loader) if text.strip() else "", ""
    except yaml.YAMLError as exc:
        return key, None, f"value {text[:80]!r} is not valid YAML: {getattr(exc, 'problem', None) or exc}"
    except RecursionError:
        return key, None, "value is nested too deep (lists or mappings hundreds of levels down); flatten it"


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> str:
    """Set `data[a][b][c] = value` for `key='a.b.c'`, creating sections; '' or a problem."""
    *parents, last = key.split(".")
    node = data
    for depth, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            section = ".".join(parents[: depth + 1])
            return f"'{section}' is {child!r}, not a section, so '{key}' cannot be set"
        node = child
    node[last] = value
    return ""


def closest_key(name: str, candidates: Iterable[str | tuple[str, str]]) -> str | None:
    """The candidate that `name` most likely misspells, or None; a candidate is a key or `(key, how it is shown)`.
    Close as a whole (a typo: 'engnie', 'learningrate'), or word by word: each word of `name` is one of the
    candidate's words, misspelt or cut short ('epsilon_hi'), so that a key of another meaning is never offered
    ('num_train_epochs' shares only 'num' with 'num_iterations')."""
    best, score = None, 0.0
    for candidate in candidates:
        key, shown = candidate if isinstance(candidate, tuple) else (candidate, candidate)
        whole = difflib.SequenceMatcher(None, name, key).ratio()
        if (whole >= 0.9 or (whole >= 0.6 and _words_match(name, key))) and whole > score:
            best, score = shown, whole
    return best


def _words_match(name: str, key: str) -> bool:
    words = [w for w in key.split("_") if w]
    for word in (w for w in name.split("_") if w):
        match = next((w for w in words if w.startswith(word) or difflib.SequenceMatcher(None, word, w).ratio() >= 0.75),
                     None)
        if match is None:
            return False
        words.remove(match)
    return True


def _candidates(model: type[BaseModel], section: tuple) -> list[tuple[str, str]]:
    """(key, how it is shown) of the keys a key misplaced at `section` may have meant: the section's own, the top
    level's, and every role section's by its dotted path (`train.gradient_checkpointing`)."""
    found = [(key, key) for key in _known_keys(model, section)]
    if section:
        where = ".".join(map(str, section))
        found += [(key, f"{key}' at the top level, not under '{where}") for key in _known_keys(model, ())]
    for name in _known_keys(model, ()):
        if (name,) != tuple(section):
            found += [(key, f"{name}.{key}") for key in _known_keys(model, (name,))]
    return found


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys allowed at `loc` inside `model`, following nested models through Optional/list/dict."""
    current: Any = model
    for part in loc:
        current = _unwrap_optional(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            if part not in current.model_fields:
                return []
            current = current.model_fields[part].annotation
        else:  # a list index or a dict key: step into the element type
            args = get_args(current)
            current = args[-1] if args else None
    current = _unwrap_optional(current)
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def _takes_only_lists(annotation: Any) -> bool:
    """`list[X]` or `list[X] | None`: no scalar is a value of its own."""
    annotation = _unwrap_optional(annotation)
    return get_origin(annotation) is list


def _takes_number_not_bool(annotation: Any) -> bool:
    """An int or float field (also optional, or a Literal of numbers) that takes no boolean."""
    if get_origin(annotation) in (Union, UnionType):
        options = get_args(annotation)
        return bool not in options and any(_takes_number_not_bool(a) for a in options)
    if get_origin(annotation) is Literal:
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in get_args(annotation))
    if get_origin(annotation) is Annotated:
        return _takes_number_not_bool(get_args(annotation)[0])
    return annotation in (int, float)


MAX_INT = 2**63 - 1  # an integer in free-form options (engine_kwargs): what torch, numpy and Ray's C++ take


def _found_at(value: Any, leaf: Callable[[Any], str | None], path: str = "") -> str | None:
    """Where in `value` (lists and mappings, not config sections) the first leaf `leaf` describes is, as
    "a.x = what" ("what" for `value` itself); None when `leaf` describes none."""
    what = leaf(value)
    if what is not None:
        return f"{path} = {what}" if path else what
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _found_at(item, leaf, f"{path}.{key}" if isinstance(value, dict) and path else
                          str(key) if isinstance(value, dict) else f"{path}[{key}]")
        if found is not None:
            return found
    return None


def _huge_int_at(value: Any) -> str | None:
    """Where in `value` an integer beyond +-MAX_INT is ("a.x = an integer of 90 bits")."""
    return _found_at(value, lambda v: f"an integer of {v.bit_length()} bits"
                     if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT else None)


def _nonfinite_at(value: Any) -> str | None:
    """Where in `value` a NaN or infinite float is ("a.x = inf")."""
    return _found_at(value, lambda v: str(v) if isinstance(v, float) and not math.isfinite(v) else None)


def _unwrap_optional(annotation: Any) -> Any:
    """`X | None` -> X; anything else unchanged."""
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
