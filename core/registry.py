"""Registries: name -> descriptor maps that remember which plugin gave each name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from .errors import NotRegistered, PluginError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Descriptors of one kind (`kind` is the word used in messages: "dispatch", "role", ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._owners: dict[str, str] = {}

    def add(self, item: T, plugin: str) -> None:
        """Register `item` under `item.name`; a name given twice is an error naming both plugins."""
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin '{plugin}' yielded a {self.kind} without a name: {item!r}")
        name = self.key_of(item)
        if name in self._items:
            raise PluginError(
                f"{self.kind} '{name}' is registered twice: by plugin '{self._owners[name]}' and by "
                f"plugin '{plugin}'. Rename one of them, or disable one plugin with "
                f"RLCORE_DISABLE_PLUGINS={plugin}."
            )
        self._items[name] = item
        self._owners[name] = plugin

    def key_of(self, item: T) -> str:
        """The name `item` is registered under."""
        return item.name  # type: ignore[attr-defined]

    def get(self, name: str) -> T:
        """The descriptor called `name`; an unknown name lists the known ones and the closest match."""
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise NotRegistered(
                f"{self.kind} '{name}' is not registered; known: {known}.{did_you_mean(name, self._items)}"
            ) from None

    def owner(self, name: str) -> str:
        """The plugin that registered `name`."""
        self.get(name)
        return self._owners[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def by_plugin(self, plugin: str) -> list[str]:
        return sorted(n for n, p in self._owners.items() if p == plugin)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)


class EngineRegistry(Registry[T]):
    """Engines, registered per kind as "kind/name": a plugin may give a train and a rollout engine one name."""

    def key_of(self, item: T) -> str:
        return f"{item.kind}/{item.name}"  # type: ignore[attr-defined]

    def get(self, name: str, kind: str | None = None) -> T:
        """`get("hf", kind="rollout")` or `get("rollout/hf")`; an unknown one lists the known ones."""
        return super().get(f"{kind}/{name}" if kind else name)
