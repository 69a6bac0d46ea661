"""TRL's configuration names (GRPOConfig, SFTConfig, GKDConfig and the ModelConfig of its scripts), read as
rlcore's where they mean the same thing, so that a TRL YAML or command line carries over.

Every algorithm takes them at the top level, as TRL does; a key rlcore keeps in a role section
(`train.gradient_checkpointing` for grpo and gkd) is moved there by the ms-swift translation, which runs
after this one (`rlcore.compat.ms_swift`). A name whose meaning differs in rlcore is never renamed: it is said what
it does here (`bf16` for an algorithm without mixed precision), or refused with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, get_args

from ..data import split_files
from ..errors import ConfigError
from .trl_table import GRPO_CONFIG, SECRET, TABLES, Answer, passed_to

# TRL's name -> rlcore's, where only the spelling differs
RENAMES = {
    "model_name_or_path": "model",  # ModelConfig
    "teacher_model_name_or_path": "teacher_model",  # GKDConfig
    "max_new_tokens": "max_completion_length",  # GKDConfig; sample's own key is max_new_tokens
    "max_completion_length": "max_new_tokens",  # GRPOConfig's name, for sample
    "max_seq_length": "max_length",  # SFTConfig's name before TRL 0.20
    "lora_r": "lora_rank",  # ModelConfig
    "vllm_max_model_length": "vllm_max_model_len",  # GRPOConfig
    "activation_checkpointing": "gradient_checkpointing",  # TrainingArguments' name in transformers 5
}
SEED = 42  # rlcore's default seed, which orders the data too
TRL_EPOCHS = 3.0  # TrainingArguments' num_train_epochs, which its max_steps -1 trains
LOG_LEVELS = {"critical": "error"}  # transformers' names rlcore spells otherwise
TRL_LORA_RANK = 16  # ModelConfig's lora_r default, which `use_peft: true` alone gets in TRL
PRECISIONS = {"bf16": "bfloat16", "fp16": "float16"}


def trl_keys(t: Any) -> None:
    """Rewrite TRL's names in the translator `t`'s data (a `rlcore.compat.ms_swift._Translator`)."""
    _trl_defaults(t)
    in_sections = {key for section in t.sections.values() for key in section.model_fields}
    for where in [None, *t.sections]:
        # at the top also a role section's key: the ms-swift translation moves it there (lora_rank -> train)
        known = t.own | in_sections if where is None else set(t.sections[where].model_fields)
        for source, target in RENAMES.items():
            if t.foreign(source, where) and (t.node(where) or {}).get(source, "") is None:  # TRL's default: unset
                t.take(source, where)
                t.idle.append(_path(where, source))
            elif t.foreign(source, where) and target in known:
                t.put(f"TRL's {_path(where, source)}", target, t.take(source, where), where)
    answer_trl(t, [key for key, a in GRPO_CONFIG.items() if key.startswith("vllm_") and a.what != "rlcore"])
    _script_arguments(t)
    _model_config(t)
    _peft(t)
    _precision(t)
    _tool_iterations(t)
    if t.foreign("dtype") and "dtype" not in t.own:  # ModelConfig's dtype: every role's, as torch_dtype
        t.data.setdefault("torch_dtype", t.take("dtype"))
    if t.foreign("attn_implementation"):
        t.note("attn_implementation", t.take("attn_implementation"), "the engine picks its attention kernel "
               "(transformers' sdpa, vLLM's own); the result is the same", origin="TRL's")


# ModelConfig's keys of features rlcore does not build: (the value that asks for nothing, why it is refused otherwise)
NOT_BUILT = {
    "trust_remote_code": (False, "rlcore's engines load the architectures transformers and vLLM ship, never a model "
                          "repository's own code; use a model transformers supports"),
    "load_in_4bit": (False, "a 4-bit (bitsandbytes) base model is not built in rlcore; train LoRA on the model in "
                     "bfloat16 (use_peft, dtype: bfloat16) instead"),
    "load_in_8bit": (False, "an 8-bit (bitsandbytes) base model is not built in rlcore; train LoRA on the model in "
                     "bfloat16 (use_peft, dtype: bfloat16) instead"),
    "use_rslora": (False, "rank-stabilised LoRA is not built in rlcore (its LoRA scales by lora_alpha / lora_r)"),
    "use_dora": (False, "DoRA is not built in rlcore; use_peft trains plain LoRA"),
    "lora_target_parameters": (None, "LoRA on parameters (MoE experts) is not built in rlcore; its LoRA adapts the "
                               "modules lora_target_modules names"),
    "lora_modules_to_save": (None, "training whole modules beside LoRA is not built in rlcore; use_peft: false "
                             "trains every weight"),
    "lora_task_type": ("CAUSAL_LM", "rlcore's LoRA adapts causal language models only"),
}
QUANTISATION = ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")  # only with load_in_4bit
LORA = ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


def _script_arguments(t: Any) -> None:
    """TRL's ScriptArguments: `dataset_name` (a file, a folder, or a Hub dataset where the Hub answers or the cache
    has it) with `dataset_config` and `dataset_train_split` becomes `dataset`, the files of that split."""
    given = {key: t.take(key) for key in ("dataset_name", "dataset_config", "dataset_train_split") if t.foreign(key)}
    given = {key: value for key, value in given.items() if value is not None}  # TRL's defaults: nothing asked
    name, split = given.get("dataset_name"), given.get("dataset_train_split", "train")
    if name is not None and "dataset" not in t.own:
        t.refuse("dataset_name", "this algorithm reads no dataset; drop it")
    elif name is not None:
        try:
            files = split_files(str(name), given.get("dataset_config"), str(split))
        except ConfigError as exc:
            t.out.problems.extend(exc.problems or [("dataset_name", str(exc))])
        else:
            picked = "".join(f", {key} {given[key]!r}" for key in ("dataset_config", "dataset_train_split")
                             if key in given)
            t.put(f"TRL's dataset_name {name!r}{picked}", "dataset", files[0] if len(files) == 1 else files)
    else:
        for key in ("dataset_config", "dataset_train_split"):
            if key in given and not (key == "dataset_train_split" and given[key] == "train"):
                t.out.problems.append((key, f"({given[key]!r}) picks from TRL's dataset_name, which is not given; give "
                                       "dataset_name, or the split's file as dataset"))
    if t.foreign("dataset_test_split"):
        t.note("dataset_test_split", t.take("dataset_test_split"), "rlcore evaluates on no test split (gkd holds the "
               "dataset's last eval_size rows out)", origin="TRL's")
    for key in ("dataset_streaming", "streaming"):
        if t.foreign(key):
            if t.take(key):
                t.refuse(key, "rlcore reads a dataset's files whole, once per node, not as a stream; drop it")
            else:
                t.note(key, False, "rlcore reads the files whole", origin="TRL's")
    if t.foreign("ignore_bias_buffers"):
        if t.take("ignore_bias_buffers"):
            t.refuse("ignore_bias_buffers", "(true) is TRL's scripts' workaround for DDP with a model's boolean buffers, "
                     "which rlcore does not apply (its DDP broadcasts every buffer, as PyTorch's default); drop it")
        else:
            t.note("ignore_bias_buffers", False, "asks for nothing", origin="TRL's")
    for key, why in (("datasets", "TRL's dataset mixture is not read here; give dataset: [FILE, ...] (read one after "
                      "another)"),
                     ("test_split_size", "rlcore holds no test split out of the dataset (gkd: eval_size rows); "
                      "drop it")):
        if t.foreign(key):
            value = t.take(key)
            if value:
                t.refuse(key, why)
            else:
                t.note(key, value, "asks for nothing", origin="TRL's")


def _model_config(t: Any) -> None:
    """TRL's ModelConfig beyond the names RENAMES maps: what asks for nothing is noted, the rest refused with why."""
    if t.foreign("model_revision"):
        revision = t.take("model_revision")
        if revision in (None, "main"):
            t.note("model_revision", revision, "rlcore loads the model as it is on disk or the Hub's main",
                   origin="TRL's")
        else:
            t.refuse("model_revision", f"({revision!r}): rlcore loads a model's main revision; download that revision "
                     f"(`hf download MODEL --revision {revision} --local-dir DIR`) and give model: DIR")
    for key, (off, why) in NOT_BUILT.items():
        if t.foreign(key):
            value = t.take(key)
            if value == off or (off is None and not value):
                t.note(key, value, "asks for nothing rlcore does not do", origin="TRL's")
            else:
                t.refuse(key, f"({value!r}): {why}")
    for where in [None, "train"]:  # TRL's default, None: peft's modules for the architecture; rlcore's all-linear
        if (t.node(where) or {}).get("lora_target_modules", "") is None:
            t.take("lora_target_modules", where)
            t.note(_path(where, "lora_target_modules"), None, "LoRA adapts every linear layer (all-linear), as "
                   "rlcore's default", origin="TRL's")
    for key in QUANTISATION:
        if t.foreign(key):
            t.note(key, t.take(key), "quantisation options, without load_in_4bit", origin="TRL's")
    trains = "lora_rank" in t.own or any("lora_rank" in section.model_fields for section in t.sections.values())
    for key in LORA if not trains else ():
        if not t.foreign(key):
            continue
        value = t.take(key)
        if key == "use_peft" and value:
            t.refuse(key, "this algorithm trains no weights, so it has no LoRA; drop it")
        else:
            t.note(key, value, "this algorithm trains no weights", origin="TRL's")


