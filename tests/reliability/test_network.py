"""A local Ray started by rlcore listens on loopback only: GCS, raylet, workers, the driver, the agents and
the metrics endpoints. Ray 2.60 still starts its dashboard process with include_dashboard=False (only
its usage-stats module, no frontend, no UI port); it is checked here to be on loopback like the rest."""

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
        for info in node.all_processes.get("dashboard", []):
            assert "--disable-frontend" in info.process.args, info.process.args
    finally:
        ray.kill(probe)
