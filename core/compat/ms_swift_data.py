"""ms-swift's data and template keys: dataset ids (ModelScope's, or the Hugging Face Hub's with `use_hf`) become
their train files, `enable_thinking` the chat template's option, `truncation_strategy` rlcore's own prompt key (TRL's
truncation_mode for sft). Each function rewrites a `rlcore.compat.ms_swift._Translator`'s data."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .modelscope import hf_dataset, is_modelscope_id, modelscope_dataset

SFT_TRUNCATION = {"right": "keep_start", "left": "keep_end"}  # ms-swift's truncation_strategy -> TRL's truncation_mode


def prompt_keys(t: Any) -> None:
    """ms-swift's `enable_thinking` is the chat template's option (chat_template_kwargs); its
    `truncation_strategy` (left, right, delete) is rlcore's own key for prompts, and TRL's truncation_mode for
    sft (left: keep_end, right: keep_start)."""
    if t.foreign("enable_thinking"):
        value = t.take("enable_thinking")
        kwargs = t.data.setdefault("chat_template_kwargs", {}) if "chat_template_kwargs" in t.own else None
        if value is None:
            t.idle.append("enable_thinking")
        elif isinstance(kwargs, dict):
            t.put("enable_thinking", "enable_thinking", value, "chat_template_kwargs")
        else:
            t.refuse("enable_thinking", f"({value!r}): this algorithm renders the tokenizer's chat template "
                     "with its defaults; put the switch in the rows (a system message, or the template)")
    value = t.data.get("truncation_strategy", "")
    if value is None:  # ms-swift's default: the algorithm's own
        t.take("truncation_strategy")
        t.idle.append("truncation_strategy")
    elif t.foreign("truncation_strategy"):
        value = t.take("truncation_strategy")
        if "trainer_kwargs" in t.own and value in SFT_TRUNCATION:
            if value == "left":
                t.put("truncation_strategy: left", "truncation_mode", "keep_end", "trainer_kwargs")
            else:
                t.idle.append("truncation_strategy")  # TRL's default, keep_start
        elif value == "left" and "max_prompt_length" in t.own:  # sample cuts prompts from the left
            t.idle.append("truncation_strategy")
        elif "trainer_kwargs" in t.own:
            t.refuse("truncation_strategy", f"({value!r}): TRL's SFTTrainer cuts a row longer than max_length "
                     "(keeping its start), never drops or splits it; use right or left")
        else:
            t.refuse("truncation_strategy", f"({value!r}): this algorithm cuts a prompt longer than "
                     "max_prompt_length from the left (keeping its end); use left")


def dataset_ids(t: Any) -> None:
    """Dataset ids (`owner/name#N`, no local file) are ModelScope's, as in ms-swift, or the Hugging Face Hub's with
    `use_hf: true`: their train file (its first N rows) is the dataset."""
    hub = bool(t.take("use_hf")) if t.foreign("use_hf") else False
    given = t.data.get("dataset")
    sets = given if isinstance(given, list) else [given]
    if not any(isinstance(d, str) and is_modelscope_id(d) for d in sets):
        return
    found = []
    for name in sets:
        if not (isinstance(name, str) and is_modelscope_id(name)):
            found.append(name)
            continue
        try:
            file = hf_dataset(name) if hub else modelscope_dataset(name)
        except ConfigError as exc:
            t.refuse("dataset", (exc.problems or [("", str(exc))])[0][1])
            return
        found.append(file)
        t.out.mapped.append(f"dataset {name!r} ({'Hugging Face' if hub else 'ModelScope'}) -> {file!r}")
    t.data["dataset"] = found if isinstance(given, list) else found[0]
