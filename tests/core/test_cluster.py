"""Starting and attaching to Ray, in subprocesses so the session's shared Ray is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from rlcore import RlcoreError
from rlcore.runtime import cluster


def run(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k != cluster.ADDRESS_ENV}
    full_env.update(env or {})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_runtime_does_not_import_ray():
    out = run("import json, sys, rlcore, rlcore.runtime.workers, rlcore.runtime.actors, rlcore.runtime.cluster, rlcore.runtime.dispatch\n"
              "print(json.dumps({'ray': 'ray' in sys.modules, 'torch': 'torch' in sys.modules}))")
    assert out == {"ray": False, "torch": False}


ATTACH = """
import json, os
from rlcore.runtime import cluster
resources = cluster.init()
import ray
print(json.dumps({"cpus": resources["CPU"], "node": ray.get_runtime_context().get_node_id()}))
"""

START = f"""
import json, os, signal, subprocess, sys
from rlcore.runtime import cluster
terms = []
signal.signal(signal.SIGTERM, lambda *_: terms.append(1))  # the program's own handler (ray.init replaces it)
resources = cluster.init(num_cpus=3, num_gpus=2)
os.kill(os.getpid(), signal.SIGTERM)
import ray
node = ray._private.worker._global_node
gcs = ray.get_runtime_context().gcs_address
env = dict(os.environ, {cluster.ADDRESS_ENV}=gcs)
attached = subprocess.run([sys.executable, "-c", {ATTACH!r}], capture_output=True, text=True, env=env, timeout=90)
me = ray.get_runtime_context().get_node_id()
dashboard = node.webui_url
cluster.shutdown()
print(json.dumps({{
    "cpus": resources["CPU"], "gpus": resources["GPU"], "node": me,
    "dashboard": dashboard, "usage_stats": os.environ.get("RAY_USAGE_STATS_ENABLED"),
    "attached": json.loads(attached.stdout.strip().splitlines()[-1]) if attached.returncode == 0 else attached.stderr[-2000:],
    "after_shutdown": cluster.is_initialized(), "own_sigterm_handler_ran": terms == [1],
}}))
"""


@pytest.mark.ray
def test_a_local_ray_with_overrides_and_a_second_process_attaching_to_it():
    out = run(START, timeout=180)
    assert (out["cpus"], out["gpus"]) == (3.0, 2.0)
    assert not out["dashboard"] and out["usage_stats"] == "0"  # no dashboard UI
    assert out["attached"] == {"cpus": 3.0, "node": out["node"]}  # RLCORE_RAY_ADDRESS attached to it
    assert out["after_shutdown"] is False
    assert out["own_sigterm_handler_ran"] is True


def test_overrides_with_an_address_are_an_error_before_connecting():
    with pytest.raises(RlcoreError, match="num_cpus/num_gpus only apply to a local Ray; attaching to 'auto'"):
        cluster.init("auto", num_cpus=2)


LOCAL = """
import json, signal
from rlcore.runtime import cluster
resources = cluster.init("local", num_cpus=1, num_gpus=0)
sigterm = signal.getsignal(signal.SIGTERM).__name__
print(json.dumps({"cpus": resources["CPU"], "gpus": resources.get("GPU", 0.0), "sigterm": sigterm}))
"""


@pytest.mark.ray
def test_local_starts_its_own_ray_even_with_an_address_in_the_environment():
    out = run(LOCAL, env={cluster.ADDRESS_ENV: "127.0.0.1:1"})  # nothing listens there: attaching would fail
    assert out == {"cpus": 1.0, "gpus": 0.0, "sigterm": "_exit_on_sigterm"}  # SIGTERM: SystemExit(143)


def _record(records, driver: subprocess.Popen, *pids: int) -> None:
    created = [[pid, psutil.Process(pid).create_time()] for pid in pids]
    records.mkdir(exist_ok=True)
    (records / f"{driver.pid}.json").write_text(json.dumps({
        "driver": [driver.pid, psutil.Process(driver.pid).create_time()], "node_id": "0" * 56,
        "session_dir": "/tmp/ray/session_test", "pids": created,
    }))


def test_reap_ends_the_processes_of_a_dead_drivers_local_ray_and_only_those(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "RECORDS", tmp_path / "records")
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    dead_driver, live_driver = subprocess.Popen(sleep), subprocess.Popen(sleep)
    orphan, kept = subprocess.Popen(sleep), subprocess.Popen(sleep)
    try:
        _record(cluster.RECORDS, dead_driver, orphan.pid)
        _record(cluster.RECORDS, live_driver, kept.pid)
        dead_driver.kill()
        dead_driver.wait()
        assert cluster.reap() == [orphan.pid]
        assert orphan.wait(timeout=10) is not None
        assert kept.poll() is None  # its driver lives: a concurrent run's Ray is left alone
        assert sorted(p.name for p in cluster.RECORDS.iterdir()) == [f"{live_driver.pid}.json"]
    finally:
        for process in (live_driver, orphan, kept):
            process.kill()
            process.wait()


def test_an_address_where_nothing_answers_fails_in_bounded_time_naming_it():
    import socket
    import time

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(RlcoreError, match=rf"ray_address '{address}': nothing answers at 127.0.0.1:{port} "
                                              r"\(Connection refused\) within 1s\. Check that the head node runs"):
            cluster.check_reachable(address, timeout_s=1)
    with pytest.raises(RlcoreError, match=r"nothing answers at no-such-host.invalid:6379"):
        cluster.check_reachable("no-such-host.invalid", timeout_s=1)
    assert time.monotonic() - started < 10
