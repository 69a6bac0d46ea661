"""Ray's lifecycle: start a local one or attach to a running cluster, shut it down, and map actor failures.
(torch.distributed rendezvous is `rendezvous.py`; arguments on their way to actors, `transport.py`.)

A local Ray that rlcore starts listens on 127.0.0.1 only. Ray 2.60 on Linux replaces a 127.0.0.1 node
address by the host's unless its switch for Windows and macOS (`ray_constants.ENABLE_RAY_CLUSTER`) is
off, so `init` turns that off while the local Ray starts; GCS, raylet, workers, agents and the metrics
endpoints then bind loopback. Its processes get VLLM_HOST_IP=127.0.0.1 (unless set), so vLLM's Ray
executor sees the node's address as Ray does. No dashboard process, no autoscaler monitor and no
metrics endpoints run (Ray 2.60 starts the first two even with include_dashboard=False), and usage stats
are off. torch.distributed stores that rlcore makes (`rendezvous.tcp_store`) listen on the group's address only.

Each process of the local Ray leads a process group of its own, so a signal to the driver's group (Ctrl-C,
`kill -TERM -PGID`) reaches the driver alone: it finishes its step and saves through a Ray still whole.
The local Ray stops on every exit Python sees: atexit, and SIGTERM made a `SystemExit(143)` unless the
program set a SIGTERM handler of its own (which is kept), so `finally` blocks run. What a SIGKILL of the
driver leaves (Ray's agents outlive their raylet) is ended by the next `init` on this machine, from a
record of each local Ray in the temp dir.

`address="auto"`, an explicit address, or the RLCORE_RAY_ADDRESS environment variable attaches to a
running cluster instead, with that cluster's settings (a loopback address is kept as given, so a Ray on
127.0.0.1 can be reached); rlcore never stops a cluster it did not start. Ray is imported only when one
of these functions runs, so `import rlcore` stays light.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .. import failures, log, signals, watchdog
from ..errors import RlcoreError, RoleFailed
from ..log import logger

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
    Ray is left as it is. Before connecting, the local Rays of drivers that died without stopping them
    are ended (see the module docstring).
    """
    import ray

    address = None if address == "local" else (address or os.environ.get(ADDRESS_ENV) or None)
    if address is not None and (num_cpus is not None or num_gpus is not None):
        raise RlcoreError(
            f"num_cpus/num_gpus only apply to a local Ray; attaching to '{address}' uses that cluster's "
            f"resources. Drop the overrides, or unset {ADDRESS_ENV} to start a local Ray."
        )
    if ray.is_initialized():
        _take_worker_warnings()
        return ray.cluster_resources()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is not None:
        check_reachable(address)  # ray.init retries an address where nothing answers for minutes
    watchdog.reset()
    reap()
    try:
        with signals.ray_sigterm():  # ray.init replaces the SIGTERM handler
            if address is None:
                _start_local(num_cpus=num_cpus, num_gpus=num_gpus, namespace=namespace)
            elif _is_loopback(address):  # a Ray on 127.0.0.1 (e.g. one rlcore started): Ray would use the host's address
                with _loopback_kept():
                    ray.init(address=address, namespace=namespace)
            else:
                ray.init(address=address, namespace=namespace)
    except ConnectionError as exc:
        raise RlcoreError(
            f"cannot attach to the Ray cluster at '{address}': {exc}. Start it with `ray start --head`, "
            f"or leave the address (and {ADDRESS_ENV}) unset to start a local Ray."
        ) from exc
    _take_worker_warnings()
    return ray.cluster_resources()


def _take_worker_warnings() -> None:
    """The workers' output Ray forwards passes rlcore's log before Ray prints it (`log.take_worker_lines`), so a
    library's warning in a worker lands in run.log. Ray's dispatcher is private: without it the lines print as
    they are."""
    try:
        from ray._private.worker import global_worker_stdstream_dispatcher as dispatcher

        with dispatcher._lock:
            others = [pair for pair in dispatcher.handlers if pair[0] != "rlcore_warnings"]
            dispatcher.handlers = [("rlcore_warnings", log.take_worker_lines), *others]
    except (ImportError, AttributeError):
        pass


@contextlib.contextmanager
def _loopback_kept() -> Iterator[None]:
    """While Ray starts or connects, 127.0.0.1 stays the address given (see the module docstring)."""
    from ray._private import ray_constants

    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode


@contextlib.contextmanager
def _no_head_extras() -> Iterator[None]:
    """While a local Ray starts: no dashboard process and no autoscaler monitor. Ray 2.60 starts both even
    with include_dashboard=False (a usage-stats module and the autoscaler, each with a metrics port); one
    machine's Ray needs neither. A dashboard is had by starting Ray yourself (`ray start --head`) and
    attaching with `ray_address`."""
    from ray._private.node import Node

    saved = {name: getattr(Node, name) for name in ("start_api_server", "start_monitor") if hasattr(Node, name)}
    for name in saved:
        setattr(Node, name, lambda self, **kwargs: None)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)


