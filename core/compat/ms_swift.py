"""ms-swift's configuration keys, read as rlcore's, so an ms-swift YAML (`megatron rlhf --use_ray true`,
`swift sft`, `swift sample`) runs as it is.

`translate(data, model)` rewrites a config (a YAML file with its overrides applied) for the algorithm config
`model`. A `megatron rlhf` config (`rlhf_type` with Megatron's own keys: `micro_batch_size`, `train_iters`,
`tensor_model_parallel_size`, ...) trains on rlcore's megatron engine, with its LoRA, parallel sizes, recomputation
and schedule. Each ms-swift key that an algorithm does not have itself is either *mapped* onto the rlcore key that
means the same (`micro_batch_size` -> `per_device_train_batch_size`), *noted* when rlcore needs nothing for it
(a Megatron kernel fusion, an attention kernel, `deepspeed: zero3`, whose steps DDP takes too), or *refused*
with a one-line reason (`finetune: false`: rlcore continues its own runs with --resume). None is dropped without
a word: `rlcore run` prints the notes, and `rlcore config show --from-ms-swift FILE` prints the mapping above
the config it gives. A key the algorithm has itself keeps rlcore's meaning, so a native config comes back
unchanged. TRL's names are read first (`rlcore.compat.trl_names`).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ..config import _names_and_aliases, config_from_data, gpu_count, read_config_data
from ..runtime.resources import parse_ranks
from .ms_swift_data import dataset_ids, prompt_keys
from .ms_swift_schedule import Schedule, as_list
from .ms_swift_table import MS_SWIFT
from .trl_names import answer_keys, answer_trl, trl_keys

ALGORITHMS = {"grpo": "grpo", "gkd": "gkd"}  # rlhf_type -> rlcore algorithm
# Megatron kernel fusions and similar switches: how fast, never what is computed.
SPEED_ONLY = (
    "cross_entropy_loss_fusion", "gradient_accumulation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
    "bias_activation_fusion", "apply_rope_fusion",
)
TUNING = ("tuner_type", "train_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules",
          "target_modules", "recompute_granularity", "gradient_checkpointing", "torch_dtype")
MOVED_BY_TUNING = ("tuner_type", "train_type", "target_modules", "recompute_granularity")  # rewritten in train
ZERO_STAGES = ("zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")  # ms-swift's `deepspeed` names
# keys only Megatron's arguments have: with rlhf_type they mark a `megatron rlhf` config, which trains on Megatron
MEGATRON_ONLY = (
    "micro_batch_size", "global_batch_size", "train_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "expert_model_parallel_size", "context_parallel_size", "sequence_parallel", "recompute_granularity",
    "lr_warmup_fraction", "lr_warmup_iters", "lr_decay_style", "min_lr", "finetune",
)
MS_SWIFT_LORA_DROPOUT = 0.05  # ms-swift's lora_dropout default (Megatron's and transformers' tuners alike)
# ms-swift features rlcore does not have (its newer examples use them): refused with the reason, not "unknown"
NOT_BUILT = {
    "gym_env": "ms-swift's gym environments (its GYMScheduler and Env registry) are not built in rlcore; write the "
               "environment as an rlcore Environment and name it in multi_turn_scheduler (module:Class or file.py:Class)",
    "use_gym_env": "ms-swift's gym environments are not built in rlcore (see gym_env)",
}
# keys of one feature refused with it, in the first key's line: what does not run, once
NOT_BUILT_WITH = {"gym_env": ("use_gym_env",)}


@dataclass
class Translation:
    """What `translate` made of a config: the rlcore keys, and what it did with each ms-swift key."""

    data: dict[str, Any]
    mapped: list[str] = field(default_factory=list)  # "micro_batch_size: 2 -> per_device_train_batch_size: 2"
    noted: list[str] = field(default_factory=list)  # "attention_backend: flash (no effect here: ...)"
    problems: list[tuple[str, str]] = field(default_factory=list)  # refused keys, with the reason
    algorithm: str | None = None  # from rlhf_type
    use_ray: bool | None = None  # from use_ray


def translate(data: dict[str, Any], model: type[BaseModel]) -> Translation:
    """`data` with ms-swift's keys rewritten for `model` (see the module docstring)."""
    return _Translator(data, model).run()


