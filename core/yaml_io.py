"""YAML in and out for configs: a safe loader with rlcore's limits (a file's values, integer digits, keys given twice,
YAML 1.2 floats such as `1e-6`), and `config show`'s rendering, a commented YAML that loads back to the same values."""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr

MAX_CONFIG_BYTES = 4 << 20  # a config file's size at most: far above any config, far below a memory problem
MAX_CONFIG_VALUES = 100_000  # values a config holds at most once its aliases are expanded (a billion laughs: 10**9)


class _Loader(yaml.SafeLoader):
    """Safe YAML that also reads `1e-6` as a float (YAML 1.2), as people write learning rates, refuses a
    key given twice in one mapping (PyYAML keeps the last one silently), naming both lines, and refuses a document
    whose aliases expand to more than MAX_CONFIG_VALUES values before building any of it."""

    def construct_yaml_int(self, node: Any) -> Any:
        """An integer of at most 40 digits (beyond 64 bits already; Python refuses to read 4300 and up)."""
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > 40:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits} digits; rlcore reads integers of up to 40 digits (a key's range "
                "is far smaller)", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_document(self, node: Any) -> Any:
        count = _expanded_size(node, {})
        if count > MAX_CONFIG_VALUES:
            raise yaml.constructor.ConstructorError(
                None, None, f"its aliases (*name) expand to {_at_least(count)} values, over rlcore's limit of "
                f"{MAX_CONFIG_VALUES:,}; write the values out, or use fewer nested aliases", node.start_mark)
        return super().construct_document(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' is given twice, on line {first.start_mark.line + 1} and line "
                        f"{key_node.start_mark.line + 1}; keep one", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _expanded_size(node: Any, sizes: dict[int, int]) -> int:
    """How many values `node` holds with every alias expanded, counted over the composed graph (an alias is the
    node it names, shared), so a billion laughs costs its few hundred nodes, not 10**9; stops counting past the
    limit."""
    if id(node) in sizes:
        return sizes[id(node)]
    size = 1
    children = node.value if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)) else ()
    for child in children:
        for part in child if isinstance(child, tuple) else (child,):
            size += _expanded_size(part, sizes)
            if size > MAX_CONFIG_VALUES:
                break
        if size > MAX_CONFIG_VALUES:
            break
    sizes[id(node)] = size
    return size


def _at_least(count: int) -> str:
    return f"more than {MAX_CONFIG_VALUES:,}" if count > MAX_CONFIG_VALUES else f"{count:,}"


class _Dumper(yaml.SafeDumper):
    """Safe YAML that quotes strings `_Loader` would read as floats, so rendering round-trips."""


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789"))


# -------------------------------------------------------------------------
# rendering: `rlcore config show`, a commented YAML that loads back to the same values
# -------------------------------------------------------------------------


def render_config(config: BaseModel | type[BaseModel]) -> str:
    """The full config as YAML with each key's description as a comment; loading it gives it back."""
    instance = config if isinstance(config, BaseModel) else config()
    doc = (type(instance).__doc__ or "").strip().splitlines()
    header = f"# {type(instance).__name__}: {doc[0]}\n" if doc else ""
    return header + "\n".join(_render_section(instance, indent=0)) + "\n"


def _render_section(instance: BaseModel, indent: int) -> list[str]:
    pad = " " * indent
    lines = []
    for name, info in type(instance).model_fields.items():
        value = getattr(instance, name)
        if info.description:
            lines.append(f"{pad}# {info.description}")
        if isinstance(value, BaseModel) and type(value).model_fields:
            lines.append(f"{pad}{name}:")
            lines.extend(_render_section(value, indent + 2))
        else:
            dumped = value.model_dump(mode="json") if isinstance(value, BaseModel) else _plain(value)
            lines.append(f"{pad}{name}: {_flow(dumped)}")
    return lines


def render_value(value: Any) -> str:
    """One value as `config show` writes it (one line of YAML)."""
    return _flow(_plain(value))


def _plain(value: Any) -> Any:
    """Nested models inside lists/dicts become plain data YAML can write; a secret is shown as '**********'."""
    if isinstance(value, SecretStr):
        return str(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _flow(value: Any) -> str:
    """One value as single-line YAML (strings quoted where needed)."""
    return yaml.dump([value], Dumper=_Dumper, default_flow_style=True, width=2**31, sort_keys=False).strip()[1:-1]