def _tool_iterations(t: Any) -> None:
    """GRPOConfig's max_tool_calling_iterations (tool rounds after the first answer) is max_turns minus one."""
    if t.foreign("max_tool_calling_iterations") and "max_turns" in t.own:
        rounds = t.take("max_tool_calling_iterations")
        if rounds is not None:
            if not isinstance(rounds, int) or rounds < 0:
                raise ConfigError(f"max_tool_calling_iterations={rounds!r} must be an int >= 0",
                                  [("max_tool_calling_iterations", "must be an int >= 0")])
            t.put("TRL's max_tool_calling_iterations", "max_turns", rounds + 1)


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


def _trl_defaults(t: Any) -> None:
    """TRL's defaults that rlcore spells otherwise: `output_dir: null` (rlcore's default), `max_steps: -1` (train
    num_train_epochs, TRL's 3 where not given), `log_level: passive` (rlcore's default), `critical` (error)."""
    if "output_dir" in t.data and t.data["output_dir"] is None:
        t.take("output_dir")
        t.note("output_dir", None, "rlcore's default output_dir, output", origin="TRL's")
    if t.data.get("max_steps") == -1:
        t.take("max_steps")
        if "max_steps" not in t.own:  # sample, distill: no steps to count
            t.idle.append("max_steps")
        else:
            t.out.mapped.append("TRL's max_steps: -1 -> the steps of num_train_epochs")
        if "num_train_epochs" not in t.data and "max_steps" in t.own and "num_train_epochs" not in t.own:
            t.data["num_train_epochs"] = TRL_EPOCHS
    for key in ("activation_checkpointing", "vllm_importance_sampling_cap"):  # other names of keys TRL also sets
        if key in t.data and t.data[key] is None:
            t.take(key)
            t.idle.append(key)
    level = t.data.get("log_level")
    if level == "passive":
        t.take("log_level")
        t.note("log_level", level, "rlcore's default log_level, info", origin="TRL's")
    elif level in LOG_LEVELS:
        t.put(f"TRL's log_level: {level}", "log_level", LOG_LEVELS[t.take("log_level")])


