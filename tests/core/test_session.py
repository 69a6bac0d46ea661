"""RoleSession: what the resource plan says about each role (no Ray needed), and the loop's phase timer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlcore import ConfigError, PhaseTimer, RoleSession, RoleSetup, load_plugins
from rlcore.runtime.resources import plan_from_config
from rlcore.runtime.roles import GenerateWorker, ScoreWorker, TrainWorker
from rlcore.runtime.resources import rank_ranges


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def session(plugins, config, roles, use_ray=True, **options):
    plan = plan_from_config(config, roles=roles, plugins=plugins)
    kinds = {"train": TrainWorker, "reference": TrainWorker, "rollout": GenerateWorker, "orm": ScoreWorker}
    setups = {r: RoleSetup(kinds[r], "hf", {"model": "m"}) for r in roles}
    return RoleSession(plan, setups, use_ray=use_ray, plugins=plugins, **options)


def test_device_groups_give_workers_devices_and_colocation(plugins):
    s = session(plugins, {"device_groups": {
        "nproc_per_node": 4,
        "actor": {"device": "GPU", "ranks": "list(range(0, 2))", "workers": ["train", "rollout"]},
        "ref": {"device": "GPU", "ranks": [2, 3], "workers": ["reference"]},
        "rm": {"device": "CPU", "ranks": 3, "workers": ["orm"]},
    }}, ["train", "rollout", "reference", "orm"])
    assert [s.workers(r) for r in s.roles] == [2, 2, 2, 3]
    assert s.dp_size("train") == 2 and s.device("train") == "cuda" and s.device("orm") == "cpu"
    assert s.colocated("train", "rollout") and not s.colocated("train", "reference")
    assert s.describe() == [
        "train: 2 workers, GPU 0-1 (shared with rollout), engine hf",
        "rollout: 2 workers, GPU 0-1 (shared with train), engine hf",
        "reference: 2 workers, GPU 2-3, engine hf",
        "orm: 3 workers, CPU, engine hf",
    ]
    assert s.transport("train", "reference") == "nccl"  # separate GPU roles: a broadcast
    assert s.transport("train", "orm") == "object_store"


def test_per_role_form_and_local_runs(plugins):
    config = {"colocate_groups": [["train", "rollout"]], "train": {"gpus": 2}, "rollout": {"gpus": 2}}
    on_ray = session(plugins, config, ["train", "rollout"])
    assert on_ray.colocated("train", "rollout") and on_ray.dp_size("train") == 2
    local = session(plugins, config, ["train", "rollout"], use_ray=False)
    assert local.dp_size("train") == 1 and local.transport("train", "rollout") == "in_process"
    assert local.colocated("train", "rollout")  # the plan decides, in one process too: sleep/wake still apply
    assert local.describe()[0] == "train: 1 worker, in this process on cuda (shared with rollout), engine hf"
    forced = session(plugins, {"train": {"gpus": 1}, "rollout": {"gpus": 1}}, ["train", "rollout"],
                     weight_sync_backend="gloo")
    assert forced.transport("train", "rollout") == "gloo"


def test_an_engine_device_option_wins_and_bad_setups_are_refused(plugins):
    plan = plan_from_config({"train": {"gpus": 1}, "rollout": {"gpus": 1}}, roles=["train", "rollout"], plugins=plugins)
    s = RoleSession(plan, {"train": RoleSetup(TrainWorker, "hf", {"device": "cpu"}),
                           "rollout": RoleSetup(GenerateWorker, "hf", {"device": "cpu"})}, use_ray=True)
    assert s.device("train") == "cpu" and s.transport("train", "rollout") == "object_store"
    with pytest.raises(ConfigError, match="no place in the resource plan"):
        RoleSession(plan, {"teacher": RoleSetup(TrainWorker, "hf")}, use_ray=True)
    with pytest.raises(ConfigError, match="weight_sync_backend 'ipc' is unknown"):
        RoleSession(plan, {}, use_ray=True, weight_sync_backend="ipc")
    with pytest.raises(KeyError, match="role 'train' is not running"):
        s["train"]


def test_ranges_are_short():
    assert rank_ranges((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8" and rank_ranges((3,)) == "3"


def test_nested_phases_are_not_counted_twice(monkeypatch):
    clock = iter([0.0, 2.0, 12.0, 13.0])  # reward opens; generate opens at 2 and closes at 12; reward closes at 13
    monkeypatch.setattr("rlcore.trainer.time", SimpleNamespace(perf_counter=lambda: next(clock)))
    timer = PhaseTimer()
    with timer("reward"):
        with timer("generate"):
            pass
    assert timer.pop() == {"time/generate": 10.0, "time/reward": 3.0}
    assert timer.pop() == {}


def test_tensor_and_pipeline_sizes_split_a_roles_workers(plugins):
    from rlcore.runtime.dispatch import Mesh

    plan = plan_from_config({"train": {"gpus": 4}}, roles=["train"], plugins=plugins)

    def train(use_ray=True, **sizes):
        return RoleSession(plan, {"train": RoleSetup(TrainWorker, "megatron", sizes)}, use_ray=use_ray)

    both = train(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert both.mesh("train") == Mesh(dp=1, tp=2, pp=2) and both.dp_size("train") == 1
    assert train(tensor_model_parallel_size=2).dp_size("train") == 2 and train().dp_size("train") == 4
    with pytest.raises(ConfigError, match="tensor x pipeline = 3 x 1 does not divide the role's 4 worker"):
        train(tensor_model_parallel_size=3).dp_size("train")
    with pytest.raises(ConfigError, match="one worker in this process: run with --use-ray"):
        train(use_ray=False, tensor_model_parallel_size=2).dp_size("train")


class _Pending:
    """A `blocking=False` result that logs when the driver waits for it."""

    def __init__(self, log: list[str], event: str, value=None):
        self.log, self.event, self.value = log, event, value

    def get(self, timeout=None):
        self.log.append(self.event)
        return self.value


class _IpcSenders:
    """Two train ranks on GPUs a and b, each exporting three buckets (what TrainWorker.next_ipc_bucket returns)."""

    def __init__(self, log: list[str]):
        self.log, self.index = log, 0

    def gpu_uuid(self):
        return ["gpu-a", "gpu-b"]

    def next_ipc_bucket(self, bucket_bytes=None):
        if bucket_bytes is not None:
            self.index = 0
        if self.index == 3:
            return _Pending(self.log, "packed end", [None, None])
        self.log.append(f"pack {self.index}")
        payloads = [{"rank": rank, "bucket": self.index, "nbytes": 100, "pack_s": 0.25 * (rank + 1)} for rank in (0, 1)]
        self.index += 1
        return _Pending(self.log, f"packed {self.index - 1}", payloads)


class _IpcReceivers:
    """Two rollout workers: one on GPU b, one holding weights on GPUs a and b (a tensor-parallel engine)."""

    def __init__(self, log: list[str]):
        self.log, self.loads = log, []

    def weight_receiver_gpus(self):
        return [["gpu-b"], ["gpu-a", "gpu-b"]]

    def load_ipc_bucket(self, payloads):
        self.loads.append(payloads)
        bucket = payloads[0][0]["bucket"]
        self.log.append(f"load {bucket}")
        return _Pending(self.log, f"loaded {bucket}", [0.125, 1.0])  # each worker's seconds

    def finish_weight_update(self):
        self.log.append("finish")


def test_ipc_sync_pairs_receivers_by_gpu_and_never_refills_a_buffer_still_being_loaded(plugins):
    """The session's CUDA IPC loop (its GPU half runs in tests/gpu): every receiving process gets the payload
    of the train rank on its GPU; the senders pack bucket i+1 while bucket i loads, but bucket i+2 (which
    reuses bucket i's buffer) only after the driver has seen bucket i loaded."""
    config = {"colocate_groups": [["train", "rollout"]], "train": {"gpus": 2}, "rollout": {"gpus": 2}}
    s = session(plugins, config, ["train", "rollout"])
    log: list[str] = []
    receivers = _IpcReceivers(log)
    s.groups = {"train": _IpcSenders(log), "rollout": receivers}
    s.ipc_sources[("train", "rollout")] = s._pair_by_gpu("train", "rollout")
    assert s.ipc_sources[("train", "rollout")] == [[1], [0, 1]]
    # per bucket the slowest sender's packing and the slowest receiver's loading, over three buckets
    assert s._sync_ipc("train", "rollout", 1 << 20) == (300, {"weight_sync/pack_s": 1.5, "weight_sync/load_s": 3.0})
    assert [[[p["rank"] for p in own] for own in load] for load in receivers.loads] == [[[1], [0, 1]]] * 3
    assert log[-1] == "finish" and log.count("finish") == 1
    for i in range(3):
        assert log.index(f"load {i}") > log.index(f"packed {i}")  # loads what was packed
        if i + 2 < 3:
            assert log.index(f"loaded {i}") < log.index(f"pack {i + 2}")  # buffer i % 2 is free again
        if i + 1 < 3:
            assert log.index(f"pack {i + 1}") < log.index(f"loaded {i}")  # packing overlaps the load

    s.groups["rollout"].weight_receiver_gpus = lambda: [["gpu-c"]]
    with pytest.raises(ConfigError, match=r"rollout workers \[0\] hold weights on GPUs \['gpu-c'\] where no train worker runs"):
        s._pair_by_gpu("train", "rollout")


def test_the_placement_line_says_each_roles_dtype(plugins, tmp_path):
    """`auto` resolved where the role runs: a bf16 checkpoint's bfloat16 on GPU ranks, float32 on the CPU."""
    from rlcore.testing import build_tiny_model

    model = str(build_tiny_model(tmp_path / "bf16", dtype="bfloat16"))
    plan = plan_from_config({"train": {"gpus": 1}, "rollout": {"gpus": 1}, "orm": {"cpus": 1}},
                            roles=["train", "rollout", "orm"], plugins=plugins)
    s = RoleSession(plan, {"train": RoleSetup(TrainWorker, "hf", {"model": model, "dtype": "auto"}),
                           "rollout": RoleSetup(GenerateWorker, "vllm", {"model": model, "dtype": "float32"}),
                           "orm": RoleSetup(ScoreWorker, "hf", {"model": model, "dtype": "auto"})},
                    use_ray=True, plugins=plugins)
    assert [line.rsplit(", ", 1)[1] for line in s.describe()] == ["bfloat16", "float32", "float32"]


def test_restartable_roles_and_max_restarts_without_ray(plugins):
    """Generators, scorers and forward-only engines hold no training state, so max_restarts may restart them; a train
    engine may not. Without Ray every role is this process: max_restarts is refused in one line naming the key."""
    assert RoleSetup(GenerateWorker, "hf").restartable and RoleSetup(ScoreWorker, "hf").restartable
    assert RoleSetup(TrainWorker, "hf", kind="forward").restartable and not RoleSetup(TrainWorker, "hf").restartable
    roles = ["train", "rollout"]
    assert session(plugins, {}, roles, use_ray=False).max_restarts == 0
    with pytest.raises(ConfigError, match=r"max_restarts: 2 .* has no Ray .* add --use-ray, or set max_restarts 0") as info:
        session(plugins, {}, roles, use_ray=False, max_restarts=2)
    assert info.value.problems == [("max_restarts", "needs --use-ray")] and "\n" not in str(info.value)
    assert session(plugins, {}, roles, max_restarts=2).max_restarts == 2
