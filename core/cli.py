"""The `rlcore` command: run an algorithm, list plugins, show or validate a config, plot a run's metrics.

Exit status: 0 on success; 2 for usage and configuration mistakes (a one-paragraph message, no
traceback); 1 for other rlcore errors at run time (a traceback only with RLCORE_DEBUG=1) and for a worker's
failure (one line, rlcore's advice, the worker's traceback in run.log: `rlcore.failures`); 130 when interrupted.
Plugins are loaded only by the subcommands that need them, so `rlcore --help` is fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from . import __version__, log
from .config import config_error, read_config_data, validation_problems
from .extras import check_run, plugin_needs
from .failures import advice, failure_of
from .errors import ConfigError, NotRegistered, PluginError, RlcoreError, did_you_mean
from .checkpoint import check_output_dir, check_resume_path, finished_run, foreign_checkpoints
from .log import LEVELS, STOP, logger
from .testing import is_tiny, remove_built_tiny_models
from .manager import PluginLoadWarning, Plugins, is_file_or_module, load_plugins, plugin_name
from .metrics import jsonable
from .compat.ms_swift import Translation, launch_options, load_translated, translate
from .plot import plot_metrics
from .runtime.devices import resolve_gpus
from .signals import leaving
from .yaml_io import render_config, render_value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `rlcore` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    log.redact(log.env_secrets())  # OPENAI_API_KEY, HF_TOKEN, ...: never printed or written
    parser = _parser(_keys_help(argv))
    args = parser.parse_args(_dashed_overrides(argv, parser))
    log.route_warnings(hide_libraries=args.command == "run")  # a run's run.log keeps a library's warnings
    try:
        return args.func(args)
    except BrokenPipeError:  # `rlcore plugins | head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lets the interpreter's final flush succeed
        return 0
    except KeyboardInterrupt:
        logger.warning("interrupted", extra=STOP)
        leaving(130)
        return 130
    except SystemExit as exc:
        if exc.code == signal.SIGTERM:  # Ray's own SIGTERM handler (`sys.exit(15)`), active while Ray starts
            print("rlcore: stopped by SIGTERM while starting; nothing was trained or saved", file=sys.stderr)
            leaving(128 + signal.SIGTERM)
            return 128 + signal.SIGTERM
        if exc.code in (128 + signal.SIGTERM, 128 + signal.SIGHUP):
            leaving(exc.code)
        raise
    except RlcoreError as exc:
        if _debugging() and failure_of(exc) is None:
            traceback.print_exc()
        logger.error(str(exc))
        _explain(exc)
        return exc.exit_code
    except Exception as exc:  # an in-process worker's own exception: reported as a Ray worker's RoleFailed is
        failure = failure_of(exc)
        if failure is None and isinstance(exc, OSError) and exc.filename is not None and not _debugging():
            logger.error(f"cannot use {exc.filename}: {exc.strerror or exc}")  # a full disk, a file size limit
            return 1
        if failure is None:
            raise
        logger.error(failure.line())
        _explain(exc)
        return 1


def _debugging() -> bool:
    return os.environ.get("RLCORE_DEBUG", "") not in ("", "0")


def _explain(exc: BaseException) -> None:
    """After a worker's failure's line: rlcore's advice for it, if any, and its traceback (in run.log; here too at
    --log-level debug or with RLCORE_DEBUG=1)."""
    failure = failure_of(exc)
    if failure is None:
        return
    hint = advice(failure)
    if hint:
        logger.error(hint, extra={"prefix": "hint: "})
    detail = log.failure_detail(exc)
    if detail and (_debugging() or logger.isEnabledFor(logging.DEBUG)):
        print(log.scrub(detail), file=sys.stderr)
    elif detail and log.last_detail is not None:
        logger.info(f"the worker's full error is in {log.last_detail}; --log-level debug shows it here too")


OWN_OPTIONS = {
    "--plugin", "--with", "--config", "--from-ms-swift", "--use-ray", "--resume", "--fit", "--json", "--keys", "--output", "--help",
    "--version", "--log-level",
}


_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=")


def _dashed_overrides(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """TRL's and ms-swift's spelling of overrides for `run` and `config`: `--key value` or `--key=value` becomes
    `key=value` (what follows `--device_groups` may be a JSON string), a bare `--key` (last, or before another
    option or a KEY=VALUE) is `key=true`, and `--key a b` is the list `key=[a, b]`. The CLI's own options stay as
    they are; every override moves to the end, in the order given, so options and overrides may interleave."""
    if not argv or argv[0] not in ("run", "config", "plan"):
        return argv
    head, overrides, i = [], [], 0
    while i < len(argv):
        item = argv[i]
        key, eq, value = item[2:].partition("=")
        if not item.startswith("--") or len(item) == 2 or f"--{key}" in OWN_OPTIONS:
            (overrides if "=" in item and not item.startswith("-") else head).append(item)
            if item in ("--plugin", "--with", "--config", "--from-ms-swift", "--log-level", "--output", "-o") \
                    and i + 1 < len(argv):  # values
                head.append(argv[i + 1])
                i += 1
        elif eq:
            overrides.append(f"{key}={value}")
        else:
            values = []
            while i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] != "-h" \
                    and not _OVERRIDE.match(argv[i + 1]):
                values.append(argv[i + 1])
                i += 1
            if not values:
                overrides.append(f"{key}=true")
            elif len(values) == 1:
                overrides.append(f"{key}={values[0]}")
            else:  # each value read as YAML, the list written as JSON (which YAML reads back)
                overrides.append(f"{key}={json.dumps([_yaml_value(v) for v in values], default=str)}")
        i += 1
    return head + overrides


def _yaml_value(text: str) -> Any:
    from .yaml_io import _Loader

    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def _keys_help(argv: list[str]) -> str:
    """What `run --help` says of the algorithm's keys: with `--plugin NAME`, each key with its default and
    meaning; without, how to see them."""
    how = ("The algorithm's keys (KEY=VALUE, --KEY VALUE, or in --config): `rlcore run --plugin NAME --help` lists "
           "them, `rlcore config show --plugin NAME` prints them as a commented YAML to start a --config from.")
    if argv[:1] != ["run"] or not {"-h", "--help"} & set(argv) or "--plugin" not in argv[:-1]:
        return how
    given = argv[argv.index("--plugin") + 1]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plugins, algorithm = _load(given)
        model, demo = plugins.config_model(algorithm), plugins.algorithms.get(algorithm).demo
        lines = _key_lines(load_translated(model, demo, _demo_steps(model), algorithm=algorithm)[0] if demo else model())
    except RlcoreError as exc:
        return f"{how}\n({given}: {exc})"
    values = (f"the values a bare `rlcore run --plugin {algorithm}` uses: its demo preset, which --config or a model "
              "replaces" if demo else "the defaults")
    return (f"Keys of algorithm '{algorithm}', with {values} (KEY=VALUE or --KEY VALUE; a bare --KEY is true, --KEY A B "
            f"a list; `rlcore config show --plugin {algorithm}` prints them as a commented YAML):\n" + "\n".join(lines))


def _key_lines(config: BaseModel, prefix: str = "") -> list[str]:
    lines = []
    for name, info in type(config).model_fields.items():
        value = getattr(config, name)
        if isinstance(value, BaseModel) and type(value).model_fields:
            lines.extend(_key_lines(value, f"{prefix}{name}."))
            continue
        shown = render_value(value)
        lines.append(f"  {prefix}{name} = {shown}" + (f"  {info.description}" if info.description else ""))
    return lines


def _parser(keys_help: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlcore",
        description="A plugin-based trainer framework for post-training language models.",
        epilog="Overrides are dotted key=value pairs parsed as YAML: lr=1e-6 train.gpus=8 "
        "colocate_groups=[[train,rollout]], or ms-swift's --key value. The command line wins over --config.",
    )
    parser.add_argument("--version", action="version", version=f"rlcore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run an algorithm", description="Run the algorithm a plugin provides.",
                              epilog=keys_help, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_plugin_and_config(run)
    run.add_argument("--use-ray", action="store_true", help="place roles on a Ray cluster (default: one process)")
    run.add_argument("--resume", action="store_true", help="continue the run in output_dir (sets resume=auto)")
    run.add_argument("--log-level", choices=LEVELS, help="stderr and output_dir/run.log: debug also shows third-party "
                     "progress bars and libraries' Python warnings, which run.log has at every level but error "
                     "(default: the config's log_level, info)")
    run.add_argument("--fit", action="store_true", help="where the memory plan will not fit, apply the first change "
                     "that fits (saved in output_dir/config.fit.yaml) instead of refusing")
    run.set_defaults(func=_run)

    plan = commands.add_parser("plan", help="predict each GPU's memory per phase; refuse a plan that will not fit",
                               description="Each GPU's predicted peak per phase of a step (generation, training, weight "
                               "sync), by component, from the plan and the models' config.json; nothing loads. Exit 2 "
                               "where it will not fit, with the changes that fit.")
    _add_plugin_and_config(plan)
    plan.add_argument("--fit", action="store_true", help="apply the first change that fits and print its plan")
    plan.add_argument("--use-ray", action="store_true", help=_AUTO_RAY)
    plan.add_argument("-o", "--output", metavar="FILE", help="with --fit: write the fitted config here (a new file)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_plan)

    listing = commands.add_parser("plugins", help="list installed plugins and what each provides")
    listing.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    listing.set_defaults(func=_plugins)

    plot = commands.add_parser("plot", help="draw a run's metrics as curves (a PNG)")
    plot.add_argument("metrics", metavar="RUN_DIR", help="a run's output_dir, or its metrics.jsonl")
    plot.add_argument("--keys", help="comma-separated metrics (default: the algorithm's panels, e.g. GRPO's reward, "
                      "kl, completion lengths, loss, grad_norm)")
    plot.add_argument("-o", "--output", metavar="PNG", help="where to write (default: beside the metrics)")
    plot.set_defaults(func=_plot)

    config = commands.add_parser("config", help="show or validate an algorithm's config")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the full config with comments (defaults + overrides)")
    _add_plugin_and_config(show)
    show.add_argument("--from-ms-swift", metavar="FILE", help="an ms-swift YAML: print the rlcore config it becomes, "
                      "with what each of its keys became above it")
    show.add_argument("--use-ray", action="store_true", help=_AUTO_RAY)
    show.set_defaults(func=_config_show)
    validate = config_commands.add_parser("validate", help="check a config file and overrides; exit 2 if invalid")
    _add_plugin_and_config(validate)
    validate.add_argument("--use-ray", action="store_true", help=_AUTO_RAY)
    validate.set_defaults(func=_config_validate)
    return parser


_AUTO_RAY = "resolve gpus: auto as `rlcore run --use-ray` does: the Ray cluster's GPUs (default: this machine's, one each)"


class _With(str):
    """A plugin given with --with: it joins the run and never selects the algorithm."""


def _add_plugin_and_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin", action="append", metavar="NAME",
        help="an installed plugin or algorithm name, a dotted module, or a path to a .py plugin file; "
        "several may be given, one of them providing the algorithm (default: the config's rlhf_type, as ms-swift's)",
    )
    parser.add_argument(
        "--with", dest="plugin", action="append", type=_With, metavar="PLUGIN",
        help="a module or .py file that joins the run without providing its algorithm (e.g. hooks only)",
    )
    parser.add_argument("--config", metavar="FILE", help="a YAML config file (default: the algorithm's demo preset, "
                        "unless a model is given)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.gpus=8")


def _load(given: str | list[str]) -> tuple[Plugins, str]:
    """Load every plugin plus the modules and files given (--plugin, --with, RLCORE_PLUGINS) and resolve
    the algorithm: exactly one --plugin provides it; the other plugins join the run."""
    given = [given] if isinstance(given, str) else list(given)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginLoadWarning)
        plugins = load_plugins(extra=tuple(p for p in given if is_file_or_module(p)))
    for warning in caught:
        if issubclass(warning.category, PluginLoadWarning):
            logger.warning(str(warning.message))
        else:  # what a plugin's import warned, as any other warning
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    for line in plugins.replaced:
        print(f"rlcore: {line}", file=sys.stderr)
    for spec in given:
        if isinstance(spec, _With) and plugin_name(spec) not in plugins.info:
            raise NotRegistered(
                f"--with {spec}: no plugin is called '{spec}'; give an installed plugin, a dotted module or a "
                f"path to a .py file.{did_you_mean(spec, plugins.info)}"
            )
    selecting = [p for p in given if not isinstance(p, _With)]
    provided = {p: _algorithm_of(plugins, p) for p in selecting}
    algorithms = sorted({a for a in provided.values() if a})
    if len(algorithms) == 1:
        return plugins, algorithms[0]
    if not algorithms:
        known = plugins.algorithms.names()
        each = "; ".join(f"{p} ({plugins.describe(plugin_name(p))})" for p in selecting)
        raise PluginError(
            f"no plugin given with --plugin provides an algorithm: {each}. Name the algorithm with --plugin "
            f"({', '.join(known) or 'none is installed'}) and add plugins without one with --with, e.g. "
            f"`rlcore run --plugin {known[0] if known else 'NAME'} --with {selecting[-1]}`"
        )
    each = "; ".join(f"{p} (algorithm '{a}')" for p, a in provided.items() if a)
    raise PluginError(
        f"exactly one plugin given with --plugin may provide the algorithm, but {len(algorithms)} do: {each}. "
        f"Keep one of them; add plugins without an algorithm with --with"
    )


def _algorithm_of(plugins: Plugins, spec: str) -> str | None:
    """The algorithm the plugin given as `spec` selects; None for a loaded plugin that provides none."""
    name = plugin_name(spec)
    if name in plugins.info and name not in plugins.algorithms and not plugins.algorithms.by_plugin(name):
        return None
    return plugins.algorithm_of(name)


def _configured(args: argparse.Namespace, resume: bool = False) -> tuple[Plugins, str, Any]:
    """The loaded plugins, the algorithm's name and its validated config, after `rlcore_configure`: what run,
    plan, `config show` and `config validate` all read, so that they agree.

    The algorithm comes from --plugin, else from the config's `rlhf_type` (ms-swift's); `use_ray: true` in
    the config means --use-ray. The algorithm's config model gains the keys plugins add (`rlcore_settings`),
    validated with its own. `resume` adds the override resume=auto, for algorithms whose config has a
    `resume` key. Given neither --config nor a model (`model=`, or TRL's or ms-swift's spelling of it), the
    config is the algorithm's demo preset (`AlgorithmSpec.demo`, e.g. examples/demo/grpo.yaml), the overrides on
    top (`args.preset` then names it).
    """
    if getattr(args, "from_ms_swift", None):
        if args.config:
            raise ConfigError("give the file once: --config FILE or --from-ms-swift FILE")
        args.config = args.from_ms_swift
    data = read_config_data(args.config, args.overrides)[0]
    log.redact(log.secrets_in_data(data))  # before validation: an error about a secret's value cannot show it
    kind, use_ray, problems = launch_options(data)
    if all(isinstance(p, _With) for p in args.plugin or ()):  # no --plugin: ms-swift's rlhf_type names it
        if kind is None:
            raise config_error(problems) if problems else ConfigError(
                "no algorithm given: name it with --plugin NAME, or set rlhf_type (grpo, gkd) in the config")
        args.plugin = [kind, *(args.plugin or ())]
    plugins, algorithm = _load(args.plugin)
    if kind is not None and kind != algorithm:
        raise ConfigError(f"the config's rlhf_type is '{kind}', but --plugin gives the algorithm '{algorithm}'; "
                          "drop one of them")
    if use_ray and hasattr(args, "use_ray"):
        args.use_ray = True
    spec = plugins.algorithms.get(algorithm)
    args.preset = None
    model = plugins.config_model(algorithm)
    if args.config is None and spec.demo and "model" not in translate(data, model).data:  # TRL's spelling too
        args.config, args.preset = spec.demo, algorithm
        logger.debug("no --config and no model: the %s demo preset %s", algorithm, spec.demo)
    overrides = (_demo_steps(model) if args.preset else []) + list(args.overrides)
    if resume:
        if "resume" not in model.model_fields:
            raise ConfigError(f"--resume: algorithm '{algorithm}' has no 'resume' key, so it cannot resume a run")
        overrides.append("resume=auto")
    config, args.translation = load_translated(model, args.config, overrides, algorithm=algorithm, source=_source(args))
    try:
        plugins.hook.rlcore_configure(config=config, algorithm=algorithm)
    except ValidationError as exc:  # a hook assigned a bad value
        raise config_error(validation_problems(exc, model, algorithm=algorithm), source="rlcore_configure") from None
    return plugins, algorithm, _resolved(args, plugins, algorithm, config)


def _resolved(args: argparse.Namespace, plugins: Plugins, algorithm: str, config: Any) -> Any:
    """`config` with its roles' `gpus: auto` resolved for this machine, or with --use-ray the cluster (one place for
    run, plan and config show/validate, so that they agree)."""
    roles = getattr(plugins.algorithms.get(algorithm).trainer, "roles", None)
    if roles is None:
        return config
    return resolve_gpus(config, roles, use_ray=bool(getattr(args, "use_ray", False)), source=_source(args))


DEMO_STEPS = "RLCORE_DEMO_MAX_STEPS"


def _demo_steps(model: type[BaseModel]) -> list[str]:
    """RLCORE_DEMO_MAX_STEPS=N: a demo preset runs N steps (a quick check of an install, or of the README's commands
    in CI); max_steps on the command line still wins. Said in the log, never silent."""
    given = os.environ.get(DEMO_STEPS, "")
    if not given or "max_steps" not in model.model_fields:
        return []
    if not given.isdigit() or int(given) < 1:
        raise ConfigError(f"{DEMO_STEPS}={given!r} is not a number of steps; give a whole number such as 2, or unset it")
    logger.info(f"{DEMO_STEPS}={given}: the demo preset runs {given} step{'' if given == '1' else 's'}")
    return [f"max_steps={given}"]


def _source(args: argparse.Namespace) -> str:
    """Where the config comes from, as errors name it: the user's file, or the command line over a demo preset
    (never the preset's path inside rlcore)."""
    if getattr(args, "preset", None):
        return f"the {args.preset} demo preset" + (" with the command line's keys" if args.overrides else "")
    return str(args.config) if args.config else "the command line"


@contextlib.contextmanager
def _paths_checked() -> Iterator[None]:
    """While a config is read and checked: a path the file system refuses (a name too long, a FIFO or a device
    where a file is expected, no permission) is a configuration mistake naming the path, exit 2."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise
        raise ConfigError(f"{exc.filename}: {exc.strerror or exc}; give a path to a readable file or folder "
                          f"of the right kind") from None


def _run(args: argparse.Namespace) -> int:
    log.hold()  # the notes and checks before the run takes its output_dir go to its run.log too
    if args.log_level:
        log.setup(args.log_level)  # the plugins and the config load at that level already
    with _paths_checked():
        plugins, algorithm, config = _configured(args, resume=args.resume)
        config = _demo_again(args, config)
        check_run(plugins, algorithm, config, use_ray=args.use_ray)
    log.setup(args.log_level or getattr(config, "log_level", "info"))
    config, fitted = _checked_memory(args, plugins, algorithm, config, fit=args.fit)
    log.redact(log.secrets_of(config))
    for line in args.translation.noted:  # "ms-swift's KEY: ...", "TRL's KEY: ..."
        logger.info(line)
    made = not Path(getattr(config, "output_dir", "output")).exists()
    try:
        trainer = plugins.algorithms.get(algorithm).trainer(config, plugins, use_ray=args.use_ray)
    except BaseException:  # a run refused while it was built leaves no tiny model in output_dir, nor a new output_dir
        remove_built_tiny_models(getattr(config, "output_dir", "output"), made_root=made)
        raise
    if fitted:  # the run's checks passed: its output_dir keeps the config it runs with
        from .memory import save_fitted

        save_fitted(config, fitted)
    metrics = trainer.fit()
    print(json.dumps({"algorithm": algorithm, **jsonable(metrics or {})}, default=str))
    return 0


def _demo_again(args: argparse.Namespace, config: Any) -> Any:
    """A demo run (the preset's output_dir, no --resume) where the demo's last run finished replaces that run, as
    a user running the demo again expects; an unfinished one is refused as any run is (it may be resumed)."""
    output_dir = getattr(config, "output_dir", None)
    if not args.preset or args.resume or output_dir is None or "overwrite_output_dir" not in type(config).model_fields \
            or any(o.split("=", 1)[0].strip() == "output_dir" for o in args.overrides):
        return config
    if not finished_run(output_dir) or foreign_checkpoints(output_dir):
        return config
    logger.info(f"output_dir '{output_dir}' holds the {args.preset} demo's finished run; this demo run replaces it "
                f"(give output_dir=DIR to keep it)")
    return config.model_copy(update={"overwrite_output_dir": True})


def _plot(args: argparse.Namespace) -> int:
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    print(plot_metrics(args.metrics, keys, args.output))
    return 0


def _plugins(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # failed plugins are listed below, with their error
        plugins = load_plugins()
    rows = [vars(info) for info in plugins.info.values()] + [vars(info) for info in plugins.failed.values()]
    for row in rows:  # installed, but what its engines or algorithms import is not
        row["missing"] = plugin_needs(row["name"]) or ""
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['name']} {row['version'] or '-'} (distribution: {row['distribution'] or '-'})")
        if row["error"]:
            print(f"  FAILED TO LOAD: {row['error']}")
        if row["missing"]:
            print(f"  NOT USABLE: {row['missing']}")
        for kind, names in row["provides"].items():
            print(f"  {kind}: {', '.join(names)}")
    return 0


def _config_show(args: argparse.Namespace) -> int:
    _, algorithm, config = _configured(args)
    if args.from_ms_swift:
        sys.stdout.write(_translation_comment(args.from_ms_swift, args.translation))
    if args.preset:  # on stderr: what stdout holds loads back as it is, with --config as without
        logger.info(f"the {algorithm} demo preset: what `rlcore run --plugin {algorithm}` uses without --config or a model")
    sys.stdout.write(log.scrub(render_config(config)))
    return 0


def _translation_comment(source: str, translation: Translation) -> str:
    """What each ms-swift key of `source` became, as YAML comments."""
    lines = [f"# from ms-swift's {source}:"] + [f"#   {line}" for line in translation.mapped or ["(no ms-swift key)"]]
    if translation.noted:
        lines += ["# noted, nothing for rlcore to do:"] + [f"#   {line}" for line in translation.noted]
    return "\n".join(lines) + "\n"


def _config_validate(args: argparse.Namespace) -> int:
    with _paths_checked():
        plugins, algorithm, config = _configured(args)
        log.setup(getattr(config, "log_level", "info"))  # third-party progress bars off, as in a run
        check_run(plugins, algorithm, config, engines=False)  # the algorithm's own checks need its library
        check_output_dir(getattr(config, "output_dir", "output"))  # as run checks it (a file, read-only)
        check_resume_path(getattr(config, "resume", None))  # a checkpoint folder it names
        check = getattr(plugins.algorithms.get(algorithm).trainer, "check", None)
        if check is not None:  # the plan, names, data, model: what run checks before it allocates
            check(config, plugins)
    for line in args.translation.noted:  # a foreign key rlcore needs nothing for, one line each, as `run` says
        logger.info(line)
    _checked_memory(args, plugins, algorithm, config)
    print(f"{_source(args)}: valid for algorithm '{algorithm}'")
    return 0


# -- the memory plan ----------------------------------------------------------------------------------------------


def _refit(args: argparse.Namespace, plugins: Plugins, algorithm: str, changes: dict[str, Any]) -> Any:
    """The config with `changes` (dotted keys) over the command line's overrides."""
    from .memory import Suggestion

    model = plugins.config_model(algorithm)
    overrides = list(args.overrides) + (["resume=auto"] if getattr(args, "resume", False) else [])
    changed = overrides + Suggestion(changes, 0, True).overrides()
    return _resolved(args, plugins, algorithm,
                     load_translated(model, args.config, changed, algorithm=algorithm, source=_source(args))[0])


def _fitting(args: argparse.Namespace, plugins: Plugins, algorithm: str, config: Any) -> tuple[Any, Any, list[Any]]:
    """(the plan, the roles' uses, the suggestions where it will not fit)."""
    from .memory import plan_of, suggestions

    plan, uses = plan_of(plugins, algorithm, config)
    if plan is None or plan.fits:
        return plan, uses, []

    def replan(changes: dict[str, Any]) -> Any:
        try:
            new, _ = plan_of(plugins, algorithm, _refit(args, plugins, algorithm, changes))
        except ConfigError:  # the change breaks one of the algorithm's rules (a batch no longer divisible)
            return None
        return new

    return plan, uses, suggestions(config, plan, uses, replan)


def _checked_memory(args: argparse.Namespace, plugins: Plugins, algorithm: str, config: Any,
                    fit: bool = False) -> tuple[Any, list[str]]:
    """The memory plan's table in the log; a plan that will not fit refused (a ConfigError naming the changes that
    fit), or with `fit` the config with the first of them. Returns the config and the overrides `fit` applied."""
    from .memory import refusal

    plan, _, found = _fitting(args, plugins, algorithm, config)
    if plan is None:
        return config, []
    for line in plan.table().splitlines():
        logger.info(line)
    if plan.fits and not plan.known:  # a hub model not downloaded yet: the run goes on, unchecked, and says so
        logger.warning(f"{plan.unknown_reason()}; the run goes on without the check")
    if plan.fits:
        return config, []
    fitting = [s for s in found if s.fits]
    if fit and fitting:
        fixed = _refit(args, plugins, algorithm, fitting[0].changes)
        logger.warning(f"--fit: {' '.join(fitting[0].overrides())} (predicted peak {fitting[0].peak / (1 << 30):.1f} GiB)")
        return fixed, fitting[0].overrides()
    if not getattr(config, "memory_check", True):
        logger.warning(refusal(plan, found) + "\n(memory_check: false, so the run goes on)")
        return config, []
    raise ConfigError(refusal(plan, found))


def _plan(args: argparse.Namespace) -> int:
    from .memory import plan_of, refusal, save_fitted

    with _paths_checked():
        plugins, algorithm, config = _configured(args)
        log.setup(getattr(config, "log_level", "info"))  # third-party progress bars off, as in validate
        checked = getattr(plugins.algorithms.get(algorithm).trainer, "checked", None)
        if checked is not None:  # what validate refuses in the config itself; the models may not be downloaded yet
            checked(config, plugins, own=False, models=False)
    plan, _, found = _fitting(args, plugins, algorithm, config)
    if plan is None:
        why = ("the demo's tiny model runs on the CPU; name a model and GPUs (e.g. model=NAME train.gpus=1) to plan "
               "a run" if is_tiny(getattr(config, "model", None)) else
               "no model named, no role on a GPU, or an algorithm that describes no memory use")
        print(f"{algorithm}: nothing to plan: {why}")
        return 0
    print(json.dumps(plan.as_json(), indent=1) if args.json else plan.table())
    if plan.fits and not plan.known:  # no false "ok": what the plan cannot size may not fit
        reason = plan.unknown_reason()
        fix = ("download each hub model's config.json first (`hf download NAME config.json`; nothing else is read) or "
               "name a local model directory" if "config.json" in reason else
               "only a run can tell (`rlcore run` goes on without the check, saying so)")
        raise ConfigError(f"{reason}. To plan it, {fix}")
    if plan.fits:
        return 0
    fitting = [s for s in found if s.fits]
    if not (args.fit and fitting):
        raise ConfigError(refusal(plan, found))
    changes = fitting[0].overrides()
    print(f"--fit: {' '.join(changes)}")
    fixed = _refit(args, plugins, algorithm, fitting[0].changes)
    new, _ = plan_of(plugins, algorithm, fixed)
    print(json.dumps(new.as_json(), indent=1) if args.json else new.table())
    if args.output:
        save_fitted(fixed, changes, args.output)
    return 0
