"""Ray: start a local one or attach to a running cluster, shut it down, and map actor failures.

A local Ray starts with the dashboard and usage stats off. (Ray 2.60 on Linux replaces a 127.0.0.1 node
address by the host's, so its internal ports cannot be loopback-only; Ray's token auth guards them.)
`address="auto"`, an explicit address, or the RLCORE_RAY_ADDRESS environment variable attaches to a
running cluster instead. Ray is imported only when one of these functions runs, so `import rlcore`
stays light. The transport at the end moves tensors as numpy buffers, which Ray reads without copying.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from typing import Any

from .batch import Batch
from .errors import RlcoreError, RoleFailed

ADDRESS_ENV = "RLCORE_RAY_ADDRESS"


def init(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    namespace: str | None = None,
) -> dict[str, float]:
    """Start (or attach to) Ray once per process; returns the cluster's resources.

    `address` None (and RLCORE_RAY_ADDRESS unset) starts a local Ray, and `"local"` always does (as in
    `ray.init`); `num_cpus` / `num_gpus` override what it declares (tests, fake GPUs). Attaching with
    overrides is an error: a running cluster's resources are its own. A process already connected to
    Ray is left as it is.
    """
    import ray

    address = None if address == "local" else (address or os.environ.get(ADDRESS_ENV) or None)
    if address is not None and (num_cpus is not None or num_gpus is not None):
        raise RlcoreError(
            f"num_cpus/num_gpus only apply to a local Ray; attaching to '{address}' uses that cluster's "
            f"resources. Drop the overrides, or unset {ADDRESS_ENV} to start a local Ray."
        )
    if ray.is_initialized():
        return ray.cluster_resources()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        if address is None:
            ray.init(
                address="local",  # a new Ray here, never a cluster some other process left running
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                namespace=namespace,
                include_dashboard=False,
            )
        else:
            ray.init(address=address, namespace=namespace)
    except ConnectionError as exc:
        raise RlcoreError(
            f"cannot attach to the Ray cluster at '{address}': {exc}. Start it with `ray start --head`, "
            f"or leave the address (and {ADDRESS_ENV}) unset to start a local Ray."
        ) from exc
    return ray.cluster_resources()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (a process group's store or rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def shutdown() -> None:
    """Disconnect from Ray (a local Ray started here stops with it)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def is_initialized() -> bool:
    """Whether this process is connected to Ray (without importing Ray when it is not loaded)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def kill(actors: Iterable[Any]) -> None:
    """Kill actors without restarting them; ones already dead are ignored."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - an actor that is already gone needs no killing
            pass


def _first_line(text: str, limit: int = 400) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:limit]


def is_death(exc: BaseException) -> bool:
    """Whether a Ray error means the worker's process is gone (rather than a call that raised)."""
    import ray.exceptions as rex

    return isinstance(exc, rex.RayActorError) and not isinstance(exc, rex.RayTaskError)


def role_error(
    exc: BaseException, *, role: str, rank: int | None, node: str, pid: int | None, method: str
) -> RoleFailed:
    """Map a Ray error from one worker to RoleFailed naming role, rank, node and cause."""
    import ray.exceptions as rex

    where = f"role '{role}' rank {rank} on node {node or '?'}" + (f" (pid {pid})" if pid else "")
    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
        message = f"{where} raised {type(cause).__name__} in {method}(): {cause}\n\nworker traceback:\n{exc}"
    elif is_death(exc):
        cause = _first_line(getattr(exc, "error_msg", "") or str(exc))
        message = (
            f"{where} died during {method}(): {cause}. The group's other workers were stopped; see the "
            f"worker's log (`ray logs`) and the node's memory for why the process exited."
        )
    else:
        message = f"{where} failed in {method}(): {exc!r}"
    return RoleFailed(message, role=role, rank=rank, node=node)


# -------------------------------------------------------------------------
# transport: tensors as numpy buffers (zero-copy reads), shared arguments put once
# -------------------------------------------------------------------------

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
        with warnings.catch_warnings():  # the object store's buffers are read-only (see rlcore.workers)
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
