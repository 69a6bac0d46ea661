"""The built-in roles, dispatchers, collectors, placement policies and environments (with their `environment`
reward)."""

from __future__ import annotations

from rlcore import EnvironmentSpec, PlacementSpec, RewardSpec, RoleSpec, hookimpl
from rlcore.runtime import COLLECTORS, DISPATCHERS, POLICIES

from .environments import MathTipTrick, environment_reward, tool_call

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


@hookimpl
def rlcore_environments():
    yield EnvironmentSpec("math_tip_trick", factory=MathTipTrick,
                          description="ms-swift's math tip: a wrong answer goes on after a hint, once")
    yield EnvironmentSpec("tool_call", factory=tool_call, description="TRL's tools: the model's <tool_call>s run functions")


@hookimpl
def rlcore_rewards():
    yield RewardSpec("environment", fn=environment_reward, description="the environment's reward parts, summed")
