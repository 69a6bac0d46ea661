"""A local Ray started by rlcore listens on loopback only (GCS, raylet, workers, the driver, the agents),
runs no dashboard process, no autoscaler monitor and no metrics endpoint; the torch.distributed world of
a train group listens on its master's address only."""

from __future__ import annotations

import ipaddress
import os

import psutil
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


def loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def listeners() -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket and bound UDP socket of this driver
    and the processes under it (the local Ray's)."""
    found = []
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            name, conns = process.name(), process.net_connections(kind="inet")
        except psutil.Error:
            continue
        for conn in conns:
            udp = conn.type == 2  # SOCK_DGRAM
            if conn.laddr and (conn.status == psutil.CONN_LISTEN or (udp and not conn.raddr)):
                found.append((name, conn.laddr.ip, conn.laddr.port))
    return found


def test_a_local_ray_listens_on_loopback_only(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self):
            return os.getpid()

    probe = Probe.remote()
    try:
        ray.get(probe.pid.remote(), timeout=60)
        found = listeners()
        exposed = [item for item in found if not loopback(item[1])]
        assert exposed == [], f"listening beyond loopback: {exposed}"
        names = {name for name, _, _ in found}
        assert {"gcs_server", "raylet"} <= names and len(found) >= 6, found  # the check saw Ray's listeners
        node = ray._private.worker._global_node
        assert node.node_ip_address == "127.0.0.1" and not node.webui_url
        commands = _command_lines(psutil.Process().children(recursive=True))
        assert not [c for c in commands if "dashboard/dashboard.py" in c or "autoscaler/_private/monitor.py" in c]
        # Ray's fixed metrics ports (the dashboard's 44227, the autoscaler's 44217) served by no process of Ray's
        # metrics servers; a raylet or agent port the OS hands out at random may be the same number (seen once)
        fixed = [(name, port) for name, _, port in found if port in (44217, 44227)]
        served = [(name, port, command) for (name, port), command in zip(fixed, _owners(fixed))
                  if "dashboard/dashboard.py" in command or "autoscaler/_private/monitor.py" in command]
        assert not served, f"a Ray metrics endpoint listens: {served}"
    finally:
        ray.kill(probe)


def test_a_train_groups_torch_world_listens_on_its_masters_address_only(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Rank:
        def join(self, env):
            import torch

            from rlcore.runtime.rendezvous import join_torch_world

            os.environ.update(env)
            return join_torch_world(torch.device("cpu"), 60)

        def listening(self):
            return [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
                    if c.status == psutil.CONN_LISTEN]

    from rlcore.runtime.rendezvous import find_free_port

    port = str(find_free_port())
    ranks = [Rank.remote() for _ in range(2)]
    try:
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        joined = ray.get([r.join.remote({**env, "RANK": str(i)}) for i, r in enumerate(ranks)], timeout=90)
        assert joined == [(0, 2), (1, 2)]
        store = [ip for ip, p in ray.get(ranks[0].listening.remote(), timeout=30) if p == int(port)]
        assert store == ["127.0.0.1"], store  # torch's own store would listen on '::', every interface
    finally:
        for r in ranks:
            ray.kill(r)


def _owners(listening: list[tuple[str, int]]) -> list[str]:
    """The command line of the process (this driver's or one under it) listening on each (name, port)."""
    me = psutil.Process()
    owners = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            ports = {c.laddr.port for c in process.net_connections(kind="inet") if c.laddr}
            command = " ".join(process.cmdline())
        except psutil.Error:
            continue
        owners.update({port: command for port in ports})
    return [owners.get(port, "(gone)") for _, port in listening]


def _command_lines(processes) -> list[str]:
    """The command lines of `processes` that still run (an earlier test's unreaped child is a zombie, and a
    process may end between the listing and the read)."""
    lines = []
    for p in processes:
        try:
            lines.append(" ".join(p.cmdline()))
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return lines
