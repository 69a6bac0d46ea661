"""What both Hugging Face engines share: option checks, the device, model loading, and the model outputs
a loss reads (per-token, at given ids, full vocabulary, top-k)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.engines import ModelOutputs, TopK
from rlcore.errors import ConfigError, RlcoreError

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
            problems.append(("device", f"device={device!r} was asked but CUDA is not available; use device='cpu'"))
    return problems


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
        raise ConfigError(f"device={device!r}: no CUDA device is visible to this process; use device='cpu'", [("device", "no CUDA device")])
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


def load_causal_lm(model: str, dtype: str, device: torch.device) -> Any:
    """AutoModelForCausalLM from a local directory or a hub id, on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    try:
        lm = AutoModelForCausalLM.from_pretrained(os.path.expanduser(str(model)), dtype=dtype)
    except OSError as exc:
        raise ConfigError(f"model={str(model)!r} could not be loaded: {exc}", [("model", str(exc))]) from exc
    return lm.to(device).eval()


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


class HFModelOutputs(ModelOutputs):
    """`ModelOutputs` from a causal LM's logits [B, T, V]: log-softmax at `temperature` in float32, each result
    computed once. `logprobs` and `logprobs_at` take the normaliser one row at a time and gather, so they
    never build the [B, T, V] log-probs that `full_logprobs` is."""

    def __init__(self, logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0):
        self.next_logits = logits[:, :-1]  # position t-1 predicts token t
        self.input_ids = input_ids
        self.valid = attention_mask.bool().clone()  # rows that hold a distribution: not row 0, not padding
        self.valid[:, 0] = False
        self.temperature = temperature
        self._cache: dict[str, torch.Tensor] = {}

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return logits / self.temperature if self.temperature != 1.0 else logits

    def _normaliser(self) -> torch.Tensor:
        """logsumexp of the scaled logits, [B, T-1]."""
        import torch

        if "lse" not in self._cache:
            self._cache["lse"] = torch.stack([torch.logsumexp(self._scaled(row), dim=-1) for row in self.next_logits])
        return self._cache["lse"]

    def _aligned(self, values: torch.Tensor) -> torch.Tensor:
        return aligned_rows(values, self.valid)

    def logprobs(self) -> torch.Tensor:
        if "logprobs" not in self._cache:
            picked = self.next_logits.gather(-1, self.input_ids[:, 1:, None]).squeeze(-1)
            self._cache["logprobs"] = self._aligned(self._scaled(picked) - self._normaliser())
        return self._cache["logprobs"]

    def logprobs_at(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.input_ids)
        ids = ids[:, 1:].to(self.next_logits.device, non_blocking=True).long()
        picked = self.next_logits.gather(-1, ids)
        return self._aligned(self._scaled(picked) - self._normaliser()[..., None])

    def full_logprobs(self) -> torch.Tensor:
        import torch

        if "full" not in self._cache:
            self._cache["full"] = self._aligned(torch.log_softmax(self._scaled(self.next_logits), dim=-1))
        return self._cache["full"]

    def topk(self, k: int) -> TopK:
        """The k most likely tokens of every row, in `TopK`'s layout (ids 0 where a row holds no distribution)."""
        top = self.full_logprobs().topk(min(k, self.next_logits.shape[-1]), dim=-1)
        return TopK(ids=top.indices.masked_fill(~self.valid[..., None], 0), logprobs=top.values)


def model_outputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0) -> HFModelOutputs:
    """One forward pass of `model` (differentiable when grad is on) as `HFModelOutputs`."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return HFModelOutputs(logits, input_ids, attention_mask, temperature)


def check_temperature(temperature: float) -> None:
    """Reject a temperature the logits cannot be divided by (0, negative or NaN)."""
    if not temperature > 0:
        raise RlcoreError(f"temperature={temperature!r} must be > 0")
