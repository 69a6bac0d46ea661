"""TrainWorker on a real Ray (fake GPUs): a group whose engine splits the model over its workers (megatron with
tensor parallelism, `engine.collective`) gets the whole batch on every tensor rank and takes rank 0's result,
and every rank takes part in rank-0 calls (top-k, export); a data-parallel group is unchanged."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import ray.cloudpickle
import torch

from rlcore import RoleSession, RoleSetup, load_plugins
from rlcore.batch import Batch
from rlcore.runtime.resources import plan_from_config
from rlcore.runtime.roles import TrainWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class RecordingEngine:
    """Answers with its rank and writes every call to `log` (one file shared by the group's workers)."""

    def __init__(self, log: str, collective: bool = False, **options):
        self.rank, self.log, self.collective = int(os.environ.get("RANK", "0")), Path(log), collective

    @staticmethod
    def layout(tensor_model_parallel_size: int = 1, **options):  # the session asks a factory for its layout
        return tensor_model_parallel_size, 1

    def _note(self, what: str) -> None:
        with self.log.open("a") as f:
            f.write(f"{self.rank} {what}\n")

    def forward_logprobs(self, batch, temperature=1.0):
        return torch.full((len(batch),), float(self.rank))

    def forward_topk(self, batch, k, temperature=1.0):
        self._note("topk")
        return {"rank": self.rank, "rows": len(batch)}

    def train_step(self, batch, loss_fn, micro_batch_size, temperature=1.0):
        return {"rows": float(len(batch)), "rank": float(self.rank)}

    def export_weights(self, bucket_bytes):
        self._note("export")
        yield [("w", torch.tensor(float(self.rank)))]


def _calls(log: Path) -> list[str]:
    return sorted(log.read_text().splitlines()) if log.exists() else []


@pytest.mark.parametrize("tp", [2, 1])
def test_a_tensor_parallel_group_runs_every_rank_and_answers_from_rank_0(ray_local, tmp_path, tp):
    plugins = load_plugins()
    plan = plan_from_config({"train": {"gpus": 2}}, roles=["train"], plugins=plugins)
    log = tmp_path / "calls.log"
    options = {"log": str(log), "collective": tp > 1, "tensor_model_parallel_size": tp}
    session = RoleSession(plan, {"train": RoleSetup(TrainWorker, RecordingEngine, options)}, use_ray=True, plugins=plugins)
    assert session.dp_size("train") == 2 // tp
    batch = Batch({"input_ids": torch.arange(8)})
    with session.start():
        train = session["train"]
        step = train.train_step(batch, None, 4)
        logprobs = train.forward_logprobs(batch)
        top = train.forward_topk(batch, 3)
        buckets = train.export_weights(1 << 20)
    if tp == 2:  # one data-parallel rank: both tensor ranks see all 8 rows; rank 0 answers
        assert step["rows"] == 8 and step["rank"] == 0
        assert logprobs.tolist() == [0.0] * 8
        assert _calls(log) == ["0 export", "0 topk", "1 export", "1 topk"]
    else:  # two data-parallel ranks: 4 rows each, as before; rank-0 calls run on rank 0 alone
        assert step["rows"] == 4 and step["rank"] == 0.5
        assert logprobs.tolist() == [0.0] * 4 + [1.0] * 4
        assert _calls(log) == ["0 export", "0 topk"]
    assert top == {"rank": 0, "rows": 8}
    assert [(n, float(t)) for bucket in buckets for n, t in bucket] == [("w", 0.0)]


class ImportProbe:
    """Writes, when it is built, whether the module its factory declares (`imports`) was imported already in
    this worker: with the engine's imports done ahead (the roles after the first), it was."""

    imports = ("tabnanny",)  # a module nothing else here imports (rich, which Ray workers load, imports colorsys)

    def __init__(self, log: str, role: str, **options):
        with Path(log).open("a") as f:
            f.write(f"{role} {'tabnanny' in sys.modules}\n")


def probed_session(probe: type, log: Path, train_gpus: int, use_ray: bool) -> RoleSession:
    """A train and a rollout role, each building `probe` (told the log file and its role) as its engine."""
    from rlcore.runtime.roles import GenerateWorker

    plugins = load_plugins()
    plan = plan_from_config({"train": {"gpus": train_gpus}, "rollout": {"gpus": 1}}, roles=["train", "rollout"],
                            plugins=plugins)
    setups = {role: RoleSetup(worker, probe, {"log": str(log), "role": role})
              for role, worker in (("train", TrainWorker), ("rollout", GenerateWorker))}
    return RoleSession(plan, setups, use_ray=use_ray, plugins=plugins)


def test_the_roles_after_the_first_import_their_engines_modules_before_they_build(ray_local, tmp_path):
    """On Ray every role but the first is started and imports its engine's `imports` (`EngineSpec.imports`)
    while the roles before it build, and is then built in those same actors; the first role builds at once."""
    log = tmp_path / "built.log"
    session = probed_session(ImportProbe, log, train_gpus=1, use_ray=True)
    assert session.imports("rollout") == ("tabnanny",)
    with session.start():
        pass
    assert sorted(log.read_text().splitlines()) == ["rollout True", "train False"]


class PidProbe:
    """Writes, when it is built, its role, rank and process id: where the engine's memory lives."""

    def __init__(self, log: str, role: str, **options):
        with Path(log).open("a") as f:
            f.write(f"{role} {os.environ.get('RANK', '0')} {os.getpid()}\n")


@pytest.mark.parametrize("use_ray", [True, False])
def test_processes_are_the_pids_the_roles_engines_run_in(tmp_path, use_ray, request):
    """`RoleSession.processes()`: per role, by rank, the process each worker's engine was built in (a Ray actor's,
    or this process without Ray), for a tool reading GPU memory per process."""
    if use_ray:
        request.getfixturevalue("ray_local")
    log = tmp_path / "built.log"
    session = probed_session(PidProbe, log, train_gpus=2, use_ray=use_ray)
    with session.start():
        pids = session.processes()
    built: dict[str, list[int]] = {}
    for role, rank, pid in sorted(line.split() for line in log.read_text().splitlines()):
        built.setdefault(role, []).append(int(pid))
    assert pids == built
    if use_ray:
        assert len({*pids["train"], *pids["rollout"], os.getpid()}) == 4
    else:
        assert pids == {"train": [os.getpid()], "rollout": [os.getpid()]}
