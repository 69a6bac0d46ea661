"""Registries: names to descriptors, remembering the plugin that gave each; clear errors both ways."""

from __future__ import annotations

import pytest

import rlcore
from rlcore import CollectorSpec, DispatcherSpec, NotRegistered, PluginError, Registry


def split_all(n, args, kwargs, mesh):
    return [(args, kwargs)] * n


def test_add_get_and_owner():
    registry: Registry[DispatcherSpec] = Registry("dispatch")
    spec = DispatcherSpec("all", split=split_all)
    registry.add(spec, "builtins")
    assert registry.get("all") is spec
    assert registry.owner("all") == "builtins"
    assert "all" in registry and "slice" not in registry
    assert registry.names() == ["all"] and list(registry) == [spec] and len(registry) == 1
    assert registry.by_plugin("builtins") == ["all"] and registry.by_plugin("other") == []


def test_a_duplicate_name_names_both_plugins():
    registry: Registry[CollectorSpec] = Registry("collect")
    registry.add(CollectorSpec("sum", collect=sum), "example")
    with pytest.raises(PluginError) as excinfo:
        registry.add(CollectorSpec("sum", collect=max), "mine")
    message = str(excinfo.value)
    assert "collect 'sum' is registered twice: by plugin 'example' and by plugin 'mine'" in message
    assert "RLCORE_DISABLE_PLUGINS=mine" in message
    assert registry.get("sum").collect is sum


def test_an_unknown_name_lists_the_known_ones_and_the_closest():
    registry: Registry[DispatcherSpec] = Registry("dispatch")
    for name in ("slice", "all", "dp"):
        registry.add(DispatcherSpec(name, split=split_all), "builtins")
    with pytest.raises(NotRegistered) as excinfo:
        registry.get("slcie")
    assert str(excinfo.value) == "dispatch 'slcie' is not registered; known: all, dp, slice. Did you mean 'slice'?"
    assert isinstance(excinfo.value, KeyError) and isinstance(excinfo.value, PluginError)
    with pytest.raises(NotRegistered, match=r"known: all, dp, slice\.$"):
        registry.get("zzz")


def test_a_nameless_item_is_refused():
    with pytest.raises(PluginError, match="plugin 'bad' yielded a dispatch without a name"):
        Registry("dispatch").add(DispatcherSpec("", split=split_all), "bad")


def test_the_installed_example_plugin_fills_the_registries(example_plugin):
    plugins = rlcore.load_plugins()
    for registry, name in [
        (plugins.dispatchers, "reverse_slice"),
        (plugins.collectors, "sum"),
        (plugins.placements, "reverse"),
        (plugins.algorithms, "example"),
    ]:
        assert registry.owner(name) == "example"
    assert plugins.collectors.get("sum").collect([1, 2, None, 3]) == 6
    with pytest.raises(NotRegistered, match="Did you mean 'reverse_slice'"):
        plugins.dispatchers.get("reverse_slcie")
