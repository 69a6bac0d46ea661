"""rlcore: a plugin-based trainer framework for post-training language models.

Importing `rlcore` imports no engine library (torch, transformers, ray, vllm): the CLI starts fast and
plugins pay for what they use.
"""

from .batch import Batch
from .config import BaseConfig, ConfigProblems, DeviceKeys, RoleConfig, RunConfig, config_error, problems_of
from .data import PromptEncoder, PromptSampler, completion_text, load_prompts, load_rows, prompt_view
from .engines import (
    Generation, ModelOutputs, OptimizerOptions, RolloutEngine, SamplingParams, TopK, TrainEngine, TrainOptions, build_engine,
)
from .errors import ConfigError, NotRegistered, PluginError, ResourceError, RlcoreError, RoleFailed, did_you_mean
from .hookspecs import hookimpl, hookspec
from .manager import Plugins, Registered, config_model, load_config, load_plugins
from .model_checks import ModelUse
from .registry import Registry
from .runtime.resources import plan_from_config
from .rewards import RewardFailed, call_reward, resolve_reward
from .role_trainer import RoleTrainer
from .runtime.roles import GenerateWorker, ScoreWorker, TeacherTrainWorker, TrainWorker, make_engine
from .sections import (
    CheckpointKeys,
    GenerateRoleConfig,
    LoggingKeys,
    NonfiniteKeys,
    OptimizerKeys,
    PromptKeys,
    RolloutRoleConfig,
    TrainingConfig,
    TrainRoleConfig,
    default_of,
    rollout_options,
    train_options,
)
from .runtime.session import RoleSession, RoleSetup, announce
from .specs import (
    AlgorithmSpec,
    CollectorSpec,
    DispatcherSpec,
    EngineSpec,
    EnvironmentSpec,
    PlacementRequest,
    PlacementSpec,
    RewardSpec,
    RoleSpec,
    SettingSpec,
    Slot,
)
from .environments import Environment, Step, ToolCall, Turn
from .trainer import PhaseTimer, Trainer
from .runtime.workers import bind, function, worker, worker_plugins, worker_rank
from .yaml_io import render_config

__version__ = "0.1.0"

__all__ = [
    "AlgorithmSpec",
    "BaseConfig",
    "Batch",
    "CheckpointKeys",
    "CollectorSpec",
    "ConfigError",
    "ConfigProblems",
    "DeviceKeys",
    "DispatcherSpec",
    "EngineSpec",
    "Environment",
    "EnvironmentSpec",
    "GenerateRoleConfig",
    "GenerateWorker",
    "Generation",
    "LoggingKeys",
    "ModelOutputs",
    "ModelUse",
    "NonfiniteKeys",
    "NotRegistered",
    "OptimizerKeys",
    "OptimizerOptions",
    "PhaseTimer",
    "PlacementRequest",
    "PlacementSpec",
    "PluginError",
    "Plugins",
    "PromptEncoder",
    "PromptKeys",
    "PromptSampler",
    "Registered",
    "Registry",
    "ResourceError",
    "RewardFailed",
    "RewardSpec",
    "RlcoreError",
    "RoleConfig",
    "RoleFailed",
    "RoleSession",
    "RoleSetup",
    "RoleSpec",
    "RoleTrainer",
    "RolloutEngine",
    "RolloutRoleConfig",
    "RunConfig",
    "SamplingParams",
    "ScoreWorker",
    "SettingSpec",
    "Slot",
    "Step",
    "ToolCall",
    "TopK",
    "TrainEngine",
    "TrainOptions",
    "TrainRoleConfig",
    "TeacherTrainWorker",
    "TrainWorker",
    "Trainer",
    "TrainingConfig",
    "Turn",
    "__version__",
    "announce",
    "bind",
    "build_engine",
    "call_reward",
    "completion_text",
    "config_error",
    "config_model",
    "default_of",
    "did_you_mean",
    "function",
    "hookimpl",
    "hookspec",
    "load_config",
    "load_plugins",
    "load_prompts",
    "load_rows",
    "make_engine",
    "plan_from_config",
    "problems_of",
    "prompt_view",
    "render_config",
    "resolve_reward",
    "rollout_options",
    "train_options",
    "worker",
    "worker_plugins",
    "worker_rank",
]
