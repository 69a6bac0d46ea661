"""Arguments and results on their way to and from Ray actors: tensors as numpy buffers (which Ray reads
without copying) and shared arguments put into the object store once. Ray and torch are imported only
when a function needs them."""

from __future__ import annotations

import sys
import warnings
from typing import Any

from ..batch import Batch

_ATOMS = frozenset({int, float, bool, str, bytes, type(None), complex})
LARGE_BYTES = 100 * 1024  # Ray stores task arguments above this size in the object store
LARGE_ITEMS = 1024


class _Tensor:
    """A CPU tensor as a numpy array (or an ObjectRef to one); `dtype` is set where numpy has none."""

    __slots__ = ("data", "dtype")

    def __init__(self, data: Any, dtype: str | None):
        self.data, self.dtype = data, dtype


class _Put:
    """An argument stored once in the object store, for every worker that receives it."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any):
        self.ref = ref


class _Columns(dict):
    """A Batch's columns in transit."""


_VIEW = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _tensor_to_box(x: Any, shared: bool) -> Any:
    torch = sys.modules["torch"]
    if x.device.type != "cpu" or x.layout is not torch.strided or x.is_quantized:
        return x
    x = x.detach()
    try:
        box = _Tensor(x.numpy(), None)
    except (TypeError, RuntimeError):  # bfloat16, float8, ...: no numpy dtype; send the bits
        try:
            box = _Tensor(x.contiguous().view(getattr(torch, _VIEW[x.element_size()])).numpy(), str(x.dtype)[6:])
        except (KeyError, TypeError, RuntimeError):
            return x  # Ray's own pickling still works, with a copy per reader
    if shared and box.data.nbytes >= LARGE_BYTES:
        box.data = _put(box.data)
    return box


def encode(x: Any, shared: bool) -> Any:
    """`x` ready for a Ray call; with `shared` (every worker gets it), large parts are put once."""
    t = type(x)
    if t in _ATOMS:
        return _Put(_put(x)) if shared and t in (str, bytes) and len(x) >= LARGE_BYTES else x
    if t is list or t is tuple:
        if set(map(type, x)) <= _ATOMS:
            return _Put(_put(x)) if shared and len(x) >= LARGE_ITEMS else x
        return t(encode(v, shared) for v in x)
    if t is dict:
        return {k: encode(v, shared) for k, v in x.items()}
    if t is Batch:
        return _Columns({k: encode(v, shared) for k, v in x.items()})
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _tensor_to_box(x, shared)
    if shared and type(x).__module__ == "numpy" and getattr(x, "nbytes", 0) >= LARGE_BYTES:
        return _Put(_put(x))
    return x


def decode(x: Any) -> Any:
    """The inverse of `encode`: tensors rebuilt on the numpy buffers Ray hands out."""
    t = type(x)
    if t in _ATOMS:
        return x
    if t is list or t is tuple:
        return x if set(map(type, x)) <= _ATOMS else t(decode(v) for v in x)
    if t is dict:
        return {k: decode(v) for k, v in x.items()}
    if t is _Tensor:
        import torch

        data = x.data if type(x.data).__module__ == "numpy" else _fetch(x.data)
        with warnings.catch_warnings():  # the object store's buffers are read-only (see rlcore.runtime.workers)
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(data)
        return tensor.view(getattr(torch, x.dtype)) if x.dtype else tensor
    if t is _Put:
        return decode(_fetch(x.ref))
    if t is _Columns:
        return Batch({k: decode(v) for k, v in x.items()})
    return x


def _fetch(ref: Any) -> Any:
    import ray

    return ray.get(ref)


def _put(value: Any) -> Any:
    import ray

    return ray.put(value)
