"""Plugin loading: entry-point distributions, broken ones, disabled ones, .py files, clashes, unknown names."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

import rlcore
from rlcore import (
    AlgorithmSpec,
    CollectorSpec,
    DispatcherSpec,
    EngineSpec,
    NotRegistered,
    PlacementSpec,
    PluginError,
    Plugins,
    RewardSpec,
    RoleSpec,
    RunConfig,
    Trainer,
    hookimpl,
)
from rlcore.manager import PluginLoadWarning

BROKEN = "raise RuntimeError('boom: this plugin is broken')\n"
MAX_COLLECTOR = "from rlcore import CollectorSpec, hookimpl\n\n@hookimpl\ndef rlcore_collectors():\n" \
                "    yield CollectorSpec('max', collect=max)\n"

# A plugin file that changes one behaviour of the installed example algorithm by subclassing it.
STEEP = textwrap.dedent(
    """
    from rlcore import AlgorithmSpec, hookimpl
    from rlcore_example.trainer import LineFitConfig, LineFitTrainer

    class SteepTrainer(LineFitTrainer):
        def make_data(self):
            xs, ys = super().make_data()
            return xs, [y + 3.0 * x for x, y in zip(xs, ys)]  # the line is 3 steeper

    @hookimpl
    def rlcore_algorithms():
        yield AlgorithmSpec("steep", config=LineFitConfig, trainer=SteepTrainer)
    """
)


class EveryHook:
    """A plugin implementing every registration hook once."""

    @hookimpl
    def rlcore_roles(self):
        yield RoleSpec("critic", description="a value model")

    @hookimpl
    def rlcore_dispatchers(self):
        yield DispatcherSpec("first_only", split=lambda n, args, kwargs, mesh: [(args, kwargs)] + [None] * (n - 1))

    @hookimpl
    def rlcore_collectors(self):
        yield CollectorSpec("max", collect=max)

    @hookimpl
    def rlcore_placements(self):
        yield PlacementSpec("first_gpu", place=lambda request: {role: [0] * n for role, n in request.roles.items()})

    @hookimpl
    def rlcore_algorithms(self):
        yield AlgorithmSpec("noop", config=RunConfig, trainer=Trainer)

    @hookimpl
    def rlcore_engines(self):
        yield EngineSpec("echo", kind="rollout", factory=dict)

    @hookimpl
    def rlcore_rewards(self):
        yield RewardSpec("length", fn=lambda prompts, completions, **kw: [float(len(c)) for c in completions])


def test_every_registration_hook_fills_its_registry():
    plugins = Plugins()
    plugins.register(EveryHook(), "every", "1.0", "every-dist")
    provides = dict(plugins.info["every"].provides)
    assert [key.rsplit("/", 1)[-1] for key in provides.pop("engines")] == ["echo"]  # engines may be keyed kind/name
    assert provides == {
        "roles": ["critic"], "dispatchers": ["first_only"], "collectors": ["max"], "placements": ["first_gpu"],
        "algorithms": ["noop"], "rewards": ["length"],
    }
    assert plugins.collectors.get("max").collect([1, 5, 2]) == 5
    assert plugins.rewards.get("length").fn(["p"], ["abc", ""]) == [3.0, 0.0]
    assert plugins.algorithm_of("every") == "noop"


def test_the_example_distribution_is_discovered(example_plugin):
    plugins = rlcore.load_plugins()
    info = plugins.info["example"]
    assert (info.distribution, info.version) == ("rlcore-example-plugin", example_plugin.version)
    assert info.provides == {
        "roles": ["scorer"], "dispatchers": ["reverse_slice"], "collectors": ["sum"], "placements": ["reverse"],
        "algorithms": ["example"], "rewards": ["letter_ratio"], "engines": ["rollout/echo"],
    }
    assert "builtins" in plugins.info  # built-ins come through the same entry-point group


def test_the_example_is_listed_and_runs_through_the_cli(rlcore_cli, tmp_path):
    listed = json.loads(rlcore_cli("plugins", "--json").stdout)
    example = next(p for p in listed if p["name"] == "example")
    assert example["distribution"] == "rlcore-example-plugin" and example["provides"]["algorithms"] == ["example"]
    done = rlcore_cli("run", "--plugin", "example", "steps=60", "lr=0.3", "output_dir=out")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["algorithm"] == "example" and summary["w"] == pytest.approx(2.0, abs=0.1)
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 60


def test_a_plugin_file_subclassing_the_example_changes_its_behaviour(rlcore_cli, tmp_path):
    (tmp_path / "steep.py").write_text(STEEP)
    done = rlcore_cli("run", "--plugin", "./steep.py", "steps=60", "lr=0.3", "output_dir=steep")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["algorithm"] == "steep" and summary["w"] == pytest.approx(5.0, abs=0.15)


def test_a_broken_distribution_is_skipped_with_a_warning(example_plugin, make_distribution, monkeypatch):
    site = make_distribution("rlcore-broken-plugin", "broken", "rlcore_broken", BROKEN)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("RLCORE_STRICT_PLUGINS", raising=False)
    with pytest.warns(PluginLoadWarning, match=r"plugin 'broken' \(distribution rlcore-broken-plugin\).*boom"):
        plugins = rlcore.load_plugins()
    assert "example" in plugins.info and "broken" not in plugins.info
    failed = plugins.failed["broken"]
    assert (failed.distribution, failed.version) == ("rlcore-broken-plugin", "0.3.0")
    assert failed.error == "RuntimeError: boom: this plugin is broken"


def test_a_broken_distribution_is_fatal_when_strict(make_distribution, monkeypatch):
    monkeypatch.syspath_prepend(str(make_distribution("rlcore-broken-plugin", "broken", "rlcore_broken", BROKEN)))
    monkeypatch.setenv("RLCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="plugin 'broken' .*boom.*RLCORE_STRICT_PLUGINS is set"):
        rlcore.load_plugins()


def test_the_cli_lists_a_broken_distribution_and_refuses_it_when_strict(rlcore_cli, make_distribution):
    site = make_distribution("rlcore-broken-plugin", "broken", "rlcore_broken", BROKEN)
    listed = rlcore_cli("plugins", "--json", env={"PYTHONPATH": str(site)})
    assert listed.returncode == 0, listed.stderr
    broken = next(p for p in json.loads(listed.stdout) if p["name"] == "broken")
    assert broken["error"].startswith("RuntimeError: boom") and broken["provides"] == {}
    strict = rlcore_cli("plugins", env={"PYTHONPATH": str(site), "RLCORE_STRICT_PLUGINS": "1"})
    assert strict.returncode == 2 and "boom" in strict.stderr and "Traceback" not in strict.stderr


def test_disabled_plugins_are_not_loaded(example_plugin, monkeypatch):
    monkeypatch.setenv("RLCORE_DISABLE_PLUGINS", " example ,nothing")
    plugins = rlcore.load_plugins()
    assert "example" not in plugins.info and "builtins" in plugins.info
    with pytest.raises(NotRegistered, match="no plugin or algorithm is called 'example'"):
        plugins.algorithm_of("example")


def test_a_clashing_plugin_names_both_and_is_left_out_entirely():
    plugins = Plugins()
    plugins.register(EveryHook(), "every")

    class Clash:
        @hookimpl
        def rlcore_roles(self):
            yield RoleSpec("judge")

        @hookimpl
        def rlcore_collectors(self):
            yield CollectorSpec("max", collect=min)

    with pytest.raises(PluginError, match="collect 'max' is registered twice: by plugin 'every' and by plugin 'clash'"):
        plugins.register(Clash(), "clash")
    assert "judge" not in plugins.roles and not plugins.manager.has_plugin("clash")
    assert plugins.collectors.get("max").collect([1, 2]) == 2


def test_a_plugin_file_given_for_the_run_replaces_an_installed_algorithm(example_plugin, tmp_path):
    (tmp_path / "mine.py").write_text(STEEP.replace('"steep"', '"example"'))
    plugins = rlcore.load_plugins(extra=(str(tmp_path / "mine.py"),))
    assert plugins.algorithms.get("example").trainer.__name__ == "SteepTrainer"
    assert plugins.algorithms.owner("example") == "mine" and plugins.algorithm_of("mine") == "example"
    assert plugins.replaced == [
        f"algorithm 'example' from {tmp_path / 'mine.py'} (SteepTrainer) replaces the one of plugin 'example' "
        "(rlcore-example-plugin) for this run"
    ]
    assert "algorithms" not in plugins.info["example"].provides
    assert plugins.info["mine"].provides == {"algorithms": ["example"]}
    assert plugins.dispatchers.owner("reverse_slice") == "example"  # the rest of the installed plugin stays
    (tmp_path / "also.py").write_text(STEEP.replace('"steep"', '"example"'))
    with pytest.raises(PluginError, match=r"algorithm 'example' is registered twice: by plugin 'mine' \(.*mine.py\) "
                       r"and by plugin 'also' \(.*also.py\), both given for this run; give one of them"):
        rlcore.load_plugins(extra=(str(tmp_path / "mine.py"), str(tmp_path / "also.py")))  # two given: a clash


def test_two_installed_distributions_sharing_a_name_are_an_error_naming_both(make_distribution, monkeypatch):
    make_distribution("rlcore-max-one", "maxone", "rlcore_max_one", MAX_COLLECTOR)
    site = make_distribution("rlcore-max-two", "maxtwo", "rlcore_max_two", MAX_COLLECTOR)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("RLCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="collect 'max' is registered twice: by plugin 'maxone' and by plugin 'maxtwo'. "
                       "Rename one of them, or disable one plugin"):
        rlcore.load_plugins()


def test_rlcore_plugins_are_loaded_for_every_run_and_handed_to_workers(tmp_path, monkeypatch):
    from rlcore import manager

    (tmp_path / "hooks.py").write_text("from rlcore import hookimpl\n\n@hookimpl\ndef rlcore_train_end(trainer):\n    pass\n")
    (tmp_path / "max_collector.py").write_text(MAX_COLLECTOR)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(manager.EXTRA_PLUGINS_ENV, raising=False)
    monkeypatch.setenv("RLCORE_PLUGINS", os.pathsep.join(["hooks.py", "", "./hooks.py"]))
    plugins = rlcore.load_plugins(extra=("max_collector.py", str(tmp_path / "hooks.py")))
    assert plugins.extra == (str(tmp_path / "hooks.py"), str(tmp_path / "max_collector.py"))  # absolute, each once
    assert plugins.describe("hooks") == "hooks: rlcore_train_end"
    assert plugins.describe("max_collector") == "collectors: max"
    # a worker process takes its driver's list (which holds RLCORE_PLUGINS) and not RLCORE_PLUGINS itself
    monkeypatch.setenv(manager.EXTRA_PLUGINS_ENV, str(tmp_path / "max_collector.py"))
    monkeypatch.chdir(tmp_path.parent)
    manager.use_plugins(None)
    try:
        loaded = manager.plugins()
        assert loaded.extra == (str(tmp_path / "max_collector.py"),) and "hooks" not in loaded.info
    finally:
        manager.use_plugins(None)


def test_registered_config_keys_are_checked_after_the_configure_hooks():
    from typing import Annotated

    from pydantic import Field

    from rlcore import BaseConfig, ConfigError, Registered

    class Section(BaseConfig):
        collect: Annotated[str, Registered("collectors")] = "max"

    class Config(RunConfig):
        dispatch: Annotated[str, Registered("dispatchers")] = Field("first_only", description="a dispatcher")
        rewards: Annotated[list[str], Registered("rewards")] = ["length"]
        scoring: Section = Section()

    class Fixer:
        @hookimpl
        def rlcore_configure(self, config):
            if config.dispatch == "fix_me":
                config.dispatch = "first_only"

    plugins = Plugins()
    plugins.register(EveryHook(), "every")
    plugins.register(Fixer(), "fixer")
    plugins.hook.rlcore_configure(config=Config(dispatch="fix_me"), algorithm="noop")  # fixed by a plugin first
    bad = Config(dispatch="first_onyl", rewards=["length", "lenght"], scoring=Section(collect="mx"))
    with pytest.raises(ConfigError) as excinfo:
        plugins.hook.rlcore_configure(config=bad, algorithm="noop")
    assert [key for key, _ in excinfo.value.problems] == ["dispatch", "rewards", "scoring.collect"]
    message = str(excinfo.value)
    assert "dispatch 'first_onyl' is not registered; known: first_only. Did you mean 'first_only'?" in message
    assert "reward 'lenght' is not registered" in message
    with pytest.raises(PluginError, match=r"Registered\('dispatcher'\): no such registry; use one of roles, dispatch"):
        Registered("dispatcher")


def test_a_failing_registration_hook_is_reported_under_the_plugin_name():
    class Buggy:
        @hookimpl
        def rlcore_rewards(self):
            raise ZeroDivisionError("oops")

    with pytest.raises(PluginError, match=r"plugin 'buggy' failed in rlcore_rewards\(\): ZeroDivisionError"):
        Plugins().register(Buggy(), "buggy")


def test_unknown_names_list_the_known_ones(example_plugin, tmp_path):
    plugins = rlcore.load_plugins()
    with pytest.raises(NotRegistered) as excinfo:
        plugins.algorithm_of("exmaple")
    assert "known: " in str(excinfo.value) and "example" in str(excinfo.value)
    assert "Did you mean 'example'?" in str(excinfo.value)
    with pytest.raises(PluginError, match="plugin 'builtins' provides no algorithm; plugins with one: .*example"):
        plugins.algorithm_of("builtins")
    with pytest.raises(PluginError, match="plugin file '.*nowhere.py' does not exist"):
        rlcore.load_plugins(extra=(str(tmp_path / "nowhere.py"),))
    with pytest.raises(PluginError, match="plugin module 'no_such.module' cannot be imported"):
        rlcore.load_plugins(extra=("no_such.module",))


def test_the_process_plugins_load_once_follow_use_plugins_and_take_extra_plugins_from_the_env(tmp_path, monkeypatch):
    from rlcore import manager

    path = tmp_path / "extra_roles.py"
    path.write_text("from rlcore import RoleSpec, hookimpl\n\n@hookimpl\ndef rlcore_roles():\n    yield RoleSpec('critic')\n")
    monkeypatch.setenv(manager.EXTRA_PLUGINS_ENV, f"{path}{os.pathsep}")
    assert manager.extra_plugins_from_env() == (str(path),)
    mine = Plugins()
    manager.use_plugins(mine)
    try:
        assert manager.plugins() is mine
        manager.use_plugins(None)  # reload on next use, with the environment's extra plugins
        loaded = manager.plugins()
        assert loaded is manager.plugins() and loaded.roles.owner("critic") == "extra_roles"
        assert loaded.extra == (str(path),)
    finally:
        manager.use_plugins(None)
