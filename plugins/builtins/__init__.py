"""The built-in roles, dispatchers, collectors and placement policies."""

from __future__ import annotations

from rlcore import PlacementSpec, RoleSpec, hookimpl
from rlcore.dispatch import COLLECTORS, DISPATCHERS
from rlcore.placement import POLICIES

ROLES = {
    "default": "the single role of SFT/pretraining: every worker trains",
    "train": "the policy being trained (a train engine)",
    "rollout": "generates completions (a rollout engine)",
    "reference": "a frozen copy of the initial policy, for the KL penalty",
    "teacher": "a distillation teacher serving top-k log-probs",
    "sampler": "generates candidates for best-of-N sampling",
    "prm": "a process reward model scoring each step",
    "orm": "an outcome reward model scoring whole completions",
}


@hookimpl
def rlcore_roles():
    for name, description in ROLES.items():
        yield RoleSpec(name, description=description)


@hookimpl
def rlcore_dispatchers():
    yield from DISPATCHERS


@hookimpl
def rlcore_collectors():
    yield from COLLECTORS


@hookimpl
def rlcore_placements():
    for name, (place, description) in POLICIES.items():
        yield PlacementSpec(name, place=place, description=description)
