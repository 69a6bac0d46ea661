"""What the megatron engine needs around megatron-core: option checks, reading a Hugging Face checkpoint, the
group's torch.distributed world, batch columns, moving optimizer state, and checkpoint directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore import ConfigError, RlcoreError
from rlcore.engines import OptimizerOptions, TrainOptions, tied_head_problems

DECAY_STYLES = {"constant": "constant", "constant_with_warmup": "constant", "cosine": "cosine", "linear": "linear"}


@dataclass(frozen=True)
class MegatronOptions(TrainOptions):
    """The train engines' options plus megatron's parallel layout and optimizer sharding."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # a MoE model's experts split over this many ranks of the data-parallel group (megatron's expert parallelism)
    expert_model_parallel_size: int = 1
    make_vocab_size_divisible_by: int = 128
    use_distributed_optimizer: bool = True
    # fp32 main params, fp32 gradients and fp32 Adam moments beside the bf16 model (megatron's mixed precision:
    # 18 bytes a parameter); false: AdamW on the bf16 params themselves with bf16 gradients and moments, as the hf
    # engine trains (8 bytes a parameter). With dtype bfloat16 (float32: no effect), use_distributed_optimizer
    # false and tensor and pipeline size 1 (see adamw.TorchAdamW).
    master_weights: bool = True
    # tensor size 1: the model returns its last hidden states and the output layer is applied in chunks of positions
    # (the hf engine's `HeadModelOutputs`: TRL's chunked log-prob kernel on CUDA), so no [B, T, V] logits exist for
    # a loss that does not ask for the full vocabulary; false, or tensor parallel: the vocab-parallel ops over the
    # output layer's logits
    chunked_lm_head: bool = True


def option_problems(o: dict[str, Any]) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            problems.append((key, f"{key}={o[key]!r} {rule}"))

    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                "logprob_micro_batch_size", "make_vocab_size_divisible_by"):
        need(isinstance(o[key], int) and o[key] >= 1, key, "must be a positive int")
    if o["lora_rank"]:
        from .lora import target_problems

        problems += target_problems(o["lora_target_modules"])
    # megatron's token dispatchers exchange tokens over the expert group in every MoE layer, so its ranks would need
    # micro-batches of one shape and count; the engine's data-parallel ranks trim their own padding and chunk alike
    need(o["expert_model_parallel_size"] == 1, "expert_model_parallel_size",
         "must be 1: expert parallelism is not built yet (each rank holds every expert; tensor parallelism splits them)")
    problems += OptimizerOptions(**{k: o[k] for k in OptimizerOptions.keys()}).problems()
    need(o["dist_timeout_s"] > 0, "dist_timeout_s", "must be > 0")
    if not o["master_weights"]:
        need(o["dtype"] != "float16", "master_weights",
             "needs dtype bfloat16 (or float32, which has no master copy to drop): fp16 needs fp32 master weights "
             "and a loss scale")
        need(not o["use_distributed_optimizer"], "master_weights",
             "needs use_distributed_optimizer=false too (megatron's distributed optimizer always keeps fp32 main params)")
        need(o["tensor_model_parallel_size"] == 1 and o["pipeline_model_parallel_size"] == 1, "master_weights",
             "needs tensor_model_parallel_size and pipeline_model_parallel_size 1 (its gradient norm is not "
             "reduced over a model-parallel group); data parallelism is fine")
    if isinstance(o["device"], str) and o["device"].startswith("cpu"):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        need(o["dtype"] in ("float32", "auto"), "dtype", "must be float32 on the CPU (bf16 and fp16 need CUDA)")
        need(o["tensor_model_parallel_size"] == 1, "tensor_model_parallel_size", "must be 1 on the CPU")
        need(o["pipeline_model_parallel_size"] == 1, "pipeline_model_parallel_size", "must be 1 on the CPU")
        need(not o["gradient_checkpointing"], "gradient_checkpointing", "needs CUDA with the megatron engine")
        if world != 1:
            problems.append(("device", f"the megatron engine runs one worker on the CPU, but WORLD_SIZE={world}; "
                                       "use GPUs, or engine hf for CPU data parallelism"))
    return problems


