"""What both Hugging Face engines share: option checks, model loading and memory-lean token log-probs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def torch_device(device: str) -> torch.device:
    """`cuda` means this worker's GPU: LOCAL_RANK's when several are visible, else the only one."""
    import torch

    if device == "cuda" and torch.cuda.device_count() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device)


def load_causal_lm(model: str, dtype: str, device: torch.device) -> Any:
    """AutoModelForCausalLM from a local directory or a hub id, on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    try:
        lm = AutoModelForCausalLM.from_pretrained(os.path.expanduser(str(model)), dtype=dtype)
    except OSError as exc:
        raise ConfigError(f"model={str(model)!r} could not be loaded: {exc}", [("model", str(exc))]) from exc
    return lm.to(device).eval()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at `targets`, one row at a time (no second [B, T, V])."""
    import torch

    rows = []
    for row_logits, row_targets in zip(logits, targets):
        if temperature != 1.0:
            row_logits = row_logits / temperature
        row_logits = row_logits.float()
        picked = row_logits.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def aligned_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token log-probs [B, T] aligned with `input_ids` (column 0 and padding are 0), differentiable
    when grad is on."""
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logprobs = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    return F.pad(logprobs, (1, 0)) * attention_mask


def check_temperature(temperature: float) -> None:
    """Reject a temperature the logits cannot be divided by (0, negative or NaN)."""
    if not temperature > 0:
        raise RlcoreError(f"temperature={temperature!r} must be > 0")
