"""What the vllm engine finds in a whole config (`EngineSpec.config_check`: an adapter-only weight sync,
`rollout.vllm_enable_lora`, against the train section's LoRA and the run's sleep level), in a failure vLLM
reports (`EngineSpec.advice`), and behind vLLM's "failed to be inspected" (`inspection_cause`)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from rlcore import TrainRoleConfig
from rlcore.engines import names_lm_head, read_model

_MAX_LEN = re.compile(r"User-specified max_model_len \((\d+)\) is greater than the derived max_model_len "
                      r"\((?:(\w+)=)?(\d+)")
_INSPECTED = re.compile(r"Model architectures? \[?([^\]]*)\]? failed to be inspected")
_KV_CACHE = re.compile(r"No available memory for the cache blocks|can be stored in KV cache", re.I)

DELTA_NET_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # Qwen3.5's linear attention


def advice(failure: Any) -> str:
    """`EngineSpec.advice`: the key to change where vLLM refuses a context longer than the model's, or finds no room
    for its KV cache in its share of the GPU; '' for other failures."""
    role, text = failure.role, f"{failure.type}: {failure.message}"
    if match := _MAX_LEN.search(text):
        key = match[2] or "context length"
        return (f"lower {role}.vllm_max_model_len ({match[1]}) to {match[3]} or less, the model's {key}; "
                f"prompt and completion must fit in it")
    if _KV_CACHE.search(text):
        return (f"vLLM's share of the GPU leaves no room for the KV cache: raise {role}.vllm_gpu_memory_utilization "
                f"or lower {role}.vllm_max_model_len")
    return ""


def syncs_adapter(vllm_enable_lora: bool = False, **_: Any) -> bool:
    """`EngineSpec.syncs_adapter`: with `vllm_enable_lora` a sync sends the train engine's LoRA adapter alone."""
    return bool(vllm_enable_lora)


def config_problems(config: Any, role: str) -> list[tuple[str, str]]:
    """What keeps `ROLE.vllm_enable_lora` (the adapter alone to vLLM at each sync) from working: no LoRA on the
    train engine, a rank above `vllm_max_lora_rank`, `sleep_level` 2 while colocated, an adapter on the LM head
    (vLLM puts LoRA on linear layers only), or adapters on Qwen3.5's gated delta-net linears, whose LoRA vLLM does
    not apply (vllm-project/vllm#49354)."""
    section, train = getattr(config, role, None), getattr(config, "train", None)
    if not getattr(section, "vllm_enable_lora", False) or not isinstance(train, TrainRoleConfig):
        return []
    if not train.lora_rank:
        return [(f"{role}.vllm_enable_lora", "syncs the train engine's LoRA adapter, but train.lora_rank is 0 (every "
                 "weight trains); set train.lora_rank (ms-swift: tuner_type lora), or drop vllm_enable_lora")]
    problems = []
    colocated = getattr(config, "colocated", None)  # GRPO's; else whether a colocate group holds both
    if colocated is None:
        colocated = any({"train", role} <= set(group) for group in getattr(config, "colocate_groups", None) or [])
    if getattr(config, "sleep_level", 1) == 2 and colocated:
        problems.append(("sleep_level", f"2 drops vLLM's weights while training runs, but with {role}.vllm_enable_lora "
                         "the base weights are sent once (only the adapter after); use sleep_level 1"))
    if train.lora_rank > section.vllm_max_lora_rank:
        problems.append((f"{role}.vllm_max_lora_rank", f"({section.vllm_max_lora_rank}) is below train.lora_rank "
                         f"({train.lora_rank}); vLLM refuses a larger adapter: raise it to a rank vLLM takes, at least "
                         f"{train.lora_rank}"))
    if names_lm_head(train.lora_target_modules):
        problems.append(("train.lora_target_modules", f"{train.lora_target_modules!r} puts an adapter on the LM head, but "
                         "vLLM applies LoRA to its linear layers only and its LM head is none (ParallelLMHead), so the "
                         "head's adapter cannot reach the rollout (vllm-project/vllm#32599); drop lm_head from "
                         f"train.lora_target_modules, or drop {role}.vllm_enable_lora (the merged weights, the head's "
                         "adapter in them, are synced)"))
    targets = [train.lora_target_modules] if isinstance(train.lora_target_modules, str) else train.lora_target_modules
    delta = sorted(set(targets) & set(DELTA_NET_LINEARS)) or (["all-linear"] if "all-linear" in targets else [])
    model = getattr(config, "model", None)
    if delta and model:
        files = read_model(model)
        if files is not None and "linear_attention" in (files.value("layer_types") or []):
            problems.append(("train.lora_target_modules", f"{delta} puts adapters on the gated delta-net linears of "
                             f"'{model}', whose LoRA vLLM loads but does not apply (vllm-project/vllm#49354: "
                             "generations stay the base's); list the attention and MLP projections "
                             "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or drop "
                             f"{role}.vllm_enable_lora (merged weights are synced)"))
    return problems


__all__ = ["DELTA_NET_LINEARS", "advice", "config_problems", "syncs_adapter"]


def inspection_cause(error: BaseException, modules: Callable[[str], str | None]) -> str:
    """What vLLM's "Model architectures [...] failed to be inspected. Please check the logs" hides: vLLM imports each
    architecture's model module in a subprocess and logs the exception there. `modules(architecture)` names vLLM's
    module for it (its registry); importing that module here raises the same error, returned as one line with the
    fix where it is a missing package ('' where `error` is another error or every module imports)."""
    match = _INSPECTED.search(str(error))
    if match is None:
        return ""
    causes = []
    for arch in (a.strip(" '\"") for a in match[1].split(",")):
        module = modules(arch) if arch else None
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as failure:  # noqa: BLE001 - any import failure is the cause being looked for
            cause = f"vLLM's {arch} ({module}) does not import: {type(failure).__name__}: {failure}"
            if isinstance(failure, ModuleNotFoundError) and failure.name:
                cause += f"; install {failure.name.split('.')[0]} (vLLM requires it; `pip install vllm` brings it)"
            causes.append(cause)
    return "; ".join(causes)


def registry_modules(registry: Any) -> Callable[[str], str | None]:
    """`inspection_cause`'s `modules` for vLLM's `ModelRegistry`: the module of a lazily registered architecture."""
    def module(arch: str) -> str | None:
        entry = getattr(registry, "models", {}).get(arch)
        return getattr(entry, "module_name", None)
    return module