@contextlib.contextmanager
def _own_process_groups() -> Iterator[None]:
    """While a local Ray starts: its processes (GCS, raylet, and through the raylet the workers) each lead a
    process group of their own. A signal to the driver's group (Ctrl-C in a terminal, `kill -TERM -PGID`)
    then reaches the driver alone, which finishes its step, saves and stops Ray itself; before, the SIGTERM
    also ended GCS and the raylet mid-step, and the driver's wait for that step's result could hang. Ray
    does the same on Windows, and on Linux blocks SIGINT (not SIGTERM) in these processes for this reason.
    Only where Ray ties its processes to the driver's life (PR_SET_PDEATHSIG): otherwise its reaper ends
    them by signalling its own process group."""
    from ray._private import services, utils

    if not sys.platform.startswith("linux") or not utils.detect_fate_sharing_support():
        yield
        return
    popen = services.ConsolePopen

    class GroupLeader(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            inner = kwargs.get("preexec_fn")

            def preexec() -> None:
                os.setpgid(0, 0)
                if inner is not None:
                    inner()

            kwargs["preexec_fn"] = preexec
            super().__init__(*args, **kwargs)
            _groups.append(self.pid)  # its group: what it starts stays in it (the raylet's agents)

    services.ConsolePopen = GroupLeader
    try:
        yield
    finally:
        services.ConsolePopen = popen


REACH_TIMEOUT_S = 10.0  # how long an attach waits for anything to answer at ray_address


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise RlcoreError naming `address` unless something accepts a TCP connection there within `timeout_s`
    (a `ray://` client address, or a bare host with Ray's default GCS port 6379); 'auto' is Ray's to find."""
    import socket
    import time

    if address == "auto":
        return
    target = address.split("://", 1)[1] if "://" in address else address
    target = target.split("/", 1)[0]
    host, colon, port = target.rpartition(":")
    if not colon or not port.isdigit():
        host, port = target, "10001" if address.startswith("ray://") else "6379"
    host = host.strip("[]")
    deadline, why = time.monotonic() + timeout_s, ""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.5, min(left, 5.0))):
                return
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
            if isinstance(exc, socket.gaierror) or isinstance(exc, ValueError) or left <= 1.0:
                break
        time.sleep(1.0)
    raise RlcoreError(
        f"ray_address '{address}': nothing answers at {host}:{port} ({why}) within {timeout_s:g}s. Check that "
        f"the head node runs (`ray status` there), the address and port (the head's GCS, 6379 by default), and "
        f"that no firewall is between; or leave ray_address (and {ADDRESS_ENV}) unset to start a local Ray."
    )


def _is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _start_local(**options: Any) -> None:
    """A new local Ray whose every listener is on 127.0.0.1, recorded for `reap`."""
    import ray

    # Its processes inherit this environment: vLLM's Ray executor must see the node's address as Ray does;
    # no Prometheus endpoints (they answer anyone who can connect, without Ray's token).
    inherited = {key: value for key, value in (("VLLM_HOST_IP", "127.0.0.1"), ("RAY_enable_metrics_collection", "0"))
                 if key not in os.environ}
    os.environ.update(inherited)
    started = time.time()
    _groups.clear()  # this start's groups only: an earlier start's pids may belong to someone else by now
    try:
        with _loopback_kept(), _no_head_extras(), _own_process_groups():
            ray.init(
                address="local",  # a new Ray here, never a cluster some other process left running
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                dashboard_host="127.0.0.1",
                **options,
            )
        _record(ray._private.worker._global_node)  # a signal while it records: the start is ended below too
    except BaseException:  # SIGTERM mid-start (Ray's handler: SystemExit), a failed start: not yet recorded
        _end(_ray_children_since(started) + _in_groups(_groups))  # agents whose raylet is gone: by their group
        raise
    finally:
        for key in inherited:
            os.environ.pop(key, None)
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown)  # before Ray's own atexit shutdown, which leaves the record behind
        _atexit_registered = True


# -------------------------------------------------------------------------
# teardown: what a SIGKILLed driver left
# -------------------------------------------------------------------------

RECORDS = Path(tempfile.gettempdir()) / f"rlcore-ray-{os.getuid()}"
_groups: list[int] = []  # the process groups the local Ray's processes started here lead (their pids)
_record_path: Path | None = None  # the record of the local Ray this process started
_atexit_registered = False


def _record(node: Any) -> None:
    """Write down the local Ray's node and processes, keyed by this driver's pid."""
    global _record_path
    import psutil

    me = psutil.Process()
    started = [info.process.pid for infos in node.all_processes.values() for info in infos]
    processes = []
    for pid in started:
        try:
            process = psutil.Process(pid)
            processes += [process, *process.children(recursive=True)]
        except psutil.Error:
            continue
    pids = []
    for process in processes:
        try:
            pids.append([process.pid, process.create_time()])
        except psutil.Error:
            continue
    record = {"driver": [me.pid, me.create_time()], "node_id": node.node_id,
              "session_dir": node.get_session_dir_path(), "pids": pids, "groups": list(_groups)}
    try:
        RECORDS.mkdir(mode=0o700, exist_ok=True)
        path = RECORDS / f"{me.pid}.json"
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)
    except OSError as exc:  # the run works without it; only a SIGKILL's leftovers would stay
        logger.info(f"cannot record the local Ray in {RECORDS} ({exc}); a killed run's Ray processes "
                    f"will not be cleaned up")
        return
    _record_path = path


def _leftovers(record: dict[str, Any]) -> list[Any]:
    """The live processes of a recorded local Ray: those recorded (same pid and start time) and any
    other whose RAY_NODE_ID is the record's node (agents and workers started after the record)."""
    import psutil

    mine, found = os.getpid(), {}
    for pid, created in record.get("pids", []):
        try:
            process = psutil.Process(pid)
            if pid != mine and abs(process.create_time() - created) < 0.05:
                found[pid] = process
        except psutil.Error:
            continue
    node_id = record.get("node_id")
    if node_id:
        for process in psutil.process_iter():
            if process.pid == mine or process.pid in found:
                continue
            try:
                if process.uids().real == os.getuid() and process.environ().get("RAY_NODE_ID") == node_id:
                    found[process.pid] = process
            except psutil.Error:
                continue
    for process in _in_groups(record.get("groups", [])):
        found.setdefault(process.pid, process)
    return [p for p in found.values() if _running(p)]


def _in_groups(groups: list[int]) -> list[Any]:
    """This user's live processes in `groups`, the process groups that the local Ray's GCS and raylet lead
    (`_own_process_groups`): Ray's dashboard and runtime-env agents stay in their raylet's group when it is
    gone before them, reparented to init, their environment hidden by their process titles."""
    import psutil

    if not groups:
        return []
    wanted, mine, found = set(groups), os.getpid(), []
    for process in psutil.process_iter():
        try:
            if (process.pid != mine and process.uids().real == os.getuid() and os.getpgid(process.pid) in wanted
                    and _running(process)):
                found.append(process)
        except (OSError, psutil.Error):
            continue
    return found


def _ray_children_since(started: float) -> list[Any]:
    """This process's descendants started since `started` (time.time()) that are Ray's: what a local Ray
    whose start was cut short had started (its agents outlive the raylet that Ray's shutdown ends)."""
    import psutil

    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.create_time() >= started - 0.05 and "ray" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _running(process: Any) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end(processes: list[Any], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL for what is still there after `grace` seconds."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)


def _driver_alive(pid: int, created: float) -> bool:
    import psutil

    try:
        process = psutil.Process(pid)
        return abs(process.create_time() - created) < 0.05 and _running(process)
    except psutil.Error:
        return False


def reap() -> list[int]:
    """End the local Rays whose rlcore driver died without stopping them (a SIGKILL); returns the pids
    ended. Only Rays rlcore started are recorded, so a cluster someone else started is never touched."""
    if not RECORDS.is_dir():
        return []
    ended: list[int] = []
    for path in sorted(RECORDS.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            pid, created = record["driver"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a record of ours, or one being written
        if pid == os.getpid() or _driver_alive(pid, created):
            continue
        processes = _leftovers(record)
        if processes:
            _end(processes)
            ended += [p.pid for p in processes]
            logger.info(f"ended {len(processes)} process(es) of the local Ray of a driver that died (pid "
                        f"{pid}, {record.get('session_dir', '?')})")
        path.unlink(missing_ok=True)
    return ended


SHUTDOWN_S = 5.0  # ray.shutdown() waits on the raylet; a stopped one would hold the exit for good


def shutdown() -> None:
    """Disconnect from Ray; a local Ray started here stops with it, to its last agent. Where Ray does not
    answer (`rlcore.watchdog`), the local Ray's processes are ended first, which ends Ray's wait on them."""
    global _record_path
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        _disconnect(ray)
    if _record_path is not None:
        end_local()
        _record_path = None
    signals.restore_sigterm()


_AFTER_EXIT = """
import os, sys, time
import psutil
from rlcore.runtime import cluster
try:
    psutil.Process(int(sys.argv[1])).wait(timeout=30)
except (psutil.Error, psutil.TimeoutExpired):
    pass
cluster.reap()
"""


def end_local(after_exit: bool = False) -> None:
    """End the processes of the local Ray started here, found by its record, without asking Ray: for an exit
    that cannot wait on Ray (a stopped raylet, an exit deadline). `after_exit`: by a process of its own once
    this one has exited (`reap`), for a process about to `os._exit` with a status of its own: Ray's core
    worker here ends the process with status 1 as soon as its raylet is gone."""
    if _record_path is None:
        return
    if after_exit:
        import subprocess

        try:
            subprocess.Popen([sys.executable, "-c", _AFTER_EXIT, str(os.getpid())], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return
        except OSError:
            pass
    try:
        _end(_leftovers(json.loads(_record_path.read_text())))
        _record_path.unlink(missing_ok=True)
    except (OSError, ValueError):
        pass


def exit_now(code: int) -> None:
    """End this process with `code` at once (run.log and the streams flushed), and the local Ray started here once
    it is gone: ended first, its store would fail a call still blocked on it (the watchdog's probe, a put of a call's
    arguments) and Ray's core worker here would end the process with status 1."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    end_local(after_exit=True)
    os._exit(code)


def _disconnect(ray: Any) -> None:
    """ray.shutdown(), bounded: SHUTDOWN_S, then (or at once, when Ray already did not answer a call) the
    local Ray's processes are ended and it gets as long again. A cluster this process attached to is left to
    itself, and Ray's own exit hook too (it would wait the same way), with a warning."""
    done = threading.Event()

    def stop() -> None:
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 - what is left of Ray is ended below
            pass
        finally:
            done.set()

    def start() -> None:
        threading.Thread(target=stop, daemon=True, name="rlcore-ray-shutdown").start()

    if watchdog.stuck() is not None and watchdog.stop_asked() and _record_path is not None:
        # leaving on a signal, with Ray's own processes not answering: `signals.leaving` ends them and the
        # process with the signal's status (ending them now, Ray's core worker here would end the process
        # with status 1 as soon as its raylet is gone)
        return
    if watchdog.stuck() is None:
        start()
        if done.wait(SHUTDOWN_S):
            return
        code = signals.leaving_with()
        if code is not None and _record_path is not None:
            # a signal stopped the run and Ray's shutdown hangs (a stopped raylet): the status is the signal's
            exit_now(code)
    end_local()
    if watchdog.stuck() is not None:
        start()
    if not done.wait(SHUTDOWN_S):
        atexit.unregister(ray._private.worker.shutdown)
        logger.warning(f"Ray did not shut down within {SHUTDOWN_S:g}s; this process leaves it as it is")


def gcs_answers(timeout_s: float = 2.0) -> bool:
    """Whether the cluster's GCS answers within `timeout_s`. Ray's calls that need it (removing a placement
    group) wait 60 s for a dead GCS, then end the process; a teardown asks this first."""
    import ray

    try:
        ray._private.worker.global_worker.gcs_client.internal_kv_get(b"rlcore-ping", None, timeout=timeout_s)
    except ray.exceptions.RpcError:
        return False
    return True


def is_initialized() -> bool:
    """Whether this process is connected to Ray (without importing Ray when it is not loaded)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


KILL_S = 10.0


def kill(actors: Iterable[Any]) -> None:
    """Kill actors without restarting them; ones already dead are ignored. Where Ray does not answer
    (`rlcore.watchdog`), nothing is asked of it: the actors end with the local Ray, or the cluster."""
    import ray

    def each() -> None:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor that is already gone needs no killing
                pass

    if watchdog.stuck() is None:
        try:
            watchdog.bounded(each, "killing actors", KILL_S)
        except watchdog.RayStuck:
            pass


def _first_line(text: str, limit: int = 400) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:limit]


def _last_line(text: str, limit: int = 400) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:limit]


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
    failure = None
    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
        if isinstance(getattr(cause, "client_exc", None), BaseException):  # Ray's RaySystemError wraps its cause
            cause = cause.client_exc
        failure = failures.failure_of(cause)  # what the worker raised, summarised there (rlcore.runtime.actors)
        if failure is None:  # raised by Ray's side of the call: Ray's own text is the traceback
            failure = failures.Failure(role, rank, node, pid, method, type(cause).__name__,
                                       failures.summarize(cause), str(cause), str(exc))
        message = failure.line()
    elif is_death(exc):
        text = getattr(exc, "error_msg", "") or str(exc)
        # an actor whose creation raised: the last line of the traceback Ray quotes names the exception
        cause = _last_line(text) if getattr(exc, "actor_init_failed", False) else _first_line(text)
        message = (
            f"{where} died during {method}(): {cause}. The group's other workers were stopped; see the "
            f"worker's log (`ray logs`) and the node's memory for why the process exited."
        )
        failure = failures.Failure(role, rank, node, pid, method, type(exc).__name__, cause, text, text)
    else:
        message = f"{where} failed in {method}(): {exc!r}"
    return RoleFailed(message, role=role, rank=rank, node=node, failure=failure)