def answer_trl(t: Any, keys: Iterable[str] | None = None, more: dict[str, dict[str, Answer]] | None = None) -> None:
    """Every key of TRL's configs (and of the tables in `more`: ms-swift's) left after the translation, or those of
    `keys`, as `rlcore.compat.trl_table` answers it: passed to the Hugging Face trainer (sft, pt), listed once as
    asking for nothing, or refused in one line naming it as TRL's (ms-swift's). Then a null rlcore has no use for
    (ms-swift's and TRL's spelling of "the default") is rlcore's default, said in the same line."""
    kind = ("sft" if "completion_only_loss" in t.own else "pt") if "trainer_kwargs" in t.own else None
    tables = {f"TRL's {owner}": table for owner, table in TABLES.items()}
    if keys is None:
        if t.data.get("top_k") == -1:  # ms-swift's (and vLLM's) "off"
            t.put("top_k: -1", "top_k", t.take("top_k") + 1)
        if t.data.get("data_range") == []:  # ms-swift's "every row"
            t.idle.append(f"data_range: {t.take('data_range')}")
        if t.data.get("resume") is False:  # ms-swift's "do not resume"
            t.idle.append(f"resume: {t.take('resume')}")
        if "data_seed" in t.data and t.data["data_seed"] == t.data.get("seed", SEED):  # the order seed gives
            t.idle.append(f"data_seed: {t.take('data_seed')}")
    answer_keys(t, {**tables, **(more or {})}, passed_to(kind) if kind else set(), keys, t.idle)
    if keys is not None:
        return
    for where in [None, *t.sections]:
        node, model = t.node(where), t.sections.get(where, t.model)
        for key in [k for k in (node if isinstance(node, dict) else ()) if node[k] is None and k in model.model_fields]:
            if not _takes_none(model.model_fields[key].annotation):
                node.pop(key)
                t.idle.append(f"{_path(where, key)}: null (rlcore's default)")
    if t.idle:
        t.out.noted.append(f"{', '.join(t.idle)}: at TRL's or ms-swift's defaults or without effect on the result, "
                           "these ask for nothing here (docs/migrating/ says why, key by key)")


