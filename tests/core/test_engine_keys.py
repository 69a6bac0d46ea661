"""Engines own their keys: `EngineSpec.keys` join the role sections of the kinds an engine serves
(`with_engine_keys`), an engine is built with its own keys only, another engine's key that asks for what only that
engine does is refused, and core declares none of vLLM's, megatron's or hf's keys."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

import rlcore
from rlcore import EngineSpec, PluginError, RunConfig
from rlcore.config import with_engine_keys
from rlcore.registry import EngineRegistry
from rlcore.sections import GenerateRoleConfig, RolloutRoleConfig, TrainRoleConfig, other_engine_key_problems, rollout_options


class FastKeys(BaseModel):
    fast_cache: float = Field(0.5, gt=0, le=1, description="share of memory the fast engine caches in")
    fast_lora: bool = Field(False, json_schema_extra={"engine_only": True}, description="adapters, fast only")


class Algo(RunConfig):
    rollout: RolloutRoleConfig = Field(default_factory=RolloutRoleConfig)
    train: TrainRoleConfig = Field(default_factory=TrainRoleConfig)


class Sampler(GenerateRoleConfig):
    engine_defaults = {"fast": {"fast_cache": 0.9}}


class WithSampler(RunConfig):
    sampler: Sampler = Field(default_factory=Sampler)


def registry(*specs):
    engines = EngineRegistry("engine")
    for spec in specs:
        engines.add(spec, "fastplugin")
    return engines


FAST = EngineSpec("fast", kind="rollout", factory=dict, keys=FastKeys)


def test_an_engines_keys_join_the_sections_of_its_kind_only():
    model = with_engine_keys(Algo, registry(FAST))
    assert {"fast_cache", "fast_lora"} <= set(model.model_fields["rollout"].annotation.model_fields)
    assert "fast_cache" not in model.model_fields["train"].annotation.model_fields
    assert with_engine_keys(model, registry(FAST)) is model  # built once: extending again changes nothing
    config = model.model_validate({"rollout": {"engine": "fast", "fast_cache": 0.7}})
    assert rollout_options(config.rollout, "m", 1) == {"model": "m", "dtype": "auto", "seed": 1, "fast_cache": 0.7,
                                                       "fast_lora": False}
    other = model.model_validate({"rollout": {"fast_cache": 0.7}})  # engine hf: the fast keys stay out
    assert rollout_options(other.rollout, "m", 1) == {"model": "m", "dtype": "auto", "seed": 1}
    with pytest.raises(Exception, match="fast_cache"):
        model.model_validate({"rollout": {"fast_cache": 2}})


def test_an_algorithms_own_default_for_an_engine_key():
    model = with_engine_keys(WithSampler, registry(FAST))
    assert model().sampler.fast_cache == 0.9
    assert WithSampler(sampler={"engine": "fast"}).sampler.engine_options() == {"fast_cache": 0.9}  # not extended


def test_another_engines_key_is_refused_only_where_it_asks_for_that_engine():
    model = with_engine_keys(Algo, registry(FAST))
    tuning = model.model_validate({"rollout": {"fast_cache": 0.7}})
    assert other_engine_key_problems(tuning, ["rollout"]) == []
    asks = model.model_validate({"rollout": {"fast_lora": True}})
    ((key, message),) = other_engine_key_problems(asks, ["rollout"])
    assert key == "rollout.fast_lora" and "engine 'fast'" in message and "rollout.engine is 'hf'" in message
    assert other_engine_key_problems(model.model_validate({"rollout": {"fast_lora": False}}), ["rollout"]) == []


def test_an_engine_key_named_like_a_section_key_or_another_engines_is_a_plugin_error():
    class Clash(BaseModel):
        dtype: str = "auto"

    with pytest.raises(PluginError, match="engine 'clash' .*'dtype'"):
        with_engine_keys(Algo, registry(EngineSpec("clash", kind="rollout", factory=dict, keys=Clash)))

    class Same(BaseModel):
        fast_cache: float = 0.1

    with pytest.raises(PluginError, match="'fast_cache', which engine 'fast' declares too"):
        with_engine_keys(Algo, registry(FAST, EngineSpec("same", kind="rollout", factory=dict, keys=Same)))


def test_the_built_in_engines_keys_reach_every_algorithm_and_core_declares_none():
    plugins = rlcore.load_plugins()
    grpo = plugins.config_model("grpo")
    rollout, train = (grpo.model_fields[name].annotation.model_fields for name in ("rollout", "train"))
    assert {"vllm_max_model_len", "vllm_enable_lora"} <= set(rollout)
    assert {"tensor_model_parallel_size", "padding_free", "liger_kernel"} <= set(train)
    gkd_teacher = plugins.config_model("gkd").model_fields["teacher"].annotation
    assert gkd_teacher().vllm_gpu_memory_utilization == 0.9 and "vllm_enable_lora" not in gkd_teacher.model_fields
    config = rlcore.load_config(plugins.algorithms.get("grpo").config, None,
                                ["train.engine=hf", "train.tensor_model_parallel_size=2"], plugins=plugins)
    ((key, message),) = other_engine_key_problems(config, ["train"])
    assert key == "train.tensor_model_parallel_size" and "engine 'megatron'" in message
    core = Path(rlcore.__file__).parent
    for path in core.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                name = node.target.id
                assert not name.startswith("vllm_") and "model_parallel_size" not in name, f"{path}: {name}"
