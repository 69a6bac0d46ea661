"""`Batch`: the unit a step's data moves in. A dict of equal-length columns (tensors or lists).

Dispatch cuts it (`split`), collect joins it (`concat`), the driver reads it. Per-token tensors are
right-padded and carry a mask; `concat` pads them to the longest before joining.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .errors import RlcoreError


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "shape")


def _length(value: Any) -> int:
    return int(value.shape[0]) if _is_tensor(value) else len(value)


def pad_tokens(rows: Sequence[Sequence[int]], pad_id: int, left: bool = False) -> tuple[Any, Any]:
    """Token lists as `input_ids` [B, T] (T the longest row) and `attention_mask` [B, T], both long;
    padded on the right, or on the left (prompts for generation) with `left=True`."""
    import torch

    width = max((len(r) for r in rows), default=0)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        input_ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    return input_ids, mask


def pad_width(tensor: Any, width: int, value: Any = 0) -> Any:
    """`tensor` ([B, T, ...], any rank >= 2) right-padded along dim 1 to `width` with `value`."""
    if tensor.shape[1] >= width:
        return tensor
    out = tensor.new_full((tensor.shape[0], width, *tensor.shape[2:]), value)
    out[:, : tensor.shape[1]] = tensor
    return out


def token_columns(batch: Mapping[str, Any]) -> tuple[Any, Any]:
    """`input_ids` and `attention_mask` of a train batch, or an error naming the columns it has."""
    missing = [k for k in ("input_ids", "attention_mask") if k not in batch]
    if missing:
        raise RlcoreError(f"the batch has no {', '.join(missing)} column; columns: {', '.join(batch.keys()) or '(none)'}")
    return batch["input_ids"], batch["attention_mask"]


def trim_padding(batch: Batch) -> Batch:
    """`batch` without the tail columns that are padding in every row, in every [rows, T, ...] tensor."""
    T = batch["input_ids"].shape[1]
    width = max(int(batch["attention_mask"].sum(dim=1).max()), 1)
    if width == T:
        return batch
    return Batch({
        k: v[:, :width] if hasattr(v, "shape") and v.dim() >= 2 and v.shape[1] == T else v for k, v in batch.items()
    })


class Batch(Mapping[str, Any]):
    """Columns of equal length. Tensors keep their type; anything else is stored as a list."""

    host: Batch | None = None  # the CPU batch this one was moved from (`to`)

    def __init__(self, data: Mapping[str, Any] | None = None, **columns: Any):
        self._data: dict[str, Any] = {}
        for key, value in {**(data or {}), **columns}.items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        value = value if _is_tensor(value) else list(value)
        if self._data:
            n = len(self)
            if _length(value) != n:
                raise RlcoreError(f"Batch column '{key}' has {_length(value)} rows; the others have {n}")
        self._data[key] = value

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        """The number of rows (not columns)."""
        return _length(next(iter(self._data.values()))) if self._data else 0

    def __repr__(self) -> str:
        cols = ", ".join(
            f"{k}: {tuple(v.shape) if _is_tensor(v) else 'list'}" for k, v in self._data.items()
        )
        return f"Batch({len(self)} rows; {cols})"

    def keys(self):  # noqa: D102 - Mapping's, listed so that len() is not mistaken for the column count
        return self._data.keys()

    def select(self, index: Sequence[int] | slice) -> Batch:
        """Rows by a slice or a list of indices."""
        if isinstance(index, slice):
            return Batch({k: v[index] for k, v in self._data.items()})
        idx = list(index)
        out = {}
        for key, value in self._data.items():
            if _is_tensor(value):
                import torch

                out[key] = value[torch.as_tensor(idx, dtype=torch.long)]
            else:
                out[key] = [value[i] for i in idx]
        return Batch(out)

    def split(self, n: int) -> list[Batch]:
        """`n` contiguous near-equal shards (the first ones one row longer); some may be empty."""
        size, extra = divmod(len(self), n)
        shards, start = [], 0
        for i in range(n):
            stop = start + size + (1 if i < extra else 0)
            shards.append(self.select(slice(start, stop)))
            start = stop
        return shards

    def chunks(self, size: int) -> list[Batch]:
        """Consecutive shards of at most `size` rows (micro-batches)."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def update(self, other: Mapping[str, Any] | None = None, **columns: Any) -> Batch:
        for key, value in {**(other or {}), **columns}.items():
            self[key] = value
        return self

    def to(self, device: Any) -> Batch:
        """The batch on `device`. From the CPU to a GPU the copies are non-blocking (through pinned memory: a
        copy from pageable memory waits for the GPU's queue to drain first), and the moved batch keeps this one
        as its `host`, so that a loss can read a mask's positions on the CPU without waiting for the GPU."""
        import torch

        device = torch.device(device)
        to_gpu = device.type != "cpu" and all(v.device.type == "cpu" for v in self._data.values() if _is_tensor(v))
        moved = Batch({k: copy_to(v, device) if _is_tensor(v) else v for k, v in self._data.items()})
        moved.host = self if to_gpu else self.host
        return moved

    @staticmethod
    def concat(batches: Sequence[Batch], pad_value: Mapping[str, Any] | None = None) -> Batch:
        """Join batches row-wise. Tensors of two or more dims (per-token [B, T], top-k [B, T, k], ...) of
        different widths are right-padded along dim 1 first, with `pad_value[key]` (default 0)."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return Batch()
        keys = list(batches[0].keys())
        for b in batches[1:]:
            if list(b.keys()) != keys:
                raise RlcoreError(f"cannot concat batches with columns {keys} and {list(b.keys())}")
        out: dict[str, Any] = {}
        for key in keys:
            values = [b[key] for b in batches]
            if _is_tensor(values[0]):
                import torch

                shapes = {(v.dim(), tuple(v.shape[2:])) for v in values}
                if len(shapes) > 1:
                    found = ", ".join(str(tuple(v.shape)) for v in values)
                    raise RlcoreError(
                        f"cannot concat column '{key}': its tensors must agree in every dim but 0 and 1, got {found}"
                    )
                if values[0].dim() >= 2:
                    width = max(v.shape[1] for v in values)
                    fill = (pad_value or {}).get(key, 0)
                    values = [pad_width(v, width, fill) for v in values]
                out[key] = torch.cat(values, dim=0)
            else:
                out[key] = [x for v in values for x in v]
        return Batch(out)


def copy_to(tensor: Any, device: Any) -> Any:
    """`tensor` on `device`; from the CPU to a GPU through pinned memory, non-blocking (a copy from pageable
    memory waits for the GPU's queue to drain first)."""
    import torch

    if tensor.device.type == "cpu" and torch.device(device).type != "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def host_of(batch: Any) -> Batch | None:
    """The CPU batch a device batch was moved from (`Batch.to`), or None (also for a plain mapping)."""
    return getattr(batch, "host", None)


def host_column(batch: Mapping[str, Any], key: str) -> Any:
    """`batch[key]` as its `host` copy holds it, on the CPU, where the batch has one; else the column itself.
    What a loss or an engine reads on the host (a mask's widths or positions) without waiting for the GPU."""
    host = host_of(batch)
    return host[key] if host is not None and key in host else batch[key]


def nonzero_positions(batch: Mapping[str, Any], key: str) -> Any:
    """The flat positions (a long tensor on the column's device) where `batch[key]` is non-zero, in row-major
    order: found on the batch's `host` copy where it has one, so the GPU's queue is not drained for them
    (a boolean index or `nonzero` of a GPU tensor waits for every kernel before it)."""
    return copy_to(host_column(batch, key).reshape(-1).nonzero().squeeze(1), batch[key].device)


def right_padded(mask: Any) -> bool:
    """Whether every row of a CPU attention mask [B, T] is ones then zeros (right padding, or none). Under causal
    attention no real token of such rows can see a pad, so a model given no mask computes the same states at the
    real tokens. A mask on another device is not read (that would wait for it): False."""
    import torch

    if not isinstance(mask, torch.Tensor) or mask.device.type != "cpu" or mask.dim() != 2:
        return False
    ones = mask.bool()
    return bool((ones == (torch.arange(mask.shape[1]) < ones.sum(dim=1, keepdim=True))).all())


__all__ = [
    "Batch", "copy_to", "host_column", "host_of", "nonzero_positions", "pad_tokens", "pad_width", "right_padded",
    "token_columns", "trim_padding",
]
