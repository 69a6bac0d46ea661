"""Whether the hf engine packs rows (padding-free) or pads them, and the variable-length attention it packs with.

A packed row pays only where attention skips the other sequences' tokens: a variable-length kernel (torch's
`torch.nn.attention.varlen.varlen_attn` on CUDA, registered for transformers here as `rlcore_varlen`, or
flash-attn's `flash_attention_2`). Under sdpa and eager a packed row carries a dense N x N block-causal mask, which
took attention off its fused kernels and was slower than padding on the CPU and on an H200 (issue 51), so without
such a kernel the engine pads unless `padding_free: true` asks otherwise.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from rlcore import RlcoreError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

VARLEN = "rlcore_varlen"  # torch's varlen_attn as a transformers attention implementation
# Whether an unset `padding_free` packs where a variable-length kernel exists (the GPU). Off until the GPU A/B
# (`benchmarks/grpo_gpu.py --arms padded,varlen`) measures varlen packing faster than padding; padding beat
# sdpa-packing there (issue 51), and varlen packing has no measurement yet. Flip it with that result.
PACK_WITH_VARLEN_BY_DEFAULT = False
FLASH = ("flash_attention_2", "flash_attention_3")
HALF = ("torch.bfloat16", "torch.float16")  # the dtypes flash kernels take


@dataclass(frozen=True)
class Packing:
    """The engine's choice: `pack` rows or pad them, the attention implementation packed rows run with (`attn`,
    None: the model's own) and why, in a sentence the engine logs once."""

    pack: bool
    attn: str | None
    reason: str


