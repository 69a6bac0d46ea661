"""Every extension point of rlcore, as pluggy hook specifications (marker name ``rlcore``).

A plugin is a module (or object) with functions named like the hooks below, decorated with
``@rlcore.hookimpl``. Registration hooks yield descriptors from ``rlcore.specs``; the plugin manager
collects them into registries that refuse a duplicate name and answer an unknown one with the known
names. Hooks gain arguments only as opt-in parameters (pluggy passes just the ones an implementation
names), so plugins written against an older rlcore keep working.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .specs import (
        AlgorithmSpec,
        CollectorSpec,
        DispatcherSpec,
        EngineSpec,
        EnvironmentSpec,
        PlacementSpec,
        RewardSpec,
        RoleSpec,
        SettingSpec,
    )

hookspec = pluggy.HookspecMarker("rlcore")
hookimpl = pluggy.HookimplMarker("rlcore")


# -------------------------------------------------------------------------
# registration hooks: what a plugin provides
# -------------------------------------------------------------------------


@hookspec
def rlcore_roles() -> Iterable[RoleSpec]:
    """Yield the roles this plugin adds; a resource plan may only name registered roles.

    .. code-block:: python

        @hookimpl
        def rlcore_roles():
            yield RoleSpec("critic", description="value model")
    """


@hookspec
def rlcore_dispatchers() -> Iterable[DispatcherSpec]:
    """Yield dispatch modes: how one call's arguments split over a group's workers (``dispatch=`` names
    them), with the collect the mode pairs with and the ranks whose results count, where it needs them.

    .. code-block:: python

        @hookimpl
        def rlcore_dispatchers():
            yield DispatcherSpec("first_half", split=lambda n, args, kwargs, mesh: ..., collect="flatten")
    """


@hookspec
def rlcore_collectors() -> Iterable[CollectorSpec]:
    """Yield ways to join the workers' results into one value (``collect=`` names them).

    .. code-block:: python

        @hookimpl
        def rlcore_collectors():
            yield CollectorSpec("sum", collect=lambda results: sum(results))
    """


@hookspec
def rlcore_placements() -> Iterable[PlacementSpec]:
    """Yield GPU-allocation policies: a resource plan and a cluster give one bundle per worker.

    .. code-block:: python

        @hookimpl
        def rlcore_placements():
            yield PlacementSpec("reverse", place=my_reverse_policy)
    """


@hookspec
def rlcore_algorithms() -> Iterable[AlgorithmSpec]:
    """Yield runnable algorithms: a name, a pydantic config model and a trainer class.

    .. code-block:: python

        @hookimpl
        def rlcore_algorithms():
            yield AlgorithmSpec("myalgo", config=MyConfig, trainer=MyTrainer)
    """


@hookspec
def rlcore_engines() -> Iterable[EngineSpec]:
    """Yield engine implementations (kinds train, forward, rollout, teacher, reward) that roles use.

    A `forward` engine is a train engine without an optimizer (reference and colocated teacher models);
    every engine takes a `device` option, which the session sets from the role's placement.

    Engines are registered per kind, under "kind/name" (``plugins.engines.get("hf", kind="rollout")``
    looks one up), so a plugin may give a train and a rollout engine the same name.

    .. code-block:: python

        @hookimpl
        def rlcore_engines():
            yield EngineSpec("sglang", kind="rollout", factory=make_sglang_engine)
    """


@hookspec
def rlcore_rewards() -> Iterable[RewardSpec]:
    """Yield reward functions (TRL's signature) and reward-model roles (``reward_funcs`` names them).

    .. code-block:: python

        @hookimpl
        def rlcore_rewards():
            yield RewardSpec("length", fn=lambda prompts, completions, **kw: [len(c) for c in completions])
    """


@hookspec
def rlcore_environments() -> Iterable[EnvironmentSpec]:
    """Yield multi-turn environments: what answers a model's turn (tools, a game, a hint); `multi_turn_scheduler`
    names them.

    .. code-block:: python

        @hookimpl
        def rlcore_environments():
            yield EnvironmentSpec("guess", factory=GuessEnvironment)
    """


@hookspec
def rlcore_settings() -> Iterable[SettingSpec]:
    """Yield config keys of this plugin's own, added to every algorithm's config and validated with it.

    .. code-block:: python

        @hookimpl
        def rlcore_settings():
            yield SettingSpec("report_to", list[str], default=[], description="where metrics go")
    """


# -------------------------------------------------------------------------
# configuration hooks: before anything is allocated
# -------------------------------------------------------------------------


@hookspec
def rlcore_configure(config: Any, algorithm: str) -> None:
    """Adjust ``config`` in place, or reject it by raising ``ConfigError``; runs before any GPU is taken.

    .. code-block:: python

        @hookimpl
        def rlcore_configure(config, algorithm):
            if algorithm == "grpo" and config.beta > 1: raise ConfigError("beta > 1 is not sensible")
    """


# -------------------------------------------------------------------------
# training lifecycle hooks: observe (or wrap, with wrapper=True) a run
# -------------------------------------------------------------------------


@hookspec
def rlcore_train_start(trainer: Any) -> None:
    """Called once, after workers and engines are up and before the first step.

    .. code-block:: python

        @hookimpl
        def rlcore_train_start(trainer):
            print("training", trainer.config.model)
    """


@hookspec
def rlcore_step_end(trainer: Any, step: int, metrics: dict[str, Any]) -> None:
    """Called after every optimizer step with that step's metrics (the ones written to metrics.jsonl).

    .. code-block:: python

        @hookimpl
        def rlcore_step_end(trainer, step, metrics):
            wandb.log(metrics, step=step)
    """


@hookspec
def rlcore_train_end(trainer: Any, metrics: dict[str, Any]) -> None:
    """Called once when a run ends normally, with the run's summary metrics.

    .. code-block:: python

        @hookimpl
        def rlcore_train_end(trainer, metrics):
            print("final reward", metrics.get("reward"))
    """
