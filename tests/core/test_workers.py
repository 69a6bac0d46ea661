"""The worker runtime on a real local Ray: dispatch/collect shapes, modes, environment, failures."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import ray.cloudpickle
import torch

from rlcore import Batch, ConfigError, RoleFailed, Slot, function, worker, worker_rank
from rlcore.runtime import actors, workers
from rlcore.runtime.dispatch import Mesh

# The classes below live in a test module Ray's workers cannot import: send them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def cpu_slots(**sizes: int) -> dict[str, list[Slot]]:
    return {role: [Slot(role, i, n, 0, None, 0.0, 0.5) for i in range(n)] for role, n in sizes.items()}


@pytest.fixture
def ray_runtime(ray_local):
    """Start a Ray runtime with `start(slots, **options)`; it is stopped after the test."""
    started = []

    def start(slots, **options):
        started.append(workers.runtime(slots, use_ray=True, **options))
        return started[-1]

    yield start
    for rt in started:
        rt.stop()


@worker(group="calc")
class Calc:
    def __init__(self, scale: int):
        self.scale = scale

    @function(group="calc", dispatch="slice", collect="flatten")
    def double(self, xs, offset=0):
        return [x * 2 * self.scale + offset for x in xs]

    @function(group="calc", dispatch="slice", collect="concat")
    def rows(self, t):
        return t * self.scale

    @function(group="calc", dispatch="slice", collect="concat")
    def batch(self, b):
        return Batch(ids=b["ids"] + 1, text=[s.upper() for s in b["text"]])

    @function(group="calc", dispatch="all", collect="mean")
    def metrics(self, x):
        return {"x": x * self.scale, "rank": 0.0}

    @function(group="calc", dispatch="dp", collect="flatten")
    def dp_rows(self, xs):
        return [x + 1 for x in xs]

    @function(group="calc", dispatch=lambda n, i, xs: ((xs[i::n],), {}), collect=lambda rs: sorted(x for r in rs for x in r))
    def strided(self, xs):
        return [x * 10 for x in xs]

    @function(group="calc", dispatch="slice", collect="flatten")
    def pair(self, xs):
        return [x + 1 for x in xs], [str(x) for x in xs]

    @function(group="calc", dispatch="first")
    def rank(self):
        return worker_rank()

    @function(group="calc", execute="first", collect="none")
    def ranks(self):
        return worker_rank()

    @function(group="calc", collect="first")
    def where(self):
        return os.getpid()

    @function(group="calc", blocking=False, collect="flatten")
    def slow(self, x):
        time.sleep(0.2)
        return [x]

    @function(group="calc")
    def fail(self, why):
        raise ValueError(why)

    @function(group="calc")
    def pid(self):
        return os.getpid()

    @function(group="calc")
    def sleep(self, seconds):
        time.sleep(seconds)

    @function(group="calc", dispatch="slice", collect="flatten")
    def slow_double(self, xs, seconds):
        time.sleep(seconds)
        return [x * 2 * self.scale for x in xs]

    def local_only(self):
        return ("driver", os.getpid())


def run_all(calc: Calc) -> dict:
    t = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    b = Batch(ids=torch.arange(5), text=list("abcde"))
    return {
        "double": calc.double([1, 2, 3, 4, 5], offset=1),
        "rows": calc.rows(t),
        "batch": calc.batch(b),
        "metrics": calc.metrics(3),
        "dp": calc.dp_rows(list(range(6))),
        "strided": calc.strided(list(range(7))),
        "pair": calc.pair([1, 2, 3]),
        "rank": calc.rank(),
        "ranks": calc.ranks(),
        "empty": calc.double([]),
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Batch):
        return isinstance(b, Batch) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_without_ray_each_group_is_one_in_process_worker():
    calc = Calc(2)
    assert calc.pid() == [os.getpid()]  # collect="none": a list of one, the shape it has under Ray
    assert calc.where() == os.getpid()
    assert calc.slow(1).get() == [1]
    with pytest.raises(ValueError, match="boom"):  # in-process: the worker's own exception
        calc.fail("boom")
    assert calc.double([1, 2]) == [4, 8]


@pytest.mark.ray
def test_every_dispatcher_and_collector_gives_the_same_result_with_and_without_ray(ray_runtime):
    local = run_all(Calc(2))
    ray_runtime(cpu_slots(calc=4), meshes={"calc": Mesh(dp=2, tp=2)})
    calc = Calc(2)
    remote = run_all(calc)
    for key in local:
        assert same(local[key], remote[key]), (key, local[key], remote[key])
    assert local["rows"].tolist() == [[0, 2], [4, 6], [8, 10], [12, 14], [16, 18]]
    assert local["double"] == [5, 9, 13, 17, 21] and local["empty"] == []
    assert local["pair"] == ([2, 3, 4], ["1", "2", "3"])
    pids = calc.pid()
    assert len(pids) == 4 and len(set(pids)) == 4 and os.getpid() not in pids
    assert calc.rank() == 0 and calc.ranks() == [0]  # dispatch "first" (execute="first"): rank 0 alone
    assert calc.local_only() == ("driver", os.getpid())  # no @function: runs on the driver


@pytest.mark.ray
def test_non_blocking_calls_return_handles(ray_runtime):
    ray_runtime(cpu_slots(calc=2))
    calc = Calc(1)
    start = time.monotonic()
    first, second = calc.slow(1), calc.slow(2)
    assert isinstance(first, workers.Handle)
    assert actors.wait([first, second], timeout=30) == [[1, 1], [2, 2]]
    assert time.monotonic() - start < 5
    assert first.get() == [1, 1]


@pytest.mark.ray
def test_a_large_argument_is_stored_once_for_all_workers_and_keeps_its_dtype(ray_runtime, monkeypatch):
    from rlcore.runtime import transport

    ray_runtime(cpu_slots(calc=3))
    calc = Calc(1)
    puts = []
    real_put = transport._put
    monkeypatch.setattr(transport, "_put", lambda value: puts.append(value) or real_put(value))
    big = torch.randn(300_000).to(torch.bfloat16)  # 600 KB, no numpy dtype: sent as int16 bits
    assert calc.metrics(3) == {"x": 3.0, "rank": 0.0} and puts == []  # small arguments go inline
    assert calc.where.__wrapped__(calc) == os.getpid()

    @worker(group="calc")
    class Echo:
        @function(group="calc")
        def echo(self, t):
            return t

    results = Echo().echo(big)
    assert len(puts) == 1  # one put for three workers
    assert all(r.dtype == torch.bfloat16 and torch.equal(r, big) for r in results) and len(results) == 3
    sliced = calc.rows(big.reshape(3, -1))  # a different shard per worker: nothing shared
    assert len(puts) == 1 and sliced.dtype == torch.bfloat16 and torch.equal(sliced, big.reshape(3, -1))


@worker(group=["model1", "model2"])
class TwoModels:
    """ms-swift's first example: __init__ prepares both groups' models and a dataset."""

    def __init__(self, name):
        self.prepared = []
        self._prepare_model1()
        self._prepare_model2()
        self.dataset = [name] * 3

    @function(group="model1")
    def _prepare_model1(self):
        self.prepared.append("model1")

    @function(group="model2")
    def _prepare_model2(self):
        self.prepared.append("model2")

    @function(group="model1", dispatch="slice", collect="flatten")
    def rollout(self, inputs):
        return [f"{x}+{self.prepared}+{self.rank_list()}" for x in inputs]

    @function(group="model1")
    def rank_list(self):
        return int(os.environ["RANK"])

    @function(group="model2")
    def state(self):
        return self.prepared, self.dataset

    @function(group="model1")
    def cross(self):
        return self.state()


@pytest.mark.ray
def test_inside_an_actor_own_group_runs_locally_and_another_group_is_an_error(ray_runtime):
    ray_runtime(cpu_slots(model1=2, model2=1))
    trainer = TwoModels("d")
    assert trainer.prepared == [] and trainer.dataset == ["d"] * 3  # the driver skips @function setup
    # own-group call inside the actor ran locally and returned its plain result (rank, not a list)
    assert trainer.rollout(["a", "b"]) == ["a+['model1']+0", "b+['model1']+1"]
    assert trainer.state() == [(["model2"], ["d"] * 3)]  # model2's setup was skipped in model1's actors
    with pytest.raises(RoleFailed, match=r"role 'model1' rank 0 .* raised RlcoreError in cross\(\): "
                       r"TwoModels.state\(\) belongs to group 'model2' but was called inside a worker of group 'model1'"):
        trainer.cross()


@worker(group="dist")
class Gloo:
    def __init__(self):
        self._init_distributed()  # a @function: per-worker setup runs in the actors, not on the driver

    @function(group="dist")
    def _init_distributed(self):
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT

    @function(group="dist")
    def env(self):
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        return {k: os.environ[k] for k in keys}

    @function(group="dist")
    def pid(self):
        return os.getpid()

    @function(group="dist", collect="flatten")
    def all_reduce(self, values):
        import torch.distributed as dist

        t = torch.tensor([values[dist.get_rank()]], dtype=torch.float32)
        dist.all_reduce(t)
        return t.tolist()


@pytest.mark.ray
def test_a_group_gets_its_environment_and_forms_a_gloo_world(ray_runtime):
    ray_runtime(cpu_slots(dist=2))
    group = Gloo()
    envs = group.env()
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"] and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert group.all_reduce([1.5, 2.5]) == [4.0, 4.0]


@pytest.mark.ray
def test_a_raising_worker_names_role_rank_and_the_original_error(ray_runtime):
    ray_runtime(cpu_slots(calc=2))
    calc = Calc(1)
    with pytest.raises(RoleFailed, match=r"role 'calc' rank 0 on node \S+ \(pid \d+\) raised ValueError in fail\(\): bad input") as info:
        calc.fail("bad input")
    assert info.value.role == "calc" and info.value.rank == 0
    assert calc.double([1, 2]) == [2, 4]  # the workers are alive: a raise is not a death
    with pytest.raises(TypeError, match="pickle") as unsent:  # Ray's own error, before any worker has the call
        calc.metrics(threading.Lock())
    assert not isinstance(unsent.value, RoleFailed) and calc.double([3]) == [6]


@pytest.mark.ray
def test_a_worker_killed_during_a_call_raises_role_failed_within_seconds(ray_runtime):
    ray_runtime(cpu_slots(calc=2))
    calc = Calc(1)
    pids = calc.pid()
    killer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(RoleFailed, match=r"role 'calc' rank 1 on node \S+ \(pid %d\) died during sleep\(\)" % pids[1]) as info:
        calc.sleep(60)
    assert time.monotonic() - start < 15
    assert info.value.node and info.value.rank == 1 and info.value.role == "calc"
    with pytest.raises(RoleFailed, match="role 'calc' rank 1"):
        calc.pid()  # the group stays failed
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pids[0]):
        time.sleep(0.1)
    assert not _alive(pids[0]), "the group's other worker was not stopped"


@pytest.mark.ray
def test_a_dead_worker_is_named_not_the_peer_its_death_cut_off(ray_runtime):
    """Rank 1 dies; rank 0's collective then fails (its peer is gone) with an error of its own. The group's
    failure names the dead rank: that is the cause."""
    ray_runtime(cpu_slots(dist=2))
    group = Gloo()
    assert group.all_reduce([1.0, 2.0]) == [3.0, 3.0]  # the gloo world is up
    pids = group.pid()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RoleFailed, match=r"role 'dist' rank 1 on node \S+ \(pid %d\) died" % pids[1]) as info:
        group.all_reduce([1.0, 2.0])
    assert info.value.rank == 1


@pytest.mark.ray
def test_a_killed_worker_is_restarted_built_again_and_sent_its_shard_again(ray_runtime):
    """With max_restarts, rank 1 killed in a call is restarted by Ray, built with the group's arguments again
    (scale 3), handed to `on_restart`, and sent its own shard again; rank 0's result is kept, not recomputed. Once
    its restarts are used, a death stops the group as before."""
    ray_runtime(cpu_slots(calc=2), max_restarts={"calc": 1})
    calc = Calc(3)
    remote = workers.remote_group(calc, "calc")
    restored: list[list[int]] = []
    remote.on_restart = restored.append
    pids = calc.pid()
    killer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL))
    killer.start()
    assert calc.slow_double([1, 2, 3, 4], 3.0) == [6, 12, 18, 24]
    killer.join()
    assert restored == [[1]] and remote.restarts_of == [0, 1]
    assert remote.restarted == 1  # counted once
    now = calc.pid()
    assert now[0] == pids[0] and now[1] != pids[1] and remote.infos[1]["pid"] == now[1]
    os.kill(now[1], signal.SIGKILL)
    with pytest.raises(RoleFailed, match=r"role 'calc' rank 1 on node \S+ \(pid %d\) died during double\(\)" % now[1]):
        calc.double([1, 2])
    assert restored == [[1]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.ray
def test_slots_from_placement_allocate_share_bundles(ray_runtime):
    from rlcore.runtime.placement import allocate, release
    from rlcore.runtime.resources import plan_from_config

    plan = plan_from_config({"colocate_groups": [["train", "rollout"]], "train": {"gpus": 2}, "rollout": {"gpus": 2}})
    slots = allocate(plan, timeout_s=30)
    try:
        ray_runtime(slots)

        @worker(group=["train", "rollout"])
        class Colocated:
            @function(group="train")
            def gpus(self):
                return os.environ.get("CUDA_VISIBLE_DEVICES")

            @function(group="rollout", collect="flatten")
            def gpu_list(self):
                return [os.environ.get("CUDA_VISIBLE_DEVICES")]

        both = Colocated()
        train, rollout = both.gpus(), both.gpu_list()
        assert train == rollout and len(set(train)) == 2  # rank i of both roles on the same fake GPU
        workers.stop_runtime()
        assert workers.current_runtime() is None
    finally:
        release(slots)


def test_bad_declarations_and_runtimes_are_clear_errors(ray_local):
    with pytest.raises(ConfigError, match="execute='last'"):
        function(group="g", execute="last")
    with pytest.raises(ConfigError, match="execute='first'\) is dispatch 'first'.*cannot also dispatch 'slice'"):
        function(group="g", execute="first", dispatch="slice")
    with pytest.raises(ConfigError, match="a @function of group 'b', but @worker declares \\['a'\\]"):

        @worker(group="a")
        class Wrong:
            @function(group="b")
            def f(self):
                pass

    with pytest.raises(ConfigError, match="needs slots"):
        workers.runtime(use_ray=True)
    bad = {"calc": [Slot("calc", 1, 1, 0, None, 0.0, 1.0)]}
    with pytest.raises(ConfigError, match=r"slots.calc\[0\]: expected role 'calc', rank 0"):
        workers.runtime(bad, use_ray=True)
    with workers.runtime(cpu_slots(other=1), use_ray=True):
        with pytest.raises(ConfigError, match=r"serves group\(s\) \['calc'\] but the runtime has slots only for \['other'\]"):
            Calc(1)
    assert workers.current_runtime() is None


# -- inherited @functions and roles bound when a group is made (one class serves any role name) ----------


@worker(group="rollout")
class Rollout:
    def __init__(self, base: int):
        self.base = base

    @function(group="rollout", dispatch="slice", collect="flatten")
    def generate(self, xs):
        return [x + self.base for x in xs]

    @function(group="rollout", collect="none")
    def where(self):
        return workers._actors._actor.group if workers._actors._actor else "local"


@worker(group="teacher")
class Teacher(Rollout):
    """Serves as a teacher what it inherits from the rollout class."""


class Generic:
    def __init__(self, base: int):
        self.base = base

    @function(dispatch="slice", collect="flatten")
    def generate(self, xs):
        return [x + self.base for x in xs]

    @function()
    def where(self):
        return workers._actors._actor.group if workers._actors._actor else "local"


def test_inherited_functions_serve_the_subclass_role_locally():
    assert Teacher(10).generate([1, 2]) == [11, 12]
    assert workers.bind(Generic, "sampler")(1).generate([1]) == [2]


@pytest.mark.ray
def test_inherited_functions_serve_the_subclass_role_on_ray(ray_runtime):
    ray_runtime(cpu_slots(teacher=2))
    teacher = Teacher(10)
    assert teacher.generate([1, 2, 3]) == [11, 12, 13]
    assert teacher.where() == ["teacher", "teacher"]


@pytest.mark.ray
def test_a_class_binds_to_any_role_when_its_group_is_made(ray_runtime):
    ray_runtime(cpu_slots(reference=1, sampler=2))
    reference, sampler = workers.bind(Generic, "reference")(1), workers.bind(Generic, "sampler")(100)
    assert reference.where() == ["reference"] and sampler.where() == ["sampler", "sampler"]
    assert sampler.generate([1, 2]) == [101, 102]
    assert workers.bind(Generic, "sampler") is workers.bind(Generic, "sampler")


def test_binding_errors_name_the_function_and_the_fix():
    with pytest.raises(ConfigError, match="without a group"):
        worker(group=["a", "b"])(type("Two", (Generic,), {}))
    with pytest.raises(ConfigError, match="inherits generate\\(\\) of group 'rollout'"):
        worker(group=["a", "b"])(type("Two", (Rollout,), {}))
    with pytest.raises(ConfigError, match="serves several groups"):
        workers.bind(worker(group=["x", "y"])(type("XY", (), {})), "z")


# -- a group call without a result for call_timeout (RunConfig.worker_timeout_s) -------------------------


def test_call_timeout_is_seconds_above_zero_or_none():
    with pytest.raises(ConfigError, match=r"call_timeout: must be seconds > 0, or None for no limit; got 0"):
        workers.Runtime(call_timeout=0)
    assert workers.Runtime(call_timeout=None).call_timeout is None


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_call_past_the_call_timeout_stops_the_group_naming_every_silent_rank(ray_runtime):
    ray_runtime(cpu_slots(calc=2), call_timeout=2.0)
    calc = Calc(1)
    pids = calc.pid()
    calc.sleep(0.1)
    start = time.monotonic()
    with pytest.raises(RoleFailed, match=r"role 'calc' rank 0 on node \S+ \(pid %d\) gave no result for sleep\(\) "
                                         r"within 2s \(ranks 0, 1 gave none\).*raise worker_timeout_s" % pids[0]):
        calc.sleep(60)
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    assert not any(map(_alive, pids)), "the group's workers were not stopped"


@worker(group="noisy")
class Noisy:
    @function(group="noisy", dispatch="all", collect="none")
    def warn(self):
        import warnings

        import numpy

        numpy.mean([])  # a library's RuntimeWarning: to the driver's log
        warnings.warn("the worker's own")  # the user's code: Ray prints it as it is
        return os.getpid()


@pytest.mark.ray
def test_a_librarys_warning_in_a_ray_worker_is_logged_once_by_the_driver(ray_runtime, monkeypatch, capfd):
    """megatron-core warns on import inside a train worker: the driver's log (run.log) takes it out of Ray's
    forwarded output, once for every worker that said it, and stderr does not show it above debug."""
    import logging

    from rlcore import log

    monkeypatch.setattr(log, "_warned", set())
    monkeypatch.setattr(log, "_hide_libraries", True)  # as in `rlcore run`
    monkeypatch.setattr(log, "_told", True)
    monkeypatch.setattr(log, "_hidden", False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log.logger.addHandler(handler)
    try:
        ray_runtime(cpu_slots(noisy=2))
        assert len(set(Noisy().warn())) == 2
        err = ""
        deadline = time.monotonic() + 20  # Ray forwards a worker's output within a second or so
        while time.monotonic() < deadline and not (err.count("the worker's own") == 2 and records):
            time.sleep(0.2)
            err += capfd.readouterr().err
    finally:
        log.logger.removeHandler(handler)
    said = [r.getMessage() for r in records if "Mean of empty slice" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("RuntimeWarning from numpy/"), said
    assert records[0].name == "rlcore.warnings" and records[0].library
    assert "Mean of empty slice" not in err and "rlcore: library warning:" not in err
    assert err.count("rlcore: warning: UserWarning from ") == 2  # the user's, from each worker, as Ray prints it
