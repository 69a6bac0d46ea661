"""`rlcore.runtime`: the runtime's pieces an engine or an algorithm plugin uses beyond `rlcore`'s names.

Weight sync (buckets, CUDA IPC, broadcast groups), the torch.distributed rendezvous of a group, the
placement policies and dispatch modes registered by core, checkpoint files written atomically, a group's
resource ranks and rlcore's logger. Each name loads its module on first use (weight sync imports torch), so
importing this package stays as light as importing `rlcore`.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of rlcore that holds it
_EXPORTS = {
    "BroadcastGroup": "weight_sync", "CudaIpcSender": "weight_sync", "IpcReceiver": "weight_sync",
    "copy_all": "weight_sync", "gpu_uuid": "weight_sync", "iter_buckets": "weight_sync",
    "join_torch_world": "rendezvous",
    "POLICIES": "placement",
    "COLLECTORS": "dispatch", "DISPATCHERS": "dispatch",
    "load_state": "checkpoint", "replace_dir": "checkpoint",
    "parse_ranks": "resources",
    "logger": "log",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlcore.runtime' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"rlcore.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
