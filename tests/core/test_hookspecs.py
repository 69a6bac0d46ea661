"""Meta-test in the style of datasette's: every hook has a test and a documented section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import AliasChoices, Field

from rlcore import BaseConfig, ConfigError, PluginError, Plugins, RunConfig, SettingSpec, hookimpl, hookspecs
from rlcore import load_config, render_config
from rlcore.config import with_settings

ROOT = Path(__file__).resolve().parents[2]
HOOKS = sorted(name for name in vars(hookspecs) if name.startswith("rlcore_"))


def test_the_hooks_are_found():
    assert {"rlcore_roles", "rlcore_algorithms", "rlcore_configure", "rlcore_step_end"} <= set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_implemented_or_called_by_a_test(hook):
    pattern = re.compile(rf"def {hook}\(|hook\.{hook}\(")
    users = [
        path.relative_to(ROOT)
        for path in (ROOT / "tests").rglob("*.py")
        if path.name != "test_hookspecs.py" and pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert users, f"no test under tests/ implements `def {hook}(` or calls `hook.{hook}(`"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_documented_section(hook):
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    heading = re.compile(rf"^#+ .*\b{hook}\b|<a (name|id)=\"{hook}\">", re.MULTILINE)
    assert any(
        heading.search(doc.read_text(encoding="utf-8")) for doc in documents if doc.exists()
    ), f"README.md or docs/*.md needs a section whose heading (or anchor) names {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hookspec_has_a_docstring_with_an_example(hook):
    doc = getattr(hookspecs, hook).__doc__ or ""
    assert "@hookimpl" in doc and f"def {hook}(" in doc


# -------------------------------------------------------------------------
# rlcore_settings: config keys of a plugin's own, validated with the algorithm's
# -------------------------------------------------------------------------


class Notify(BaseConfig):
    """Where a run posts its progress."""

    url: str = Field("http://localhost:8000", description="endpoint")
    retries: int = Field(3, ge=0, description="attempts per post")


class NotifyPlugin:
    @hookimpl
    def rlcore_settings(self):
        yield SettingSpec("notify", Notify, default=Notify(), description="a section of keys")
        yield SettingSpec("notify_every", int, default=10, description="post every N steps")


class AliasedConfig(RunConfig):
    """An algorithm whose key has an alias."""

    cap: float = Field(2.0, validation_alias=AliasChoices("cap", "vllm_cap"))


def settings_of(*plugins: tuple[str, object]) -> Plugins:
    loaded = Plugins()
    for name, plugin in plugins:
        loaded.register(plugin, name)
    return loaded


def test_settings_join_an_algorithms_config_and_validate_with_its_keys(tmp_path):
    plugins = settings_of(("notify", NotifyPlugin()))
    assert plugins.info["notify"].provides["settings"] == ["notify", "notify_every"]
    model = with_settings(RunConfig, plugins.settings, "example")
    assert (model.__name__, model.__doc__, issubclass(model, RunConfig)) == ("RunConfig", RunConfig.__doc__, True)
    config = load_config(model, None, ["notify.retries=5", "seed=1"])
    assert (config.notify.retries, config.notify_every, config.seed) == (5, 10, 1)
    with pytest.raises(ConfigError) as raised:
        load_config(model, None, ["notify.retires=5", "notify_evry=2", "notify_every=-"])
    assert sorted(key for key, _ in raised.value.problems) == ["notify.retires", "notify_every", "notify_evry"]
    assert "Did you mean 'retries'?" in str(raised.value) and "Did you mean 'notify_every'?" in str(raised.value)
    rendered = render_config(config)
    assert "# post every N steps\nnotify_every: 10\n" in rendered
    section = "# a section of keys\nnotify:\n  # endpoint\n  url: 'http://localhost:8000'\n  # attempts per post\n"
    assert section + "  retries: 5\n" in rendered
    (tmp_path / "shown.yaml").write_text(rendered)
    assert load_config(model, tmp_path / "shown.yaml") == config


def test_no_settings_leave_the_model_as_it_is():
    assert with_settings(RunConfig, Plugins().settings) is RunConfig


@pytest.mark.parametrize("name", ["seed", "vllm_cap"])
def test_a_setting_named_like_an_algorithm_key_is_an_error_naming_both(name):
    class Clashing:
        @hookimpl
        def rlcore_settings(self):
            yield SettingSpec(name, float, default=0.0)

    plugins = settings_of(("clashing", Clashing()))
    clash = (rf"plugin 'clashing' adds the setting '{name}', but algorithm 'capped' \(AliasedConfig\) already has "
             rf"a key '{name}': rename the setting, or leave the plugin out with RLCORE_DISABLE_PLUGINS=clashing")
    with pytest.raises(PluginError, match=clash):
        with_settings(AliasedConfig, plugins.settings, "capped")


def test_a_setting_registered_twice_names_both_plugins():
    with pytest.raises(PluginError, match="setting 'notify' is registered twice: by plugin 'one' and by plugin 'two'"):
        settings_of(("one", NotifyPlugin()), ("two", NotifyPlugin()))


def test_a_settings_default_must_fit_its_type():
    class Wrong:
        @hookimpl
        def rlcore_settings(self):
            yield SettingSpec("retries", int, default="three")

    with pytest.raises(PluginError, match=r"plugin 'wrong' failed in rlcore_settings\(\): .*setting 'retries': "
                                          r"default 'three' is not valid: Input should be a valid integer"):
        settings_of(("wrong", Wrong()))
