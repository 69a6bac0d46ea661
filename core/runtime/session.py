"""`RoleSession`: an algorithm's roles as worker groups, built from the resource plan.

Everything about where a role runs comes from the `ResourcePlan` (either YAML form): how many workers
it has, on which devices, its data-parallel size, and which roles share GPUs. The session starts and
stops the groups (in this process, or as Ray actors on placement-group bundles), lets colocated roles
take turns on their GPUs (`active`), and moves weights from one role to another with the transport the
placement allows:

- `in_process`: no Ray; every role lives in this process and tensors are handed over directly;
- `cuda_ipc`: colocated GPU roles; each sender rank hands every process holding receiver weights on its GPU
  (a rollout worker, or each worker of a tensor-parallel vLLM) CUDA IPC handles of two flat buffers it
  packs bucket by bucket, in turn, so the model is never held twice;
- `nccl` (`gloo` on the CPU): separate roles; the sender's rank 0 broadcasts flat buckets over a
  process group of its own to every receiving process;
- `object_store`: through Ray's object store (CPU runs, or chosen by `weight_sync_backend`).

It knows no algorithm: an algorithm says which roles it runs and how to build each (`RoleSetup`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cluster, workers
from .. import manager
from .actors import wait
from .dispatch import Mesh
from ..engine_checks import resolve_dtype
from ..errors import ConfigError, RoleFailed
from .placement import allocate, release
from ..log import logger
from .resources import ResourcePlan, rank_ranges
from .workers import bind

TRANSPORTS = ("auto", "in_process", "object_store", "nccl", "gloo", "cuda_ipc")


@dataclass(frozen=True)
class RoleSetup:
    """How to build one role's workers: a worker class (bound to the role's name when its group is
    made), the engine (a registered name or a factory), its options and the engine kind."""

    worker: type
    engine: Any
    options: dict[str, Any] = field(default_factory=dict)
    kind: str | None = None  # None: the worker class's default kind

    @property
    def restartable(self) -> bool:
        """Whether a lost worker of the role may be built again mid-run (`max_restarts`): its worker class holds no
        training state (`holds_state` False: generators, scorers), or it builds a forward-only engine."""
        return getattr(self.worker, "holds_state", True) is False or self.kind == "forward"

    @property
    def engine_name(self) -> str:
        """The engine as a user knows it: its registered name, or a factory's `display_name` (else its name)."""
        if isinstance(self.engine, str):
            return self.engine
        return getattr(self.engine, "display_name", None) or getattr(self.engine, "__name__", repr(self.engine))


