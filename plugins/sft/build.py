"""Building the Hugging Face trainer of one worker: TRL's SFTTrainer (sft) or transformers' Trainer (pt),
from the options the driver derives from the config. Runs where the worker runs; the environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is set by the worker runtime, so the trainer's own
torch.distributed world is the group's: gloo on the CPU, NCCL on GPUs."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rlcore import ConfigError, did_you_mean
from rlcore.engines import resolve_dtype
from rlcore.runtime import join_torch_world

from .data import node_dataset

# TrainingArguments keys rlcore sets itself: checkpoints, logging and the step count follow its loop.
MANAGED = {
    "output_dir": "output_dir (top level)", "max_steps": "max_steps (top level)",
    "save_strategy": "save_steps (top level: rlcore writes the checkpoints)", "save_steps": "save_steps (top level)",
    "save_total_limit": "save_total_limit (top level)", "logging_steps": "logging_steps (top level)",
    "logging_strategy": "logging_steps (top level: every step is logged to metrics.jsonl)",
    "resume_from_checkpoint": "resume (top level, or --resume)", "overwrite_output_dir": "overwrite_output_dir (top level)",
    "use_cpu": "default.gpus (the placement decides the device)",
}


def arguments_class(kind: str) -> type:
    if kind == "sft":
        try:
            from trl import SFTConfig
        except ModuleNotFoundError as exc:  # the sft extra is not installed
            raise ConfigError(f"algorithm 'sft' needs TRL, which is not installed here ({exc}); install it with "
                              f"pip install 'rlcore[sft]'") from None

        return SFTConfig
    from transformers import TrainingArguments

    return TrainingArguments


def trainer_kwargs_problems(kind: str, given: dict[str, Any], top_level: set[str]) -> list[tuple[str, str]]:
    """Keys of `trainer_kwargs` the trainer's arguments do not have, rlcore sets, or the config has at its
    top level; found before anything is allocated (TRL, slow to import, only when there are any)."""
    if not given:
        return []
    known = [f.name for f in dataclasses.fields(arguments_class(kind))]
    problems = []
    for key in given:
        where = f"trainer_kwargs.{key}"
        if key in MANAGED:
            problems.append((where, f"is set by rlcore; use {MANAGED[key]}"))
        elif key in top_level:
            problems.append((where, f"is a key of the config itself; set {key} at the top level"))
        elif key not in known:
            owner = "TRL's SFTConfig" if kind == "sft" else "transformers' TrainingArguments"
            problems.append((where, f"is not a field of {owner}.{did_you_mean(key, known)}"))
    return problems


def _arguments(kind: str, options: dict[str, Any]) -> Any:
    args = dict(options["args"])
    args.update(
        output_dir=options["output_dir"], save_strategy="no", logging_strategy="steps", logging_steps=1,
        report_to=args.get("report_to", "none"), use_cpu=options["device"] == "cpu", disable_tqdm=True,
    )
    cls = arguments_class(kind)
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(cls)}:  # transformers 5's name
        args["activation_checkpointing"] = args.pop("gradient_checkpointing")
    # The group's torch.distributed world, joined first with its store on MASTER_ADDR only: accelerate,
    # which the trainer's arguments call as they are made, would open torch's own, listening on every
    # interface; it takes a world that is there as it is.
    timeout = args.get("ddp_timeout") or next(f.default for f in dataclasses.fields(cls) if f.name == "ddp_timeout")
    join_torch_world("cpu" if options["device"] == "cpu" else "cuda", float(timeout))
    return cls(**args)



def _model_and_tokenizer(options: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.expanduser(options["model"])
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(options["dtype"], path, options["device"] != "cpu"))
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model '{options['model']}' cannot be loaded: {reason[:300]}", [("model", reason[:200])]) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _lora(options: dict[str, Any]) -> Any:
    lora = options.get("lora")
    if not lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=lora["target_modules"], task_type="CAUSAL_LM")


def _node_dataset(options: dict[str, Any], kind: str) -> tuple[Any, bool]:
    """The rows, read and stored once per node: the global main first, then each node's local main; and
    whether this worker read them."""
    from accelerate import PartialState

    state = PartialState()
    with state.main_process_first(), state.local_main_process_first():
        return node_dataset(options["data"], kind, options.get("dataset_cache_dir"), options.get("self_cognition"))


def _noting(trainer: Any, rows_read_here: bool) -> Any:
    """The trainer, quiet (no callback printing every log to stdout: rlcore's progress bar and metrics.jsonl
    say it), noting whether this worker read the data files (`LMWorker.where`)."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.rlcore_rows_read_here = rows_read_here
    return trainer


def build_sft(**options: Any) -> Any:
    """TRL's SFTTrainer over the worker's share of the data (see the module docstring)."""
    from trl import SFTTrainer

    args = _arguments("sft", options)
    _ = args.device  # joins the group's torch.distributed world now, before any data is read
    model, tokenizer = _model_and_tokenizer(options)
    dataset, read = _node_dataset(options, "sft")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=_lora(options))
    return _noting(trainer, read)


def build_pt(**options: Any) -> Any:
    """transformers' Trainer on plain text: tokenised once per node, packed into blocks of max_length (or cut
    to it and padded), every token a label."""
    from accelerate import PartialState
    from transformers import DataCollatorForLanguageModeling, Trainer, default_data_collator

    args = _arguments("pt", options)
    _ = args.device
    model, tokenizer = _model_and_tokenizer(options)
    lora = _lora(options)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora)
    dataset, read = _node_dataset(options, "pt")
    max_length, packing = options["max_length"], options["packing"]
    eos = tokenizer.eos_token or ""

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = [t if t.endswith(eos) else t + eos for t in batch["text"]]
        if packing:
            return {"input_ids": tokenizer(texts, add_special_tokens=False)["input_ids"]}
        return {"input_ids": tokenizer(texts, add_special_tokens=False, truncation=max_length is not None,
                                       max_length=max_length)["input_ids"]}

    def blocks(batch: dict[str, list]) -> dict[str, list]:
        ids = [t for row in batch["input_ids"] for t in row]
        usable = len(ids) // max_length * max_length
        chunks = [ids[i : i + max_length] for i in range(0, usable, max_length)]
        return {"input_ids": chunks, "labels": [list(c) for c in chunks]}

    state = PartialState()
    with state.main_process_first(), state.local_main_process_first():
        dataset = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, desc="Tokenizing")
        if packing:
            dataset = dataset.map(blocks, batched=True, batch_size=1000, remove_columns=["input_ids"], desc="Packing")
    if len(dataset) == 0:
        raise ConfigError(f"dataset {', '.join(options['data'])}: its text makes no block of max_length={max_length} "
                          "tokens; lower max_length or give more text", [("max_length", "longer than the data")])
    collator = default_data_collator if packing else DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, data_collator=collator)
    return _noting(trainer, read)


build_sft.display_name = "hf (TRL's SFTTrainer)"  # the placement line's name for the engine
build_pt.display_name = "hf (transformers' Trainer)"