def model_problems(o: dict[str, Any], world_size: int | None) -> tuple[Any, list[tuple[str, str]]]:
    """The model's `mapping.ModelSpec` (None where it has none) and what keeps it from this engine: an architecture
    without a mapping, a configuration the mapping refuses, parallel sizes that do not divide it (over `world_size`
    workers; None: not known yet), a LoRA adapter on an output layer tied to the embedding. Reads the config.json
    only: no weights, no device."""
    from . import mapping
    from .lora import OUTPUT_LAYER, megatron_targets, target_problems

    try:
        spec = mapping.spec_from_hf_config(hf_config(o["model"]))
    except ConfigError as exc:
        return None, list(exc.problems or [("model", str(exc))])
    problems = []
    if o.get("lora_rank") and not target_problems(o["lora_target_modules"]):
        head = OUTPUT_LAYER in megatron_targets(o["lora_target_modules"])
        problems += tied_head_problems(o["model"], head, spec.tied)
    sizes = [o.get(k, 1) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")]
    if not all(isinstance(n, int) and n >= 1 for n in sizes):
        return spec, problems  # option_problems names them
    return spec, problems + mapping.parallel_problems(spec, *sizes[:2], world_size, ep=sizes[2])


def torch_dtype(dtype: str, model: str, cuda: bool) -> Any:
    """The torch dtype of the model's weights (`auto`: the checkpoint's half precision on a GPU, float32 on the
    CPU); with bf16/fp16 the optimizer keeps fp32 main parameters (`master_weights`), as ms-swift trains."""
    import torch

    from rlcore.engines import resolve_dtype

    return getattr(torch, resolve_dtype(dtype, model, cuda))


def model_dir(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors"]))


def hf_config(model: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.path.expanduser(str(model)))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model={str(model)!r} could not be loaded: {exc}", [("model", str(exc))]) from exc


class SafetensorsReader:
    """A Hugging Face checkpoint's tensors by name, read from its safetensors files only when asked. A causal LM's
    names find a conditional-generation checkpoint's language model (`model.layers.0.x` reads
    `model.language_model.layers.0.x`: `rlcore.engines.CheckpointLayout`)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        from rlcore.engines import checkpoint_layout

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise RlcoreError(f"'{directory}' holds no *.safetensors weights")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {name: h for h in self.handles for name in h.keys()}
        self.directory = directory
        self.layout = checkpoint_layout(directory)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handles.clear()

    def __getitem__(self, name: str) -> Any:
        if self.layout is not None:
            name = self.layout.to_checkpoint(name)
        if name not in self.where:
            raise RlcoreError(f"'{self.directory}' has no weight '{name}' that the megatron mapping needs")
        return self.where[name].get_tensor(name)


class HostOffload:
    """Device memory moved to (pinned) host memory and back, a storage at a time.

    Every tensor (a parameter, one of megatron's views into its contiguous DDP buffers, an fp32 main param or an
    Adam moment) keeps its identity: the storage under it is copied to host memory and resized to zero bytes,
    later resized back and refilled. Views into a storage (megatron's `main_grad`, the distributed optimizer's
    shards of the param buffer, an fp32 param that is also its own main param) need no care of their own, and
    a storage two holders share is moved once. Host copies are kept for the next offload (pinning is slow).
    `device_type="cpu"` moves CPU storages into plain host buffers: the same bookkeeping, for tests.
    """

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self.host: dict[int, Any] = {}  # StorageImpl address -> its host copy
        self.away: dict[str, list[tuple[Any, int, Any]]] = {}  # what -> (storage, bytes, host copy or None)

    def offload(self, what: str, tensors: Any, keep: bool = True, skip: Any = ()) -> None:
        """The storages under `tensors`, except those under `skip` or already away, to host memory (`keep=False`:
        dropped, to come back as zeros), freeing their device memory."""
        if what in self.away:
            return
        taken = {key for entries in self.away.values() for key in (s._cdata for s, _, _ in entries)}
        taken |= storages_of(skip, self.device_type).keys()
        storages = {k: s for k, s in storages_of(tensors, self.device_type).items() if k not in taken}
        entries = []
        for key, storage in storages.items():
            host = None
            if keep:
                host = self.host.get(key)
                if host is None or host.numel() != storage.nbytes():
                    host = self.host[key] = torch_empty_host(storage.nbytes(), pin=self.device_type == "cuda")
                host.copy_(_bytes(storage), non_blocking=True)
            entries.append((storage, storage.nbytes(), host))
        if entries:
            self._synchronize()  # the copies are done before the memory is handed back
        for storage, _, _ in entries:
            storage.resize_(0)
        self.away[what] = entries

    def reload(self, what: str) -> None:
        """What `offload(what, ...)` emptied, back in place: bitwise, or zeros where it was dropped."""
        entries = self.away.pop(what, [])
        for storage, nbytes, host in entries:
            storage.resize_(nbytes)
            if host is None:
                _bytes(storage).zero_()
            else:
                _bytes(storage).copy_(host, non_blocking=True)
        if entries:
            self._synchronize()

    def _synchronize(self) -> None:
        if self.device_type == "cuda":
            import torch

            torch.cuda.synchronize()

    def __contains__(self, what: str) -> bool:
        return what in self.away


def storages_of(tensors: Any, device_type: str) -> dict[int, Any]:
    """The non-empty storages under `tensors` on `device_type`, each once (by StorageImpl, however many views)."""
    found: dict[int, Any] = {}
    for t in tensors:
        if t is not None and t.device.type == device_type:
            storage = t.untyped_storage()
            if storage.nbytes():
                found.setdefault(storage._cdata, storage)
    return found


def torch_empty_host(nbytes: int, pin: bool) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _bytes(storage: Any) -> Any:
    """A uint8 tensor over the whole of `storage`."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def move_optimizer(optimizer: Any, device: Any) -> None:
    """An inner torch optimizer's params (megatron's fp32 main params) and state tensors to `device`."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.data = p.data.to(device, non_blocking=True)
    for state in optimizer.state.values():
        for key, value in state.items():
            if hasattr(value, "to") and key != "step":
                state[key] = value.to(device, non_blocking=True)


def copy_model_files(source: Path, target: Path) -> None:
    """The config, generation config and tokenizer files beside the weights, so transformers loads the directory."""
    for file in source.iterdir():
        if file.is_file() and file.suffix in (".json", ".txt", ".model", ".jinja") and not file.name.endswith(".index.json"):
            shutil.copy2(file, target / file.name)


def shared_tmp(path: Path, rank: int, world_size: int) -> Path:
    """A temporary directory beside `path` that rank 0 makes and every rank of the group writes into."""
    import torch

    box = [None]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        box = [tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)]
    if world_size > 1:
        torch.distributed.broadcast_object_list(box, 0)
    return Path(box[0])
