"""`rlcore.runtime`: the runtime (the session, its roles and workers, dispatch, placement, resources, the Ray
cluster, rendezvous, transport and weight sync), and the names of it an engine or an algorithm plugin uses
beyond `rlcore`'s.

Weight sync (buckets, CUDA IPC, broadcast groups), the torch.distributed rendezvous of a group, the
placement policies and dispatch modes registered by core, checkpoint files written atomically, a group's
resource ranks and rlcore's logger. Each name loads its module on first use (weight sync imports torch), so
importing this package stays as light as importing `rlcore`.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that holds it
_EXPORTS = {
    "BroadcastGroup": "rlcore.runtime.weight_sync", "CudaIpcSender": "rlcore.runtime.weight_sync",
    "IpcReceiver": "rlcore.runtime.weight_sync", "copy_all": "rlcore.runtime.weight_sync",
    "gpu_uuid": "rlcore.runtime.weight_sync", "iter_buckets": "rlcore.runtime.weight_sync",
    "join_torch_world": "rlcore.runtime.rendezvous",
    "POLICIES": "rlcore.runtime.placement",
    "COLLECTORS": "rlcore.runtime.dispatch", "DISPATCHERS": "rlcore.runtime.dispatch",
    "load_state": "rlcore.checkpoint", "replace_dir": "rlcore.checkpoint",
    "parse_ranks": "rlcore.runtime.resources",
    "logger": "rlcore.log", "open_own": "rlcore.log", "scrub_data": "rlcore.log",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlcore.runtime' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