def load_translated(
    model: type[BaseModel], path: str | os.PathLike | None = None, overrides: Iterable[str] = (), *, algorithm: str = "",
    source: str | None = None,
) -> tuple[BaseModel, Translation]:
    """`rlcore.config.load_config` for a file (and overrides) that may hold ms-swift's or TRL's keys: read, translated,
    then validated, every problem at once; with what the translation made of each key. Errors name `source`
    (default: `path`)."""
    data, problems, from_cli = read_config_data(path, overrides)
    translation = translate(data, model)
    config = config_from_data(model, translation.data, [*problems, *translation.problems], from_cli,
                              algorithm=algorithm, source=path if source is None else source)
    return config, translation


def launch_options(data: dict[str, Any]) -> tuple[str | None, bool | None, list[tuple[str, str]]]:
    """(algorithm from `rlhf_type`, `use_ray`, problems) of an ms-swift config, before its model is known."""
    problems = []
    kind = data.get("rlhf_type")
    algorithm = None
    if kind is not None:
        algorithm = ALGORITHMS.get(str(kind))
        if algorithm is None:
            problems.append(("rlhf_type", f"'{kind}' has no rlcore algorithm; rlcore runs rlhf_type "
                             f"{', '.join(ALGORITHMS)} (and sft, sample with --plugin)"))
    use_ray = data.get("use_ray")
    if use_ray is not None and not isinstance(use_ray, bool):
        problems.append(("use_ray", f"must be true or false; got {use_ray!r}"))
        use_ray = None
    return algorithm, use_ray, problems


def _section_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    info = model.model_fields.get(name)
    kind = getattr(info, "annotation", None)
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def _names(model: type[BaseModel] | None) -> set[str]:
    return _names_and_aliases(model) if model is not None else set()


def _path(section: str | None, key: str) -> str:
    return f"{section}.{key}" if section else key


