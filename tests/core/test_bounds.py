"""Every numeric key of every installed algorithm's config (as a run composes it: the plugins' settings and the
engines' keys in) declares both ends of its range, and a value past either end is refused where the config is
read, naming the key; what Ray, numpy or an allocation would have refused later never gets that far."""

from __future__ import annotations

from collections.abc import Iterator
from types import UnionType
from typing import Any, Union, get_args, get_origin

import annotated_types as at
import pytest
from pydantic import BaseModel, ValidationError

from rlcore.manager import load_plugins


def _unwrap(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def numeric_keys(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path, FieldInfo) of every int or float key of `model`, its sections' too (a Literal of numbers is a set of
    values, not a range: not walked)."""
    for name, info in model.model_fields.items():
        kind = _unwrap(info.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from numeric_keys(kind, (*prefix, name))
        elif kind in (int, float) or (get_origin(kind) in (Union, UnionType) and {int, float} & set(get_args(kind))):
            yield (*prefix, name), info


def ends(info: Any) -> tuple[float | None, float | None]:
    """(lowest, highest) allowed by a field's declared bounds."""
    low = high = None
    for bound in info.metadata:
        if isinstance(bound, (at.Ge, at.Gt)):
            low = bound.ge if isinstance(bound, at.Ge) else bound.gt
        if isinstance(bound, (at.Le, at.Lt)):
            high = bound.le if isinstance(bound, at.Le) else bound.lt
    return low, high


@pytest.fixture(scope="module")
def models():
    plugins = load_plugins()
    return {name: plugins.config_model(name) for name in plugins.algorithms.names()}


def test_every_numeric_key_of_every_algorithm_has_a_declared_range(models):
    unbounded, walked = [], 0
    for algorithm, model in models.items():
        for path, info in numeric_keys(model):
            walked += 1
            low, high = ends(info)
            if low is None or high is None:
                unbounded.append(f"{algorithm}: {'.'.join(path)} ({'no lower end' if low is None else 'no upper end'})")
    assert walked > 250 and not unbounded, "\n".join(unbounded)  # every algorithm, with its engines' keys


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data: dict[str, Any] = {path[-1]: value}
    for part in reversed(path[:-1]):
        data = {part: data}
    return data


def test_a_value_past_either_end_of_any_numeric_key_is_refused_naming_it(models):
    """Each key alone set just past its upper end, then past its lower end (or to a huge negative): pydantic's
    error is under that key's path. Holds the declared bounds to be the checked ones."""
    missed = []
    for algorithm, model in models.items():
        for path, info in numeric_keys(model):
            low, high = ends(info)
            kind = int if _unwrap(info.annotation) is int else float
            for value in (kind(high) + 1 if kind is int else high * 2 + 1, kind(low) - 1 if kind is int else low - 1):
                try:
                    model.model_validate(nested(path, value))
                    missed.append(f"{algorithm}: {'.'.join(path)}={value!r} accepted")
                except ValidationError as exc:
                    if not any(tuple(map(str, e["loc"])) == path for e in exc.errors()):
                        missed.append(f"{algorithm}: {'.'.join(path)}={value!r}: {exc.errors()[0]['loc']}")
    assert not missed, "\n".join(missed)


@pytest.mark.parametrize("override, key", [
    ("worker_timeout_s=1e300", "worker_timeout_s"),  # OverflowError in Ray, after the cluster started
    ("placement_timeout_s=1e12", "placement_timeout_s"),
    ("seed=4294967296", "seed"),  # numpy's generators refuse it at run time
    ("max_completion_length=1000000000000", "max_completion_length"),
    ("train.engine_kwargs={adam_epsilon: 99999999999999999999999}", "train.engine_kwargs"),  # past int64
    ("seed=" + "9" * 5000, "seed"),  # Python refuses to read it: a ValueError traceback before
])
def test_numbers_out_of_range_are_refused_by_validate_in_one_paragraph(cli, tmp_path, monkeypatch, override, key):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("model: tiny\ndataset: tiny:toy\n")
    rc, err = cli("config", "validate", "--plugin", "grpo", "--config", "c.yaml", override)
    assert rc == 2 and key in err and "Traceback" not in err and len(err.splitlines()) <= 3, err


@pytest.mark.parametrize("ranks", ["99999999999", "[0, 70000]", "'range(65530, 65540)'"])
def test_a_huge_device_groups_ranks_is_refused_by_validate_and_plan_without_building_it(cli, tmp_path, monkeypatch,
                                                                                         ranks):
    """`ranks: 99999999999` built a list of 1e11 ints (MemoryError in validate) and `rlcore plan` said "nothing to
    plan"; a rank past the plan's limit planned a node for it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("model: tiny\ndataset: tiny:toy\ndevice_groups:\n  nproc_per_node: 8\n"
                                     f"  g: {{device: GPU, ranks: {ranks}, workers: [train, rollout]}}\n")
    for command in (["config", "validate"], ["plan"]):
        rc, err = cli(*command, "--plugin", "grpo", "--config", "c.yaml")
        assert rc == 2 and "device_groups.g.ranks" in err and "6553" in err and "Traceback" not in err, (command, err)
