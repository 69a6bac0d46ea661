"""What every engine checks and shares, whichever library it wraps: its model, dtype and device options
(all problems at once, before a weight is read), the device a worker's "cuda" means, and the alignment of
per-token rows with `input_ids`. Imports torch only inside the functions that need it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, RlcoreError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16", "auto")


def common_problems(model: str, dtype: str, device: str) -> list[tuple[str, str]]:
    """(key, message) for every bad model/dtype/device option, found before any weight is read."""
    problems = []
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        problems.append(("model", f"model={model!r} must be a local directory or a Hugging Face hub id"))
    elif _looks_like_path(str(model)) and not Path(model).expanduser().is_dir():
        problems.append(("model", f"model={str(model)!r} is not a directory; build one with build_tiny_model"))
    if dtype not in DTYPES:
        problems.append(("dtype", f"dtype={dtype!r} is not one of {', '.join(DTYPES)}"))
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        problems.append(("device", f"device={device!r} must be 'cpu' or 'cuda' (optionally 'cuda:N')"))
    elif device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            problems.append(("device", f"device={device!r} was asked but CUDA is not available here; give the role no "
                             "GPUs (drop its `gpus`, or its device group's GPU ranks) so that it runs on the CPU, or "
                             "run where a GPU is visible"))
    return problems


def checkpoint_dtype(model: str | os.PathLike) -> str | None:
    """The dtype a checkpoint's config.json says its weights are in (`dtype`, or transformers 4's `torch_dtype`;
    a multimodal model's `text_config`'s), read without loading anything: from a local directory, or from the
    Hugging Face cache for a hub id (no download). None where it says nothing or cannot be read."""
    path = _local_config(model)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        value = section.get("dtype") or section.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def _local_config(model: str | os.PathLike) -> Path | None:
    """A model's config.json on this machine: in its directory, or in the Hugging Face cache for a hub id (no
    download); None where there is none."""
    path = Path(str(model)).expanduser() / "config.json"
    if path.is_file():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model), "config.json")
    except Exception:  # no huggingface_hub, or not a repo id: nothing to read
        return None
    return Path(cached) if isinstance(cached, str) else None


def tied_embeddings(model: str | os.PathLike) -> bool | None:
    """Whether `model` ties its LM head to its input embedding (transformers' `tie_word_embeddings`, the config
    class's default where config.json says nothing), read from the local config.json alone; None where there is
    none, or transformers cannot read it."""
    path = _local_config(model)
    if path is None:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent))
    except (OSError, ValueError, KeyError):
        return None
    return bool(getattr(config, "tie_word_embeddings", False))


HEAD_NAMES = ("lm_head", "output_layer")  # the LM head: transformers' name, megatron's


def names_lm_head(targets: Any) -> bool:
    """Whether `lora_target_modules` puts an adapter on the LM head: a list entry that is its name (`lm_head`, or
    megatron's `output_layer`) or ends in `.lm_head`, or a pattern that matches `lm_head` whole (peft's rule for a
    string); `all-linear` leaves the head out."""
    import re

    if isinstance(targets, str):
        if targets == "all-linear":
            return False
        try:
            return re.fullmatch(targets, HEAD_NAMES[0]) is not None
        except re.error:
            return False
    return isinstance(targets, (list, tuple, set)) and any(
        isinstance(t, str) and (t in HEAD_NAMES or t.endswith(f".{HEAD_NAMES[0]}")) for t in targets)


def tied_head_problems(model: str | os.PathLike, names_head: bool, tied: bool | None = None) -> list[tuple[str, str]]:
    """The problem with a LoRA adapter on the LM head (`names_head`: `lora_target_modules` names it) of a model whose
    head is its input embedding (`tied`; None: `tied_embeddings(model)`), in one line with the fix; else none.
    Merged, such an adapter would change the embedding too, and the weight sync sends the one tied tensor
    (embed_tokens.weight) without it, so the rollout engine would sample from other weights than those trained."""
    if not names_head or not (tied if tied is not None else tied_embeddings(model)):
        return []
    return [("lora_target_modules", f"lora_target_modules names lm_head, but {model} ties it to the input embedding "
             "(tie_word_embeddings): merged, its adapter would change the embedding too, and the weight sync cannot "
             "send it as a tensor of its own; drop lm_head from lora_target_modules, or use a checkpoint with "
             "tie_word_embeddings false")]


def resolve_dtype(dtype: str, model: str | os.PathLike, cuda: bool) -> str:
    """What `dtype` means for `model` on this device: a named dtype as it is; `auto` on a GPU is the checkpoint's
    own half precision (bfloat16 or float16), bfloat16 where it was saved in float32 or says nothing (TRL's and
    ms-swift's choice); `auto` on the CPU is float32, where half precision is slow and inexact."""
    if dtype != "auto":
        return dtype
    if not cuda:
        return "float32"
    saved = checkpoint_dtype(model)
    return saved if saved in ("bfloat16", "float16") else "bfloat16"


def raise_problems(engine: str, problems: list[tuple[str, str]]) -> None:
    """One ConfigError listing every problem, each with its option name."""
    if problems:
        raise ConfigError(f"{engine}: " + "; ".join(m for _, m in problems), problems)


def _looks_like_path(model: str) -> bool:
    """A hub id is `name` or `org/name`; anything else is meant as a local directory."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or Path(model).exists()


def resolve_device(device: str, visible: int, local_rank: str | int | None) -> str:
    """The device `device` names, with an explicit index for CUDA ("cuda" -> "cuda:N"), given how many GPUs
    this process sees and its LOCAL_RANK.

    "cuda" is this worker's GPU: the only one it sees (Ray gives each actor its own GPU through
    CUDA_VISIBLE_DEVICES, so that is index 0 whatever LOCAL_RANK is), or LOCAL_RANK's when it sees several
    (torchrun: one process per GPU of the node). torch needs the index: `set_device("cuda")` raises.
    """
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    if visible < 1:
        raise ConfigError(f"device={device!r}: no CUDA device is visible to this process; give the role no GPUs (drop "
                          "its `gpus`, or its device group's GPU ranks) so that it runs on the CPU, or make a GPU visible "
                          "(CUDA_VISIBLE_DEVICES)", [("device", "no CUDA device")])
    if index:
        if int(index) >= visible:
            raise ConfigError(f"device={device!r}: this process sees {visible} GPU(s), cuda:0..cuda:{visible - 1}", [("device", "no such GPU")])
        return device
    rank = int(local_rank) if local_rank not in (None, "") else 0
    if visible == 1:
        return "cuda:0"
    if not 0 <= rank < visible:
        raise ConfigError(
            f"device='cuda' with LOCAL_RANK={rank}, but this process sees {visible} GPUs (cuda:0..cuda:{visible - 1}); "
            "give each worker its own GPU (CUDA_VISIBLE_DEVICES) or name one, e.g. device='cuda:0'",
            [("device", "ambiguous GPU")],
        )
    return f"cuda:{rank}"


def torch_device(device: str) -> torch.device:
    """`device` as a torch.device, a CUDA one always with its index (see `resolve_device`)."""
    import torch

    visible = torch.cuda.device_count() if device.startswith("cuda") else 0
    return torch.device(resolve_device(device, visible, os.environ.get("LOCAL_RANK")))


def aligned_rows(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, T-1, ...] values (position t-1 predicts token t) as [B, T, ...] rows aligned with input_ids, 0 where
    `valid` [B, T] is False (row 0, padding); one copy: for full-vocabulary log-probs each copy is [B, T, V]."""
    out = values.new_zeros(values.shape[0], values.shape[1] + 1, *values.shape[2:])
    out[:, 1:] = values
    return out.masked_fill_(~valid.view(*valid.shape, *(1,) * (values.dim() - 2)), 0)


def check_ids(ids: torch.Tensor, input_ids: torch.Tensor) -> None:
    """`ModelOutputs.logprobs_at`'s argument must be [B, T, k] over the micro-batch's [B, T]."""
    if ids.dim() != 3 or tuple(ids.shape[:2]) != tuple(input_ids.shape):
        raise RlcoreError(
            f"logprobs_at: ids must be [B, T, k] with [B, T] = {list(input_ids.shape)} (the micro-batch's "
            f"input_ids), got {list(ids.shape)}"
        )


def check_temperature(temperature: float) -> None:
    """Reject a temperature the logits cannot be divided by (0, negative or NaN)."""
    if not temperature > 0:
        raise RlcoreError(f"temperature={temperature!r} must be > 0")


def check_train_step(engine: str, forward_only: bool, micro_batch_size: int, temperature: float) -> None:
    """What a train engine's `train_step` refuses before touching the batch: a forward-only engine (`engine`
    names it, "hf"), a bad micro-batch size or temperature."""
    if forward_only:
        raise RlcoreError(
            f"train_step on a forward-only {engine} engine (kind 'forward': a reference or teacher model, built "
            "without optimizer); build the engine with kind 'train' to train it"
        )
    check_temperature(temperature)
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise RlcoreError(f"train_step: micro_batch_size={micro_batch_size!r} must be a positive int")


def installed_version(package: str) -> tuple[int, int] | None:
    """(major, minor) of an installed distribution, read from its metadata without importing it (a choice that
    depends on a version costs `plan` and `validate` no import); None where it is not installed or not numbered so."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(part) for part in version(package).split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return None
    return major, minor