def torch_varlen() -> Callable | None:
    """torch's `varlen_attn` (torch >= 2.10), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_takes(name: str) -> bool:
    """Whether this torch's varlen_attn takes keyword `name`: 2.10's takes `is_causal`; later ones `scale` and
    `window_size` (a sliding window), then `enable_gqa` (2.12)."""
    return name in inspect.signature(torch_varlen()).parameters


def flash_attn_installed() -> bool:
    """Whether flash-attn imports (transformers' `flash_attention_2` then runs its variable-length kernel)."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def torch_varlen_on(device: torch.device) -> bool:
    """Whether torch's varlen_attn runs on `device`: CUDA with torch's flash kernels (sm80 or newer)."""
    import torch

    return (device.type == "cuda" and torch_varlen() is not None and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def model_refuses_varlen(model: Any) -> str | None:
    """What in `model` a variable-length kernel cannot run (attention dropout, logit soft-capping, attention sinks,
    a head wider than 256, attention outside transformers' AttentionInterface), or None."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not dispatch through transformers' AttentionInterface"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return "the model's attention_dropout is not 0"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "the model soft-caps its attention logits"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (heads and config.hidden_size // heads)
    if head_dim and head_dim > 256:
        return f"its head dimension {head_dim} is over flash kernels' 256"
    if any("sink" in name for name, _ in model.named_parameters()):
        return "the model has attention sinks"
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
        getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))
    if sliding and torch_varlen() is not None and not varlen_takes("window_size"):
        return "the model has sliding-window layers and this torch's varlen_attn takes no window"
    return None


def varlen_kernel(model: Any, device: torch.device, attn_implementation: str | None) -> tuple[str | None, str]:
    """The attention implementation that runs packed rows with a variable-length kernel for `model` on `device`
    (`rlcore_varlen`, or a flash one), or None, and why, as a clause for the engine's log line."""
    if attn_implementation in FLASH:
        return attn_implementation, f"{attn_implementation}'s variable-length kernel"
    if attn_implementation is not None:  # the user's kernel stands
        return None, f"attn_implementation {attn_implementation} has no variable-length kernel"
    if device.type != "cuda":
        return None, f"the {'CPU' if device.type == 'cpu' else device.type} has no variable-length attention kernel"
    dtype = str(next(model.parameters()).dtype)
    if dtype not in HALF:
        return None, f"variable-length kernels take bfloat16 or float16, the model is {dtype.removeprefix('torch.')}"
    refused = model_refuses_varlen(model)
    if refused:
        return None, refused
    if torch_varlen_on(device):
        return VARLEN, "torch's varlen_attn"
    if flash_attn_installed():
        return "flash_attention_2", "flash-attn's variable-length kernel"
    import torch

    return None, f"torch {torch.__version__} has no varlen_attn for this GPU and flash-attn is not installed"


def packing_choice(requested: bool | None, kernel: str | None, why: str, carries_state: bool) -> Packing:
    """Pack or pad: `requested` is the user's `padding_free` (None: unset), `kernel` and `why` are
    `varlen_kernel`'s answer, `carries_state` whether a layer carries a state along a row (linear attention, a scan),
    which a packed row would carry across its sequences' boundaries."""
    if carries_state:
        return Packing(False, None, "pads rows: the model has layers that carry a state along a row (linear "
                       "attention, a scan), which would cross a packed row's sequence boundaries")
    if requested is False:
        return Packing(False, None, "pads rows (padding_free: false)")
    if requested:
        if kernel is None:
            return Packing(True, None, f"packs rows (padding_free: true) with a dense block-causal mask, which is "
                           f"slower than padding: {why}")
        return Packing(True, kernel, f"packs rows (padding_free: true) with {why}")
    if kernel is None:
        return Packing(False, None, f"pads rows (padding_free unset): {why}")
    if not PACK_WITH_VARLEN_BY_DEFAULT:
        return Packing(False, None, f"pads rows (padding_free unset): {why} is there, but packing with it is not the "
                       "default until the GPU A/B measures it faster; padding_free: true packs")
    return Packing(True, kernel, f"packs rows (padding_free unset) with {why}")


def log_once(choice: Packing) -> None:
    """The choice's reason, once per process (a role's engines make the same choice): a warning where rows are
    packed without a variable-length kernel, else at info level."""
    if choice.reason not in _LOGGED:
        _LOGGED.add(choice.reason)
        (log.warning if choice.pack and choice.attn is None else log.info)("hf engine: %s", choice.reason)


_LOGGED: set[str] = set()


def varlen_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None,
                             is_causal: bool | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                             cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None,
                             max_length_k: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function over torch's varlen_attn: query [B, Hq, T, D], key and value [B, Hkv, T, D]
    in, [B, T, Hq, D] out. A packed row comes with `cu_seq_lens_q/k` and `max_length_q/k` (`PackedRows`); rows
    without them are sequences of their own, cut to their real tokens where a 2D mask marks padding."""
    import torch

    if dropout or softcap or kwargs.get("s_aux") is not None:
        raise RlcoreError(f"{VARLEN}: attention dropout, soft-capping and sinks are not supported; set "
                          "padding_free: false")
    B, heads, T, _ = query.shape
    q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1]) for t in (query, key, value))
    index = None
    if cu_seq_lens_q is not None:  # one packed row [1, N]
        cu_q, cu_k = cu_seq_lens_q, cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q
        max_q, max_k = max_length_q, max_length_k if max_length_k is not None else max_length_q
    elif attention_mask is None:  # whole rows
        cu_q = cu_k = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=query.device)
        max_q = max_k = T
    else:  # a 2D mask of real tokens (flash_attention_mask passes one only where a row holds padding)
        real = attention_mask.bool()[:, -T:]
        index = real.reshape(-1).nonzero().squeeze(1)
        lengths = real.sum(dim=1, dtype=torch.int32)
        cu_q = cu_k = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        max_q = max_k = int(lengths.max())
        q, k, v = (t.index_select(0, index) for t in (q, k, v))
    causal = module.is_causal if is_causal is None else is_causal
    out = run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scaling, causal, sliding_window)
    if index is not None:
        out = out.new_zeros(B * T, *out.shape[1:]).index_copy(0, index, out)
    return out.reshape(B, T, heads, out.shape[-1]), None


def run_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
               max_k: int, scale: float | None, causal: bool, sliding_window: int | None) -> torch.Tensor:
    """torch's varlen_attn on [N, H, D] tensors: causal (a left window of `sliding_window` tokens where set), key and
    value heads shared by groups of query heads (its `enable_gqa` where torch has it, else repeated)."""
    keys: dict[str, Any] = {}
    default = 1 / math.sqrt(q.shape[-1])
    if varlen_takes("scale"):
        keys["scale"] = scale if scale is not None else default
    elif scale is not None and scale != default:  # a varlen_attn that scales by 1/sqrt(D): the rest folded into q
        q = q * (scale / default)
    if varlen_takes("window_size"):
        keys["window_size"] = ((sliding_window - 1) if sliding_window else -1, 0) if causal else (-1, -1)
    elif sliding_window:
        raise RlcoreError(f"{VARLEN}: this torch's varlen_attn takes no sliding window; set padding_free: false")
    else:
        keys["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if varlen_takes("enable_gqa"):
            keys["enable_gqa"] = True
        else:  # before torch 2.12 varlen_attn documents equal head counts
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch_varlen()(q, k, v, cu_q, cu_k, max_q, max_k, **keys)


def register_varlen() -> None:
    """`rlcore_varlen` as a transformers attention implementation; its mask is flash attention's (none, or the 2D
    padding mask), so transformers builds no N x N mask for it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    if VARLEN not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN, varlen_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)


__all__ = ["PACK_WITH_VARLEN_BY_DEFAULT", "Packing", "VARLEN", "packing_choice", "register_varlen",
           "varlen_attention_forward", "varlen_kernel"]