class _Translator(Schedule):
    def __init__(self, data: dict[str, Any], model: type[BaseModel]):
        self.data = copy.deepcopy(data)
        self.model = model
        self.own = _names(model)
        self.sections = {n: m for n in model.model_fields if (m := _section_model(model, n)) is not None}
        self.out = Translation(self.data)
        self.batch_from_megatron = "global_batch_size" in self.data
        self.rlhf_type = self.data.get("rlhf_type")
        self.megatron = False  # a `megatron rlhf` config (see `engine`)
        self.idle: list[str] = []  # TRL's and ms-swift's keys that ask for nothing here, listed in one line

    # -- small verbs -------------------------------------------------------------------------------------

    def foreign(self, key: str, section: str | None = None) -> bool:
        """`key` is given (at the top or in `section`) and the algorithm does not have it there."""
        node = self.node(section)
        known = self.own if section is None else _names(self.sections.get(section))
        return isinstance(node, dict) and key in node and key not in known

    def node(self, section: str | None) -> Any:
        return self.data if section is None else self.data.get(section)

    def take(self, key: str, section: str | None = None) -> Any:
        return self.node(section).pop(key)

    def put(self, source: str, key: str, value: Any, section: str | None = None) -> None:
        """Set `key` (in `section`) from the ms-swift key `source`; a different value given there already
        is a problem naming both."""
        node = self.data.setdefault(section, {}) if section else self.data
        path = f"{section}.{key}" if section else key
        if not isinstance(node, dict):
            return
        if key in node and node[key] != value:
            self.refuse(source, f"means {path}: {value!r}, but {path} is {node[key]!r}; give one of them")
            return
        node[key] = value
        self.out.mapped.append(f"{source} -> {path}: {value!r}")

    def note(self, source: str, value: Any, why: str, origin: str = "ms-swift's") -> None:
        self.out.noted.append(f"{origin} {source}: {value!r} ({why})")

    def refuse(self, source: str, why: str) -> None:
        """`source` is refused for `why`; it leaves the config, so it is reported once."""
        section, _, key = source.rpartition(".")
        node = self.node(section or None)
        if isinstance(node, dict):
            node.pop(key, None)
        self.out.problems.append((source, why))

    # -- the families --------------------------------------------------------------------------------------

    def run(self) -> Translation:
        self.launch()
        trl_keys(self)
        self.role_sections()
        self.engine()
        self.tuning()
        self.parallelism()
        self.batch()
        self.schedule()
        self.vllm()
        self.dataset()
        self.sampling()
        self.sft()
        self.no_effect()
        prompt_keys(self)
        answer_trl(self, more={"ms-swift's": MS_SWIFT})
        return self.out

    def launch(self) -> None:
        algorithm, use_ray, problems = launch_options(self.data)
        self.out.algorithm, self.out.use_ray = algorithm, use_ray
        self.out.problems.extend(problems)
        for key, meaning in (("rlhf_type", "picks the algorithm"), ("use_ray", "means --use-ray")):
            if self.foreign(key):
                self.out.mapped.append(f"{key}: {self.take(key)!r} {meaning}")
        if self.foreign("ray_exp_name"):
            self.note("ray_exp_name", self.take("ray_exp_name"), "ms-swift prefixes its Ray actors' names with it; "
                      "rlcore's actors are named by role, in a Ray namespace of the run's own")

    def role_sections(self) -> None:
        """A role section's `output_dir` (ms-swift's Megatron roles have one) is the run's."""
        for name in self.sections:
            if self.foreign("output_dir", name):
                self.put(f"{name}.output_dir", "output_dir", self.take("output_dir", name))

    def engine(self) -> None:
        """ms-swift's `megatron rlhf` (rlhf_type with Megatron's keys) trains on Megatron: the train role's engine is
        megatron, unless the config names one."""
        nodes = [self.data, *(node for node in self.data.values() if isinstance(node, dict))]
        self.megatron = self.rlhf_type is not None and any(k in node for node in nodes for k in MEGATRON_ONLY)
        train = self.data.setdefault("train", {}) if self.megatron and "train" in self.sections else None
        if isinstance(train, dict) and "engine" not in train:
            train["engine"] = "megatron"
            self.out.mapped.append(f"rlhf_type: {self.rlhf_type!r} with Megatron's keys (megatron rlhf) -> "
                                   "train.engine: 'megatron'")

    def train_engine(self) -> str | None:
        train = self.data.get("train")
        return train.get("engine") if isinstance(train, dict) else None

    def tuning(self) -> None:
        """LoRA, recomputation and dtype: top-level keys where the algorithm has them there (sft), else the
        train section's (grpo, gkd), where ms-swift's Ray roles put them too."""
        where = "train" if "lora_rank" not in self.own and "train" in self.sections else None
        if where is not None:
            train = self.sections[where].model_fields
            moved = [k for k in TUNING if k != "torch_dtype" and (k in train or k in MOVED_BY_TUNING)]
            for key in (k for k in moved if self.foreign(k)):
                self.data.setdefault(where, {}).setdefault(key, self.take(key))
                self.out.mapped.append(f"{key} -> {where}.{key}")
        if self.foreign("train_type", where):  # ms-swift's older name of tuner_type
            self.node(where).setdefault("tuner_type", self.take("train_type", where))
        if self.foreign("tuner_type", where):
            tuner = self.take("tuner_type", where)
            node = self.node(where) or {}
            if tuner in ("lora", "lora_llm"):
                rank = node.get("lora_rank", 8)  # ms-swift's default rank
                self.put(f"tuner_type: {tuner}", "lora_rank", rank, where)
                dropout = (self.sections[where] if where else self.model).model_fields.get("lora_dropout")
                if dropout is not None and dropout.default != MS_SWIFT_LORA_DROPOUT and "lora_dropout" not in node:
                    self.put(f"tuner_type: {tuner} (ms-swift's default lora_dropout)", "lora_dropout",
                             MS_SWIFT_LORA_DROPOUT, where)
            elif tuner == "full":
                self.put("tuner_type: full", "lora_rank", 0, where)
            else:
                self.refuse("tuner_type", f"'{tuner}' is not built in rlcore; use lora (lora_rank) or full")
        if self.foreign("target_modules", where):
            self.put("target_modules", "lora_target_modules", self.take("target_modules", where), where)
        if self.foreign("recompute_granularity", where):
            granularity = self.take("recompute_granularity", where)
            self.put(f"recompute_granularity: {granularity}", "gradient_checkpointing", granularity != "none", where)
            if granularity == "selective":
                self.note("recompute_granularity", granularity, "Megatron recomputes the attention core only; rlcore's "
                          "engines recompute each whole layer: less memory, more time, the same result")
        self.dtype()

    def dtype(self) -> None:
        for where in [None, *self.sections]:
            if not self.foreign("torch_dtype", where):
                continue
            value = self.take("torch_dtype", where)
            if where is not None or "dtype" in self.own:
                self.put("torch_dtype", "dtype", value, where)
                continue
            for name, section in self.sections.items():  # every role's model loads in it, as in ms-swift
                if "dtype" in section.model_fields and "dtype" not in (self.data.get(name) or {}):
                    self.put("torch_dtype", "dtype", value, name)

    def parallelism(self) -> None:
        """Megatron's parallel sizes: tensor and pipeline are the train role's (at the top, as `megatron rlhf`
        without Ray takes them, too); expert parallelism is the megatron engine's option; context parallelism is
        not built."""
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if self.foreign(key) and "train" in self.sections:
                self.put(key, key, self.take(key), "train")
        for where in [None, *self.sections]:
            if self.foreign("expert_model_parallel_size", where):
                self.expert(_path(where, "expert_model_parallel_size"), self.take("expert_model_parallel_size", where),
                            where in (None, "train"))
            if self.foreign("context_parallel_size", where):
                size = self.take("context_parallel_size", where)
                if size == 1:
                    self.note(_path(where, "context_parallel_size"), size, "no context parallelism, as rlcore runs")
                else:
                    self.refuse(_path(where, "context_parallel_size"), f"is {size}, but context parallelism (a sequence "
                                "split over GPUs) is not built in rlcore's engines; use 1")
            if self.foreign("sequence_parallel", where):
                self.note(_path(where, "sequence_parallel"), self.take("sequence_parallel", where),
                          "Megatron's split of activations over tensor ranks saves memory only; the result is the same")

    def expert(self, path: str, size: Any, train: bool) -> None:
        """`expert_model_parallel_size`: the megatron train engine's option (its MoE layers check it)."""
        if size == 1:
            self.note(path, size, "no expert parallelism, megatron's default")
        elif train and self.train_engine() == "megatron":
            kwargs = self.data["train"].setdefault("engine_kwargs", {})
            kwargs.setdefault("expert_model_parallel_size", size)
            self.out.mapped.append(f"{path} -> train.engine_kwargs.expert_model_parallel_size: {size!r}")
        else:
            self.refuse(path, f"is {size}, but only the megatron train engine has expert parallelism (train.engine "
                        f"is {self.train_engine() or 'hf'!r}); use 1, or train.engine megatron")

    # -- vLLM ---------------------------------------------------------------------------------------------

    def vllm(self) -> None:
        servers = [key for key, a in MS_SWIFT.items() if key.startswith("vllm_server") and a.what != "rlcore"]
        answer_keys(self, {"ms-swift's": MS_SWIFT}, keys=servers, idle=self.idle)
        engines = [n for n in ("rollout", "sampler") if n in self.sections]
        if self.foreign("use_vllm"):
            use = self.take("use_vllm")
            for name in engines:
                self.put("use_vllm", "engine", "vllm" if use else "hf", name)
            teacher = self.data.get("teacher")
            served = isinstance(teacher, dict) and (gpu_count(teacher.get("gpus")) or teacher.get("model"))
            if "teacher" in self.sections and served:
                self.put("use_vllm", "engine", "vllm" if use else "hf", "teacher")  # ms-swift's served teacher is vLLM
        for key in [k for k in self.data if k.startswith("vllm_") and self.foreign(k)]:
            if engines:
                value = self.take(key)
                for name in engines:
                    self.data.setdefault(name, {}).setdefault(key, value)
                self.out.mapped.append(f"{key} -> {', '.join(f'{n}.{key}' for n in engines)}")
        for name in self.sections:
            section = self.data.get(name)
            if not isinstance(section, dict) or "vllm_engine_kwargs" not in self.sections[name].model_fields:
                continue
            for key in [k for k in section if k.startswith("vllm_") and self.foreign(k, name)]:
                value = section.pop(key)
                if key == "vllm_mode":
                    if value == "colocate":
                        self.note(f"{name}.vllm_mode", value, "roles share GPUs through colocate_groups")
                    else:
                        self.refuse(f"{name}.vllm_mode", f"'{value}': rlcore places vLLM as a role of the run (no "
                                    "external server); drop it")
                elif key.startswith("vllm_server"):
                    self.refuse(f"{name}.{key}", "rlcore places vLLM as a role of the run (no external server); "
                                "drop it")
                else:
                    kwargs = section["vllm_engine_kwargs"] = section.get("vllm_engine_kwargs") or {}
                    kwargs.setdefault(key.removeprefix("vllm_"), value)
                    self.out.mapped.append(f"{name}.{key} -> {name}.vllm_engine_kwargs.{key.removeprefix('vllm_')}")

    # -- data -----------------------------------------------------------------------------------------------

    def dataset(self) -> None:
        dataset_ids(self)
        given = self.data.get("dataset")
        kind = self.model.model_fields.get("dataset")
        if isinstance(given, list) and len(given) == 1:
            self.data["dataset"] = given[0]
            self.out.mapped.append(f"dataset: a list of one -> dataset: {given[0]!r}")
        elif isinstance(given, list) and kind is not None and "list" not in str(kind.annotation):
            self.refuse("dataset", f"lists {len(given)} datasets; this algorithm reads one file: join them")
        if self.foreign("split_dataset_ratio"):
            ratio = self.take("split_dataset_ratio")
            rows = self.rows()
            if not ratio:
                self.note("split_dataset_ratio", ratio, "no rows held out: every row trains, as rlcore does")
            elif "eval_size" in self.own and rows is not None:
                self.put(f"split_dataset_ratio: {ratio} of {rows} rows", "eval_size", max(1, round(ratio * rows)))
            else:
                self.refuse("split_dataset_ratio", f"({ratio}): rlcore trains on every row and holds none out "
                            "here; use 0, and a file of held-out rows of your own")
        if self.foreign("dataset_num_proc"):
            self.note("dataset_num_proc", self.take("dataset_num_proc"), "rlcore reads and tokenises local files "
                      "once per node")
        if self.foreign("load_from_cache_file"):
            self.note("load_from_cache_file", self.take("load_from_cache_file"), "rlcore reads the file each run")
        if self.foreign("max_length") and "max_prompt_length" in self.own:  # ms-swift's cap on the prompt
            self.put("max_length", "max_prompt_length", self.take("max_length"))
        system = self.data.get("system")
        if self.foreign("system") and system is not None:
            self.refuse("system", "is not a key of this algorithm: put the system message in the rows' messages")
        elif isinstance(system, str) and system.endswith(".txt"):  # ms-swift reads a .txt file's text
            try:
                self.data["system"] = Path(system).read_text(encoding="utf-8")
                self.out.mapped.append(f"system: {system!r} -> system: the file's text")
            except OSError as exc:
                self.refuse("system", f"names the file '{system}', which cannot be read ({exc.strerror})")

    def sampling(self) -> None:
        if "sampler" not in self.sections:
            return
        self.distill()
        engine = self.data.get("sampler_engine")
        if engine in ("pt", "transformers", "hf", "vllm"):  # pt, transformers: ms-swift's names of hf
            self.take("sampler_engine")
            self.put(f"sampler_engine: {engine!r} ->", "engine", "vllm" if engine == "vllm" else "hf", "sampler")
        elif engine in ("lmdeploy", "client", "no"):
            self.refuse("sampler_engine", f"'{engine}' is not built in rlcore; use vllm or hf (pt), or the distill "
                        "algorithm (--plugin distill) for an OpenAI-compatible endpoint")
        if self.foreign("num_sampling_batch_size"):
            self.put("num_sampling_batch_size", "batch_size", self.take("num_sampling_batch_size"))
        if self.foreign("num_sampling_per_gpu_batch_size"):
            per_gpu = self.take("num_sampling_per_gpu_batch_size")
            workers = self.sampler_workers()
            self.put(f"num_sampling_per_gpu_batch_size: {per_gpu} x {workers} sampler workers", "batch_size",
                     per_gpu * workers)
        if self.data.get("orm_model") == "math":
            self.data["orm_model"] = "accuracy"
            self.out.mapped.append("orm_model: 'math' -> orm_model: 'accuracy' (math-verify against `solution`)")
        if self.foreign("override_exist_file"):
            self.note("override_exist_file", self.take("override_exist_file"), "rlcore never overwrites a finished "
                      "output: a fresh run into an output_dir that holds one stops and says so; --resume continues it")
        if self.foreign("load_args"):
            load = self.take("load_args")
            self.note("load_args", load, "rlcore reads no args.json beside a checkpoint: the config's keys are what "
                      "runs")

    def distill(self) -> None:
        """ms-swift's `sampler_type: distill` with `sampler_engine: client`: the distill algorithm, whose teacher is
        the endpoint that `engine_kwargs.base_url` names (ms-swift's client engine, OpenAI-compatible)."""
        if "api_base" not in self.own:  # not the distill algorithm
            if self.data.get("sampler_type") == "distill":
                self.refuse("sampler_type", "'distill' is rlcore's distill algorithm: run it with --plugin distill")
            return
        if self.foreign("sampler_type"):
            kind = self.take("sampler_type")
            if kind == "distill":
                self.out.mapped.append("sampler_type: 'distill' is this algorithm")
            else:
                self.out.problems.append(("sampler_type", f"{kind!r} is not distillation: run it with --plugin sample"))
        if self.data.get("sampler_engine") == "client":
            self.take("sampler_engine")
            self.out.mapped.append("sampler_engine: 'client' -> the teacher is the endpoint api_base names")
        kwargs = self.data.get("engine_kwargs")
        if self.foreign("engine_kwargs"):
            kwargs = self.take("engine_kwargs")
            try:
                kwargs = json.loads(kwargs) if isinstance(kwargs, str) else kwargs
            except ValueError:
                self.out.problems.append(("engine_kwargs", f"{kwargs!r} is not JSON (ms-swift passes it to its client)"))
                return
            if not isinstance(kwargs, dict):
                self.out.problems.append(("engine_kwargs", f"{kwargs!r} is not a mapping of client options"))
                return
            if "base_url" in kwargs:
                self.put("engine_kwargs.base_url", "api_base", kwargs.pop("base_url"))
            if "api_key" in kwargs:  # never echoed: the value is a secret
                self.data.setdefault("api_key", kwargs.pop("api_key"))
                self.out.mapped.append("engine_kwargs.api_key -> api_key")
            for key in sorted(kwargs):
                self.out.problems.append((f"engine_kwargs.{key}", "is not an option of rlcore's endpoint client; "
                                          "it takes api_base, api_key, max_concurrency, request_timeout_s"))
        if self.foreign("stream"):
            self.note("stream", self.take("stream"), "rlcore asks for whole responses; the responses are the same")
        groups = self.data.get("device_groups")
        for name, spec in list(groups.items()) if isinstance(groups, dict) else []:
            workers = spec.get("workers") if isinstance(spec, dict) else None
            if isinstance(workers, list) and "sampler" in workers:  # ms-swift's client sampler: the endpoint here
                spec["workers"] = [w for w in workers if w != "sampler"]
                if not spec["workers"]:
                    del groups[name]
                self.out.mapped.append(f"device_groups.{name}: its sampler worker is the endpoint api_base names"
                                       + ("" if spec["workers"] else " (the group is left out)"))

    def sampler_workers(self) -> int:
        for spec in (self.data.get("device_groups") or {}).values():
            if isinstance(spec, dict) and "sampler" in as_list(spec.get("workers")):
                try:
                    ranks = parse_ranks(spec.get("ranks"))
                except ValueError:
                    return 1
                return ranks if isinstance(ranks, int) else len(ranks)
        section = self.data.get("sampler") or {}
        return gpu_count(section.get("gpus")) or section.get("cpus", 1)

    def sft(self) -> None:
        if self.foreign("deepspeed") and self.data["deepspeed"] is not None:  # TRL's default: none
            stage = self.take("deepspeed")
            if stage in ZERO_STAGES:  # where the state lives, not what is computed: DDP runs the same steps
                self.note("deepspeed", stage, "not used: rlcore trains every worker with DDP (NCCL; gloo on the CPU), "
                          "the same steps with the whole model, gradients and optimizer state on each GPU; if that "
                          "does not fit, set lora_rank, gradient_checkpointing or bf16")
            else:
                self.refuse("deepspeed", f"({stage!r}): a DeepSpeed config file may set the optimizer, schedule and "
                            "precision, which rlcore would not read; drop it and give those as keys (rlcore trains "
                            "with DDP; ms-swift's zero0-zero3 names are accepted with a notice)")
        for key in ("model_name", "model_author"):
            if self.foreign(key) and self.data[key] is not None:
                self.refuse(key, f"({self.take(key)!r}) fills ms-swift's self-cognition placeholders, which rlcore "
                            "does for sft only; write the name into your rows")
        for key in ("per_device_eval_batch_size", "eval_steps"):
            if self.foreign(key):
                value = self.take(key)
                if "eval_size" not in self.data:
                    self.note(key, value, "no evaluation: split_dataset_ratio holds out no rows")
                else:
                    self.refuse(key, "this algorithm has no evaluation loop; drop it")

    def no_effect(self) -> None:
        for key in ("attention_backend", "attn_impl"):
            if self.foreign(key):
                self.note(key, self.take(key), "the engine picks its attention kernel (transformers' sdpa, vLLM's "
                          "own); the result is the same")
        if self.foreign("padding_free"):
            self.note("padding_free", self.take("padding_free"), "the hf train engine packs rows only where a variable-"
                      "length attention kernel makes it faster (train.padding_free), the megatron engine pads them; the "
                      "loss is the same")
        for key in SPEED_ONLY:
            if self.foreign(key):
                self.note(key, self.take(key), "a Megatron kernel fusion: speed only")
        if self.foreign("log_rollout_offpolicy_metrics"):
            self.note("log_rollout_offpolicy_metrics", self.take("log_rollout_offpolicy_metrics"),
                      "rlcore always logs sampling/* off-policy metrics")
        if self.foreign("finetune"):
            finetune = self.take("finetune")
            if finetune:
                self.note("finetune", finetune, "rlcore starts from the model's weights with a fresh optimizer at "
                          "step 0; --resume continues a run of its own")
            else:
                self.refuse("finetune", "false continues a Megatron checkpoint's iteration and optimizer; rlcore "
                            "continues its own runs with --resume")
        for key in ("no_save_optim", "no_save_rng"):
            if self.foreign(key):
                self.note(key, self.take(key), "rlcore's checkpoints keep optimizer and RNG state so that --resume "
                          "continues exactly")
        if self.foreign("overlong_filter"):
            self.put("overlong_filter", "mask_truncated_completions", self.take("overlong_filter"))
        if self.foreign("external_plugins") and self.data["external_plugins"]:
            self.refuse("external_plugins", "ms-swift plugin files register with ms-swift; in rlcore name a reward "
                        "as module:function in reward_funcs, or load a plugin with --with FILE")
        if self.foreign("dataloader_num_workers"):
            self.note("dataloader_num_workers", self.take("dataloader_num_workers"), "the driver reads the prompts; "
                      "speed only")
        if self.foreign("log_completions"):
            self.note("log_completions", self.take("log_completions"), "rlcore logs each step's metrics "
                      "(metrics.jsonl), not the completions' text")
        for key, why in NOT_BUILT.items():
            if not self.foreign(key):
                continue
            value = self.take(key)
            if not value:  # ms-swift's default: nothing asked
                self.idle.append(key)
                continue
            along = [k for k in NOT_BUILT_WITH.get(key, ()) if self.foreign(k)]
            for companion in along:
                self.take(companion)
            self.refuse(key, f"{value!r}" + (f" (with {', '.join(along)})" if along else "") + f": {why}")
