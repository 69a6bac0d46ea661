"""TRL's configuration names (GRPOConfig, SFTConfig, GKDConfig and the ModelConfig of its scripts), read as
rlcore's where they mean the same thing, so that a TRL YAML or command line carries over.

Every algorithm takes them at the top level, as TRL does; a key rlcore keeps in a role section
(`train.gradient_checkpointing` for grpo and gkd) is moved there by the ms-swift translation, which runs
after this one (`rlcore.ms_swift`). A name whose meaning differs in rlcore is never renamed: it is said what
it does here (`bf16` for an algorithm without mixed precision), or refused with the reason.
"""

from __future__ import annotations

from typing import Any

# TRL's name -> rlcore's, where only the spelling differs
RENAMES = {
    "model_name_or_path": "model",  # ModelConfig
    "teacher_model_name_or_path": "teacher_model",  # GKDConfig
    "max_new_tokens": "max_completion_length",  # GKDConfig; sample's own key is max_new_tokens
    "max_completion_length": "max_new_tokens",  # GRPOConfig's name, for sample
    "max_seq_length": "max_length",  # SFTConfig's name before TRL 0.20
    "lora_r": "lora_rank",  # ModelConfig
    "vllm_max_model_length": "vllm_max_model_len",  # GRPOConfig
}
TRL_LORA_RANK = 16  # ModelConfig's lora_r default, which `use_peft: true` alone gets in TRL
PRECISIONS = {"bf16": "bfloat16", "fp16": "float16"}


def trl_keys(t: Any) -> None:
    """Rewrite TRL's names in the translator `t`'s data (a `rlcore.ms_swift._Translator`)."""
    in_sections = {key for section in t.sections.values() for key in section.model_fields}
    for where in [None, *t.sections]:
        # at the top also a role section's key: the ms-swift translation moves it there (lora_rank -> train)
        known = t.own | in_sections if where is None else set(t.sections[where].model_fields)
        for source, target in RENAMES.items():
            if t.foreign(source, where) and target in known:
                t.put(f"TRL's {_path(where, source)}", target, t.take(source, where), where)
    _peft(t)
    _precision(t)
    if t.foreign("dtype") and "dtype" not in t.own:  # ModelConfig's dtype: every role's, as torch_dtype
        t.data.setdefault("torch_dtype", t.take("dtype"))
    if t.foreign("attn_implementation"):
        t.note("attn_implementation", t.take("attn_implementation"), "the engine picks its attention kernel "
               "(transformers' sdpa, vLLM's own); the result is the same", origin="TRL's")


def _path(where: str | None, key: str) -> str:
    return f"{where}.{key}" if where else key


def _peft(t: Any) -> None:
    """`use_peft: true` trains LoRA with lora_r (TRL's default 16); false trains every weight, whatever lora_r."""
    for where in [None, "train"]:
        if not t.foreign("use_peft", where):
            continue
        use = t.take("use_peft", where)
        node = t.node(where) or {}
        if use:
            rank = node.get("lora_rank") or TRL_LORA_RANK
            node.pop("lora_rank", None)  # from lora_r, or rlcore's own: the one rank TRL would use
            t.put(f"TRL's use_peft: true (lora_r {rank})", "lora_rank", rank, where)
        else:
            node.pop("lora_rank", None)
            t.put("TRL's use_peft: false", "lora_rank", 0, where)


def _precision(t: Any) -> None:
    """`bf16`/`fp16` for an algorithm whose engines have no mixed precision: the roles' models load and train in
    that dtype (what TRL does with a bf16 checkpoint and its default dtype 'auto'), said on stderr."""
    for key, dtype in PRECISIONS.items():
        if not t.foreign(key):
            continue
        on = t.take(key)
        if on is not True:
            t.note(key, on, "rlcore's roles load in their dtype (unless set: auto, the checkpoint's "
                   "half precision on a GPU, float32 on the CPU)", origin="TRL's")
            continue
        roles = [name for name, section in t.sections.items() if "dtype" in section.model_fields
                 and "dtype" not in (t.data.get(name) or {})]
        for name in roles:
            t.data.setdefault(name, {})["dtype"] = dtype
        t.note(key, on, f"{', '.join(f'{n}.dtype' for n in roles) or 'every dtype is set'}: {dtype}; these engines "
               "keep no float32 master copy of the weights", origin="TRL's")
