"""rlcore: a plugin-based trainer framework for post-training language models.

Importing `rlcore` imports no engine library (torch, transformers, ray, vllm): the CLI starts fast and
plugins pay for what they use.
"""

from .batch import Batch
from .config import BaseConfig, ConfigProblems, RoleConfig, RunConfig, load_config, render_config
from .engines import Generation, ModelOutputs, RolloutEngine, SamplingParams, TopK, TrainEngine
from .errors import ConfigError, NotRegistered, PluginError, ResourceError, RlcoreError, RoleFailed
from .hookspecs import hookimpl, hookspec
from .manager import Plugins, Registered, load_plugins
from .registry import Registry
from .resources import plan_from_config
from .roles import GenerateWorker, ScoreWorker, TrainWorker
from .session import RoleSession, RoleSetup
from .specs import (
    AlgorithmSpec,
    CollectorSpec,
    DispatcherSpec,
    EngineSpec,
    PlacementRequest,
    PlacementSpec,
    RewardSpec,
    RoleSpec,
    SettingSpec,
    Slot,
)
from .trainer import PhaseTimer, Trainer
from .workers import bind, function, worker

__version__ = "0.1.0"

__all__ = [
    "AlgorithmSpec",
    "BaseConfig",
    "Batch",
    "CollectorSpec",
    "ConfigError",
    "ConfigProblems",
    "DispatcherSpec",
    "EngineSpec",
    "GenerateWorker",
    "Generation",
    "ModelOutputs",
    "NotRegistered",
    "PhaseTimer",
    "PlacementRequest",
    "PlacementSpec",
    "PluginError",
    "Plugins",
    "Registered",
    "Registry",
    "ResourceError",
    "RewardSpec",
    "RlcoreError",
    "RoleConfig",
    "RoleFailed",
    "RoleSession",
    "RoleSetup",
    "RoleSpec",
    "RolloutEngine",
    "RunConfig",
    "SamplingParams",
    "ScoreWorker",
    "SettingSpec",
    "Slot",
    "TopK",
    "TrainEngine",
    "TrainWorker",
    "Trainer",
    "__version__",
    "bind",
    "function",
    "hookimpl",
    "hookspec",
    "load_config",
    "load_plugins",
    "plan_from_config",
    "render_config",
    "worker",
]
