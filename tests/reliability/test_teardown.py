"""The local Ray that rlcore starts ends with its driver: on SIGTERM (exit 143, `finally` blocks run),
and, after a SIGKILL, at the next `cluster.init` on the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rlcore.runtime import cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

STARTED = """
import json, os, signal, sys, threading, time
import psutil
from rlcore.runtime import cluster
cluster.init(num_cpus=1, num_gpus=0)
import ray

@ray.remote(num_cpus=0)
class Actor:
    def pid(self):
        return os.getpid()

    def weights(self, n):
        return bytes(n)  # over Ray's inline limit: through the object store, which the raylet serves

actor = Actor.remote()
ray.get(actor.pid.remote())
"""

DRIVER = STARTED + """
node = ray._private.worker._global_node
pids = [p.pid for p in psutil.Process().children(recursive=True)]
try:
    print(json.dumps({"node_id": node.node_id, "session": node.get_session_dir_path(), "pids": pids,
                      "record": str(cluster._record_path)}), flush=True)
    time.sleep(300)
finally:
    print("finally", flush=True)
"""

NEXT = """
from rlcore.runtime import cluster
cluster.init(num_cpus=1, num_gpus=0)
cluster.shutdown()
"""


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != cluster.ADDRESS_ENV}


def start_driver() -> tuple[subprocess.Popen, dict]:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env())
    line = driver.stdout.readline()
    if not line:
        driver.kill()
        pytest.fail(f"the driver did not start its Ray: {driver.stderr.read()[-3000:]}")
    return driver, json.loads(line)


def of_session(started: dict) -> list[psutil.Process]:
    """The live processes of the driver's Ray: those it listed, and any other with its node id or its
    session dir on the command line (raylet, gcs_server)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.pid in started["pids"] or process.environ().get("RAY_NODE_ID") == started["node_id"] \
                    or any(started["session"] in arg for arg in process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def gone(started: dict, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := of_session(started)) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = []
    for process in left:
        try:
            names.append(f"{process.pid} {process.name()}")
        except psutil.Error:
            continue
    return names


def test_sigterm_exits_143_runs_finally_and_stops_every_ray_process():
    driver, started = start_driver()
    assert started["pids"] and started["record"] != "None"
    driver.send_signal(signal.SIGTERM)
    out, err = driver.communicate(timeout=60)
    assert driver.returncode == 143, err[-3000:]
    assert "finally" in out
    assert "SIGTERM received" not in err  # Ray's C++ handler (a stack dump, then exit 15 or 134) is replaced
    assert gone(started, 10) == []
    assert not os.path.exists(started["record"])


def test_what_a_sigkilled_driver_left_is_ended_by_the_next_init():
    driver, started = start_driver()
    driver.kill()
    driver.wait(timeout=30)
    time.sleep(2)  # Ray's own fate-sharing ends the raylet and gcs; its agents outlive them
    left = [p.pid for p in of_session(started)]
    assert os.path.exists(started["record"])
    nxt = subprocess.run([sys.executable, "-c", NEXT], capture_output=True, text=True, timeout=90, env=env())
    assert nxt.returncode == 0, nxt.stderr[-3000:]
    if left:
        assert f"of the local Ray of a driver that died (pid {driver.pid}," in nxt.stderr, nxt.stderr[-3000:]
    assert gone(started, 5) == []
    assert not os.path.exists(started["record"])


GROUP_DRIVER = STARTED + """
got = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: got.set())  # as the trainer does: note it, finish the step
ray_processes = {p: p.name() for p in psutil.Process().children(recursive=True)}
print("ready", flush=True)
got.wait(60)
time.sleep(2)  # the rest of the step: what the signal ended is gone by now
ended = [name for p, name in ray_processes.items() if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE]
print("ended", ended, flush=True)
if ended:  # the call below would wait for them
    os._exit(1)
print("answered", len(ray.get(actor.weights.remote(8 << 20), timeout=20)), flush=True)
cluster.shutdown()
"""


def test_a_sigterm_to_the_drivers_process_group_leaves_its_ray_working():
    """Ctrl-C in a terminal or `kill -TERM -PGID` signals the driver's whole process group: the local Ray's
    processes lead groups of their own, so the driver can still finish its step (and save) through them."""
    driver = subprocess.Popen([sys.executable, "-c", GROUP_DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env(), start_new_session=True)
    try:
        assert driver.stdout.readline().strip() == "ready", driver.stderr.read()[-3000:] if driver.poll() else ""
        os.killpg(driver.pid, signal.SIGTERM)
        out, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert out.splitlines() == ["ended []", f"answered {8 << 20}"], err[-3000:]
    assert driver.returncode == 0, err[-3000:]