def _takes_none(annotation: Any) -> bool:
    return annotation is None or annotation is type(None) or any(_takes_none(a) for a in get_args(annotation))


def answer_keys(t: Any, tables: dict[str, dict[str, Answer]], passed: set[str] = frozenset(),
                keys: Iterable[str] | None = None, idle: list[str] | None = None) -> list[str]:
    """Answer the foreign top-level keys of `t` (or those of `keys`) that `tables` ({"TRL's GRPOConfig": {key:
    Answer}}) hold: a key of `passed` goes to trainer_kwargs (sft, pt: the Hugging Face trainer's); one that asks
    for nothing joins `idle` (returned); any other is refused in one line naming its owner, with why."""
    idle = [] if idle is None else idle
    for key in [k for k in (list(t.data) if keys is None else keys) if t.foreign(k)]:
        answers = [(owner, table[key]) for owner, table in tables.items() if key in table]
        if not answers:
            continue
        value = t.data[key]
        asks_nothing = not value or any(a.what == "unless" and a.asks_nothing(value) for _, a in answers)
        if key in passed and not asks_nothing:  # the Hugging Face trainer's; a different trainer_kwargs value refused
            t.put(f"{answers[0][0]} {key}", key, t.take(key), "trainer_kwargs")
            continue
        t.take(key)
        if asks_nothing or any(a.what == "noted" for _, a in answers):
            idle.append(key)
            continue
        # a key of another algorithm says whose it is; else the first reason a value is refused for
        owner, first = next(((o, a) for o, a in answers if a.what == "rlcore"), answers[0])
        shown = "" if key in SECRET else f"({value!r}) "
        if first.what == "unless":
            t.refuse(key, f"{shown}is {owner} key: {first.why}")
        else:
            t.refuse(key, f"is {owner} key for {first.why}, which this algorithm does not have; drop it")
    return idle
