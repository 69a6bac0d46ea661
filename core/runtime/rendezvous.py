"""torch.distributed inside a worker group: a free port, a TCP store that listens on the group's address only,
and joining the world the worker runtime describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). torch is
imported only when a function runs."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (a process group's store or rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: Any) -> Any:
    """A torch.distributed TCPStore whose server (on the master) listens on `host` only, not on every
    interface as torch's own does: the socket is bound here and handed to the store."""
    import socket

    import torch.distributed as dist

    fd = None
    if is_master:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(max(128, world_size))
        except OSError:
            sock.close()
            raise
        fd = sock.detach()  # the store owns it now
    return dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)


def join_torch_world(device: Any, timeout_s: float, *, alone: bool = False) -> tuple[int, int]:
    """Join this worker group's torch.distributed world (NCCL on CUDA, else gloo) from the RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT the worker runtime set, its store on the master's address only; returns
    (rank, world_size). A worker alone (WORLD_SIZE 1) joins nothing, or with `alone=True` makes a
    one-process world on an in-memory store (for libraries that need one, e.g. megatron-core)."""
    from datetime import timedelta

    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 and not alone:
        return 0, 1
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if getattr(device, "type", device) == "cuda" else "gloo"
    if world_size <= 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return 0, 1
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; the worker runtime sets them")
    rank, timeout = int(os.environ["RANK"]), timedelta(seconds=timeout_s)
    store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