class RoleSession:
    """The running roles of one algorithm; use `with session.start(): ...`, then `session[role]`.

    `syncs` names the (source, destination) role pairs whose weights `sync_weights` moves, so broadcast
    groups and CUDA IPC pairs are set up at start. `sleep_level`, `offload_model` and `offload_optimizer`
    say what colocated roles release while another one holds their GPUs. `max_restarts` (Ray only): how often a
    worker of a `restartable` role that died is restarted, given back its weights (`restore`) and sent its call again;
    the roles in `recoverable` (the one a trainer's checkpoints hold) are restarted whole, and the call raises
    RoleRestarted for the trainer to resume its last checkpoint.
    """

    def __init__(
        self,
        plan: ResourcePlan,
        setups: dict[str, RoleSetup],
        *,
        use_ray: bool,
        plugins: Any = None,
        syncs: tuple[tuple[str, str], ...] = (),
        ray_address: str | None = None,
        placement_timeout_s: float = 60.0,
        sleep_level: int = 1,
        offload_model: bool = False,
        offload_optimizer: bool = False,
        weight_sync_backend: str = "auto",
        worker_timeout_s: float | None = 1800.0,
        max_restarts: int = 0,
        recoverable: tuple[str, ...] = (),
    ):
        missing = [r for r in setups if r not in plan.roles]
        if missing:
            raise ConfigError(f"roles {missing} have no place in the resource plan (its roles: {', '.join(plan.roles)})")
        if max_restarts and not use_ray:
            raise ConfigError(f"max_restarts: {max_restarts} restarts lost Ray workers, but this run has no Ray (every "
                              "role runs in this process, whose loss is the run's); add --use-ray, or set max_restarts 0",
                              [("max_restarts", "needs --use-ray")])
        if weight_sync_backend not in TRANSPORTS:
            raise ConfigError(f"weight_sync_backend '{weight_sync_backend}' is unknown; use one of {', '.join(TRANSPORTS)}")
        self.plan, self.setups, self.use_ray, self.plugins = plan, dict(setups), use_ray, plugins
        self.syncs = tuple(syncs)
        self.ray_address, self.placement_timeout_s = ray_address, placement_timeout_s
        self.sleep_level, self.offload_model, self.offload_optimizer = sleep_level, offload_model, offload_optimizer
        self.weight_sync_backend = weight_sync_backend
        self.worker_timeout_s = worker_timeout_s  # a Ray call without a result for this long: RoleFailed
        self.max_restarts = max_restarts
        self.recoverable = tuple(r for r in recoverable if r in setups)
        self.synced: dict[tuple[str, str], tuple[str, Any]] = {}  # the last sync per pair: what `restore` repeats
        self.syncing: str | None = None  # the transport of a broadcast or IPC sync under way
        self.groups: dict[str, Any] = {}
        self.asleep: dict[str, set[str]] = {}  # a sleeping role: the memory tags it released
        self.transports: dict[tuple[str, str], str] = {}
        self.ipc_sources: dict[tuple[str, str], list[int]] = {}  # cuda_ipc: per receiver, the sender rank on its GPU
        self.adapter_dirs: dict[tuple[str, str], Path] = {}  # adapter-only syncs: the folder `dst` serves now

    CONFIG_KEYS = ("ray_address", "placement_timeout_s", "worker_timeout_s", "sleep_level", "offload_model",
                   "offload_optimizer", "weight_sync_backend", "max_restarts")

    @classmethod
    def from_config(cls, config: Any, plan: ResourcePlan, setups: dict[str, RoleSetup], *, use_ray: bool,
                    plugins: Any = None, **options: Any) -> RoleSession:
        """A session with the run's own keys (`CONFIG_KEYS`, those the config has: every `RunConfig` has all
        but `weight_sync_backend`); `options` (e.g. `syncs`) are added and win."""
        found = {key: getattr(config, key) for key in cls.CONFIG_KEYS if hasattr(config, key)}
        return cls(plan, setups, use_ray=use_ray, plugins=plugins, **{**found, **options})

    # -- what the plan says --------------------------------------------------------------------------

    @property
    def roles(self) -> list[str]:
        return list(self.setups)

    def workers(self, role: str) -> int:
        """The role's worker count: the plan's on Ray; one in-process worker without it."""
        return self.plan.num_workers(role) if self.use_ray else 1

    def mesh(self, role: str) -> Mesh:
        """The role's parallel layout: its engine's `layout` of its options (`EngineSpec.layout`, or a factory's
        `layout` attribute: tensor x pipeline workers per model replica; (1, 1) without one) splits its workers, the
        rest is data parallel. A worker count they do not divide is a ConfigError, before anything starts."""
        tp, pp = self.layout(role)
        n = self.workers(role)
        if tp < 1 or pp < 1 or n % (tp * pp):
            hint = "" if self.use_ray else " (one worker in this process: run with --use-ray and GPUs)"
            raise ConfigError(
                f"{role}: tensor x pipeline = {tp} x {pp} does not divide the role's {n} worker(s){hint}",
                [(role, f"its engine's tensor x pipeline size ({tp} x {pp}) does not divide the role's workers")],
            )
        return Mesh(dp=n // (tp * pp), tp=tp, pp=pp)

    def layout(self, role: str) -> tuple[int, int]:
        """(tensor, pipeline) workers per model replica, as the role's engine says for its options."""
        setup = self.setups[role]
        if isinstance(setup.engine, str):
            plugins = self.plugins or manager.plugins()
            layouts = [spec.layout for spec in plugins.engines if spec.name == setup.engine and spec.layout]
            layout = layouts[0] if layouts else None
        else:
            layout = getattr(setup.engine, "layout", None)
        if layout is None:
            return 1, 1
        tp, pp = layout(**setup.options)
        return int(tp), int(pp)

    def dp_size(self, role: str) -> int:
        """The data-parallel size of a train-like role: its workers over its tensor x pipeline size."""
        return self.mesh(role).dp

    def device(self, role: str) -> str:
        """'cuda' for a role on GPU ranks, 'cpu' otherwise; an engine option `device` wins."""
        given = self.setups[role].options.get("device")
        if given:
            return "cuda" if str(given).startswith("cuda") else str(given)
        return "cuda" if self.plan.group_of(role).device == "GPU" else "cpu"

    def colocated(self, a: str, b: str) -> bool:
        """`a` and `b` share GPU ranks, so they take turns on them."""
        return a != b and bool(set(self.plan.ranks_of(a)) & set(self.plan.ranks_of(b)))

    def colocated_with(self, role: str) -> list[str]:
        return [r for r in self.setups if self.colocated(role, r)]

    def describe(self) -> list[str]:
        """One line per role: `train: 2 workers, GPU 0-1 (gpus: auto; shared with rollout), engine hf, bfloat16` (gpus:
        auto where that default chose the GPUs); the dtype is the one the role's model loads in (`auto` resolved for its
        device and checkpoint)."""
        lines = []
        for role, setup in self.setups.items():
            n = self.workers(role)
            ranks = self.plan.ranks_of(role)
            if not self.use_ray:
                where = "in this process" + (f" on {self.device(role)}" if self.device(role) != "cpu" else "")
            elif ranks:
                where = f"GPU {rank_ranges(ranks)}"
            else:
                where = "CPU"
            shared = self.colocated_with(role)
            notes = (["gpus: auto"] if role in self.plan.auto else []) + ([f"shared with {', '.join(shared)}"] if shared else [])
            if notes:
                where += f" ({'; '.join(notes)})"
            dtype = setup.options.get("dtype")
            if dtype is not None and setup.options.get("model"):
                dtype = resolve_dtype(dtype, setup.options["model"], self.device(role) == "cuda")
            lines.append(f"{role}: {n} worker{'s' if n != 1 else ''}, {where}, engine {setup.engine_name}"
                         + (f", {dtype}" if dtype else ""))
        return lines

    # -- lifecycle ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def start(self) -> Iterator[RoleSession]:
        """Allocate the plan (Ray), build every role's group in order, join the weight-sync groups, put
        colocated generators to sleep; stop and release everything on the way out. The worker runtime the
        roles run in is given the session's plugins: workers resolve engines and names with them."""
        try:
            with self._placement():
                for role in list(self.setups)[1:]:  # their imports run while the roles before them build
                    workers.start_ahead(bind(self.setups[role].worker, role), role, self.imports(role))
                for role in self.setups:
                    self.groups[role] = self._build(role)
                    remote = workers.remote_group(self.groups[role], role)
                    if remote is not None and remote.max_restarts:
                        remote.on_restart = functools.partial(self.restore, role)
                for src, dst in self.syncs:
                    self._connect(src, dst)
                for role in self.setups:
                    if self._sleeps(role):
                        self.sleep(role)
                yield self
        finally:
            self.groups.clear()
            self.asleep.clear()
            self.synced.clear()
            for path in self.adapter_dirs.values():  # the last synced adapters (a run's final/ holds the trained one)
                shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(OSError):
                    path.parent.rmdir()  # the root, once empty
            self.adapter_dirs.clear()

    def __getitem__(self, role: str) -> Any:
        if role not in self.groups:
            raise KeyError(f"role '{role}' is not running; running: {', '.join(self.groups) or '(none)'}")
        return self.groups[role]

    def get(self, role: str) -> Any:
        return self.groups.get(role)

    def imports(self, role: str) -> tuple[str, ...]:
        """The heavy modules the role's engine imports (its `EngineSpec.imports`, of any kind by that name)."""
        engine = self.setups[role].engine
        if not isinstance(engine, str):
            return tuple(getattr(engine, "imports", ()))
        plugins = self.plugins or manager.plugins()
        return tuple(dict.fromkeys(m for spec in plugins.engines if spec.name == engine for m in spec.imports))

    def _build(self, role: str) -> Any:
        setup = self.setups[role]
        options = dict(setup.options)
        options.setdefault("device", self.device(role))
        args = (setup.engine, options) + ((setup.kind,) if setup.kind else ())
        return bind(setup.worker, role)(*args)

    @contextlib.contextmanager
    def _placement(self) -> Iterator[None]:
        """The worker runtime the roles run in: in this process, or on the plan's placement groups."""
        if not self.use_ray:
            with workers.runtime(use_ray=False, plugins=self.plugins):
                yield
            return
        cluster.init(self.ray_address)
        slots = allocate(self.plan, timeout_s=self.placement_timeout_s)
        try:
            meshes = {r: self.mesh(r) for r in self.setups}
            restarts = {r: self.max_restarts for r, setup in self.setups.items()
                        if setup.restartable or r in self.recoverable}
            with workers.runtime({r: slots[r] for r in self.setups}, use_ray=True, meshes=meshes,
                                 call_timeout=self.worker_timeout_s, plugins=self.plugins, max_restarts=restarts,
                                 holds_state=frozenset(r for r in self.recoverable if not self.setups[r].restartable)):
                yield
        finally:
            release(slots)

    # -- lost workers ---------------------------------------------------------------------------------

    def restore(self, role: str, ranks: list[int]) -> None:
        """`role`'s workers `ranks` were restarted (Ray, `max_restarts`) and built afresh: they sleep again if the
        role sleeps, and every role that syncs weights into `role` syncs them again as it last did (a new
        broadcast group or IPC pairing first), so the restarted workers generate with the weights the others have.
        A role that sends weights (a rebuilt train role) joins new broadcast groups or IPC pairings; its trainer syncs
        once it loaded its checkpoint."""
        if self.syncing:  # its peers in the broadcast or IPC transfer wait on it: the transfer cannot be sent again
            raise RoleFailed(f"role '{role}' lost a worker during a weight sync over {self.syncing}, which is not "
                             "retried (a lost worker is, between syncs and over object_store); continue with --resume",
                             role=role)
        if self.asleep.get(role):  # a restarted engine starts awake: it releases what the role's others released
            remote = workers.remote_group(self[role], role)
            remote.call_ranks("sleep", ranks, self.sleep_level)
            woken = sorted({"weights", "kv_cache"} - self.asleep[role])
            if woken:
                remote.call_ranks("wake_up", ranks, woken)
        for src, dst in self.syncs:
            if src == role and self.transports.get((src, dst)) in ("nccl", "gloo", "cuda_ipc"):
                self._connect(src, dst)
        for (src, dst), (how, arg) in list(self.synced.items()):
            if dst != role:
                continue
            if self.transports.get((src, dst)) in ("nccl", "gloo", "cuda_ipc"):
                self._connect(src, dst)
            if how == "adapter":
                self.sync_adapter(src, dst, arg)
            else:
                self.sync_weights(src, dst, arg)
            logger.info(f"role '{dst}': restarted rank(s) {', '.join(map(str, ranks))} given {src}'s weights again")

    @contextlib.contextmanager
    def _syncing(self, transport: str) -> Iterator[None]:
        self.syncing = transport
        try:
            yield
        finally:
            self.syncing = None

    def processes(self) -> dict[str, list[int]]:
        """The pid of each running role's workers, by rank (a Ray actor's process, or this process without Ray), so a
        tool reading per-process GPU memory (NVML) can tell the roles apart; a restarted worker's new pid."""
        out = {}
        for role, instance in self.groups.items():
            remote = workers.remote_group(instance, role)
            out[role] = [info["pid"] for info in remote.infos] if remote is not None else [os.getpid()]
        return out

    def restarts(self) -> dict[str, int]:
        """`restarts/<role>`: the restarts of each restartable or recoverable role's workers so far (with max_restarts
        on Ray; empty otherwise): a counter, for the metrics."""
        counts = {}
        for role in self.setups:
            remote = workers.remote_group(self.groups[role], role) if role in self.groups else None
            if remote is not None and remote.max_restarts:
                counts[f"restarts/{role}"] = remote.restarted
        return counts

    # -- colocated roles take turns -------------------------------------------------------------------

    def _sleeps(self, role: str) -> bool:
        """A generating role that shares GPUs sleeps whenever it is not the active one."""
        return bool(self.sleep_level) and hasattr(self[role], "sleep") and bool(self.colocated_with(role))

    def sleep(self, role: str) -> None:
        if role not in self.asleep:
            self[role].sleep(self.sleep_level)
            self.asleep[role] = {"weights", "kv_cache"}

    def wake(self, role: str, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Take back what of `tags` the role released; waking twice is never asked of an engine."""
        missing = [t for t in tags if t in self.asleep.get(role, ())]
        if missing:
            self[role].wake_up(missing)
            self.asleep[role] -= set(missing)

    @contextlib.contextmanager
    def active(self, role: str) -> Iterator[None]:
        """`role` holds its GPUs: colocated train roles offload what the config says (gradients always),
        a sleeping `role` wakes; on the way out it sleeps again and the others reload."""
        others = [r for r in self.colocated_with(role) if hasattr(self[r], "offload")]
        for other in others:
            self[other].offload(params=self.offload_model, grads=True, optimizer=self.offload_optimizer)
        self.wake(role)
        try:
            yield
        finally:
            if self._sleeps(role):
                self.sleep(role)
            for other in others:
                self[other].reload(params=self.offload_model, grads=False, optimizer=self.offload_optimizer)

    # -- weights from one role to another -------------------------------------------------------------

    def transport(self, src: str, dst: str) -> str:
        """How weights go from `src` to `dst`, from the placement (see the module docstring)."""
        if not self.use_ray:
            return "in_process"
        if self.weight_sync_backend != "auto":
            return self.weight_sync_backend
        if self.device(src) != "cuda" or self.device(dst) != "cuda":
            return "object_store"
        return "cuda_ipc" if self.colocated(src, dst) else "nccl"

    def _connect(self, src: str, dst: str) -> None:
        transport = self.transports[(src, dst)] = self.transport(src, dst)
        if transport in ("nccl", "gloo"):
            sender, receiver = self[src], self[dst]
            host, port = sender.weight_group_address()
            world_size = 1 + sum(receiver.weight_receivers())
            wait([sender.join_weight_group(host, port, world_size, transport),
                  receiver.join_weight_group(host, port, world_size, transport)], timeout=self.placement_timeout_s)
        elif transport == "cuda_ipc":
            self.ipc_sources[(src, dst)] = self._pair_by_gpu(src, dst)

    def _pair_by_gpu(self, src: str, dst: str) -> list[list[int]]:
        """For each `dst` worker, for each process holding its weights (one, or a tensor-parallel vLLM's
        workers), the `src` rank on the same GPU: CUDA IPC maps memory within one GPU."""
        senders, receivers = self[src].gpu_uuid(), self[dst].weight_receiver_gpus()
        missing = [(r, uuid) for r, gpus in enumerate(receivers) for uuid in gpus if uuid not in senders]
        if missing:
            raise ConfigError(
                f"weight_sync_backend cuda_ipc: {dst} workers {sorted({r for r, _ in missing})} hold weights on GPUs "
                f"{sorted({u for _, u in missing})} where no {src} worker runs ({src} GPUs {senders}); colocate {src} "
                f"and {dst} on the same GPUs, or use object_store"
            )
        return [[senders.index(uuid) for uuid in gpus] for gpus in receivers]

    def sync_weights(self, src: str, dst: str, bucket_bytes: int = 512 << 20) -> dict[str, float]:
        """`src` rank 0's weights into every `dst` worker, bucketed; returns seconds and GB/s."""
        start = time.perf_counter()
        phases: dict[str, float] = {}  # broadcast and IPC: seconds per phase of the senders and the slowest receiver
        transport = self.transports.get((src, dst)) or self.transport(src, dst)
        sender, receiver = self[src], self[dst]
        if transport in ("nccl", "gloo"):  # the receive queues behind a generation still in flight
            with self._syncing(transport):
                sent, received = wait([sender.send_weights(bucket_bytes), receiver.receive_weights()])
            nbytes = sent["weight_sync/bytes"]
            receivers = [stats for stats in (received if isinstance(received, list) else [received]) if stats]
            for stats in [sent, *receivers]:
                for key in (k for k in stats if k.endswith("_s")):
                    phases[key] = max(phases.get(key, 0.0), stats[key])
            if receivers:  # how long the last receiver took to get to the sync (behind a generation in flight)
                own = min(stats.get("weight_sync/recv_s", 0.0) + stats.get("weight_sync/load_s", 0.0) for stats in receivers)
                phases["weight_sync/queue_s"] = max(0.0, time.perf_counter() - start - own)
        elif transport == "cuda_ipc":
            self.wake(dst, ("weights",))
            with self._syncing(transport):
                nbytes, phases = self._sync_ipc(src, dst, bucket_bytes)
        else:
            self.wake(dst, ("weights",))
            buckets = sender.export_weights(bucket_bytes)
            receiver.update_weights(buckets)
            nbytes = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
        self.synced[(src, dst)] = ("weights", bucket_bytes)
        seconds = time.perf_counter() - start
        return {"weight_sync/seconds": seconds, "weight_sync/gb_per_s": nbytes / seconds / 1e9, **phases}

    def sync_adapter(self, src: str, dst: str, root: str) -> dict[str, float]:
        """`src`'s LoRA adapter alone into every `dst` worker (the base weights stay), through a new PEFT folder under
        `root`, which `src`'s rank 0 writes and each `dst` worker reads: one node, or a filesystem both share. The
        folder of the sync before is removed once `dst` serves the new one; the last one when the session stops."""
        start = time.perf_counter()
        Path(root).mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="sync-", dir=Path(root).resolve()))
        try:
            nbytes = self[src].export_adapter(str(path))
            self.wake(dst, ("weights",))
            self[dst].load_adapter(str(path))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        previous, self.adapter_dirs[(src, dst)] = self.adapter_dirs.get((src, dst)), path
        self.synced[(src, dst)] = ("adapter", root)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        seconds = time.perf_counter() - start
        return {"weight_sync/seconds": seconds, "weight_sync/gb_per_s": nbytes / seconds / 1e9, "weight_sync/bytes": nbytes}

    def _sync_ipc(self, src: str, dst: str, bucket_bytes: int) -> tuple[int, dict[str, float]]:
        """Bucket by bucket: every sender rank packs a bucket into one of its two kept buffers and hands out
        its handle; each receiving process loads from the sender on its GPU. Returns the bytes per receiver
        and the seconds of packing (the slowest sender's, bucket by bucket) and loading (the slowest receiver's)."""
        sender, receiver, sources = self[src], self[dst], self.ipc_sources[(src, dst)]
        nbytes, pack_s, load_s = 0, 0.0, 0.0
        payloads = sender.next_ipc_bucket(bucket_bytes).get()
        while payloads[0] is not None:
            # the receivers load bucket i while the senders pack bucket i+1 into their other buffer
            loaded = receiver.load_ipc_bucket([[payloads[rank] for rank in ranks] for ranks in sources])
            following = sender.next_ipc_bucket()
            nbytes += payloads[0]["nbytes"]
            pack_s += max(p["pack_s"] for p in payloads)
            seconds, payloads = wait([loaded, following])
            load_s += max(seconds)
        receiver.finish_weight_update()
        return nbytes, {"weight_sync/pack_s": pack_s, "weight_sync/load_s": load_s}

    def check_weight_sync(self, src: str, dst: str, sequence: list[int]) -> float:
        """After a sync, `dst` must score `sequence` as `src` does (top-k log-probs); a mismatch (a wrong
        name mapping, a lost bucket) stops the run with a clear error."""
        from .weight_sync import check_weight_sync

        self.wake(dst, ("kv_cache",))
        return check_weight_sync(self[src], self[dst], sequence)


def announce(lines: list[str]) -> None:
    """Print the placement before the first step (stderr: stdout keeps the run's JSON summary)."""
    for line in lines:
        logger.info(line)
