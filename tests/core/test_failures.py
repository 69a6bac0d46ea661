"""A worker's failure in one line (`rlcore.failures`): through `rlcore run` with a plugin file whose worker raises
vLLM's kind of pydantic ValidationError (which cannot be pickled), in __init__ or in a call, in this process and in
a Ray actor; the advice for the failures rlcore knows."""

from __future__ import annotations

import re
import socket
import textwrap
from pathlib import Path

import pytest

from rlcore.failures import Failure, advice, capture, summarize

PLUGIN = textwrap.dedent(
    """
    import threading
    from typing import Any, Literal

    from pydantic import BaseModel, ConfigDict, Field, model_validator

    from rlcore import AlgorithmSpec, RoleConfig, RoleSetup, RoleTrainer, RunConfig, function, hookimpl, worker


    class ModelConfig(BaseModel):  # as vLLM's: its error holds the arguments, here a lock, which cannot be pickled
        model_config = ConfigDict(arbitrary_types_allowed=True)
        max_model_len: int
        tokenizer: Any

        @model_validator(mode="after")
        def fits(self):
            if self.max_model_len > 1024:
                raise ValueError(
                    f"User-specified max_model_len ({self.max_model_len}) is greater than the derived max_model_len "
                    "(max_position_embeddings=1024 or model_max_length=None in model's config.json). To allow "
                    "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
                )
            return self


    @worker(group="rollout")
    class Engine:
        def __init__(self, engine, options):
            self.length = options["length"]
            if options["fail_in"] == "init":
                self.check()

        def check(self):
            ModelConfig(max_model_len=self.length, tokenizer=threading.Lock())

        @function(dispatch="first")
        def generate(self):
            self.check()
            return self.length


    class FailingConfig(RunConfig):
        max_steps: int = 1
        length: int = 16384
        fail_in: Literal["init", "call"] = "init"
        rollout: RoleConfig = Field(default_factory=RoleConfig)


    class FailingTrainer(RoleTrainer):
        name = "failing"

        @classmethod
        def roles(cls, config):
            return ["rollout"]

        def setups(self):
            options = {"length": self.config.length, "fail_in": self.config.fail_in}
            return {"rollout": RoleSetup(Engine, "python", options)}

        def train_step(self):
            return {"length": float(self.session["rollout"].generate())}


    @hookimpl
    def rlcore_algorithms():
        yield AlgorithmSpec("failing", config=FailingConfig, trainer=FailingTrainer)
    """
)
SENTENCE = "User-specified max_model_len (16384) is greater than the derived max_model_len"


def fail(rlcore_cli, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    """The failing algorithm run from the CLI, with every installed plugin: the advice for vLLM's sentence is the
    vllm plugin's (`EngineSpec.advice`)."""
    (tmp_path / "failing.py").write_text(PLUGIN)
    env = {"RLCORE_DISABLE_PLUGINS": "", **(env or {})}
    return rlcore_cli("run", "--plugin", "failing.py", "output_dir=out", *args, env=env, timeout=300)


def assert_one_line(done, tmp_path: Path, *, node: str, method: str, debug: bool = False) -> None:
    """Exit 1; the first error line names role, rank, node, ValidationError and vLLM's sentence; then the advice and
    where the traceback is, no more; run.log holds the worker's traceback, stderr only with `debug`."""
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("rlcore: error:"))
    assert re.match(rf"rlcore: error: role 'rollout' rank 0 on node {re.escape(node)} \(pid \d+\) raised "
                    rf"ValidationError in {re.escape(method)}\(\): 1 validation error for ModelConfig: Value error, "
                    rf"{re.escape(SENTENCE)}", lines[first]), done.stderr
    assert "isn't serializable" not in done.stderr
    assert lines[first + 1] == ("rlcore: hint: lower rollout.vllm_max_model_len (16384) to 1024 or less, the model's "
                                "max_position_embeddings; prompt and completion must fit in it")
    log = (tmp_path / "out" / "run.log").read_text()
    assert "Traceback (most recent call last)" in log and 'failing.py", line' in log and "in check" in log
    if debug:
        assert "Traceback (most recent call last)" in done.stderr and "in check" in done.stderr
    else:
        assert "Traceback" not in done.stderr and "input_value" not in done.stderr
        assert lines[first + 2:] == ["rlcore: the worker's full error is in out/run.log; --log-level debug shows it "
                                     "here too"], done.stderr


@pytest.mark.parametrize("fail_in,method", [("init", "__init__"), ("call", "generate")])
def test_an_in_process_worker_failure_is_one_line_and_its_traceback_is_in_run_log(rlcore_cli, tmp_path, fail_in,
                                                                                  method):
    done = fail(rlcore_cli, tmp_path, f"fail_in={fail_in}")
    assert_one_line(done, tmp_path, node=socket.gethostname(), method=method)


def test_log_level_debug_shows_the_worker_traceback(rlcore_cli, tmp_path):
    done = fail(rlcore_cli, tmp_path, "--log-level", "debug")
    assert_one_line(done, tmp_path, node=socket.gethostname(), method="__init__", debug=True)


@pytest.mark.ray
@pytest.mark.parametrize("fail_in,method,debug", [("init", "__init__", False), ("call", "generate", True)])
def test_a_ray_worker_failure_is_one_line_even_when_ray_cannot_pickle_it(ray_local, rlcore_cli, tmp_path, fail_in,
                                                                        method, debug):
    from rlcore.runtime import cluster

    address = ray_local.get_runtime_context().gcs_address
    args = [f"fail_in={fail_in}", *(["--log-level", "debug"] if debug else [])]
    done = fail(rlcore_cli, tmp_path, "--use-ray", *args, env={cluster.ADDRESS_ENV: address})
    node = ray_local._private.worker.global_worker.node_ip_address  # the one node of the local cluster
    assert_one_line(done, tmp_path, node=node, method=method, debug=debug)


def test_an_in_process_worker_raises_its_own_exception_marked_with_where():
    from rlcore import function, worker
    from rlcore.failures import failure_of

    @worker(group="calc")
    class Calc:
        def __init__(self, fail: bool = False):
            if fail:
                raise KeyError("no engine")

        @function()
        def divide(self, x):
            return 1 / x

    with pytest.raises(ZeroDivisionError) as raised:  # the exception itself, as before
        Calc().divide(0)
    failure = failure_of(raised.value)
    assert (failure.role, failure.rank, failure.node, failure.method) == ("calc", 0, socket.gethostname(), "divide")
    assert failure.line().endswith("raised ZeroDivisionError in divide(): division by zero")
    assert "return 1 / x" in failure.traceback
    with pytest.raises(KeyError) as raised:
        Calc(fail=True)
    assert failure_of(raised.value).line().endswith("raised KeyError in __init__(): 'no engine'")


# -- advice --------------------------------------------------------------------------------------------------------


def failure(exc: BaseException, role: str = "rollout") -> Failure:
    try:
        raise exc
    except BaseException as raised:
        return capture(raised, role=role, rank=1, node="10.0.0.2", method="generate")


@pytest.mark.parametrize("exc,role,says", [
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"), "rollout",
     "the GPU ran out of memory: lower rollout.vllm_gpu_memory_utilization where vLLM shares the GPU, or "
     "per_device_train_batch_size (the micro-batch); or set offload_model=true offload_optimizer=true"),
    (ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"), "teacher",
     "raise teacher.vllm_gpu_memory_utilization or lower teacher.vllm_max_model_len"),
    (RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran "
                  "for 600000 milliseconds before timing out."), "train",
     "a collective of role 'train' timed out: a peer rank failed or stalled first (run.log has each rank's error), "
     "or it is only slow: raise train.engine_kwargs.dist_timeout_s"),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error, NCCL version 2.21.5"), "train",
     "an NCCL collective failed"),
    (ModuleNotFoundError("No module named 'vllm'"), "rollout",
     "vllm is not installed where the worker runs: pip install 'rlcore[vllm]'"),
    (ModuleNotFoundError("No module named 'megatron'"), "train", "pip install 'rlcore[megatron]'"),
])
def test_advice_names_the_key_or_the_install(exc, role, says):
    assert says in advice(failure(exc, role))


def test_no_advice_where_rlcore_knows_none_and_a_long_message_is_cut_on_one_line():
    known = failure(KeyError("prompt"))
    assert advice(known) == "" and known.line() == (
        f"role 'rollout' rank 1 on node 10.0.0.2 (pid {known.pid}) raised KeyError in generate(): 'prompt'")
    long = summarize(ValueError("a\n  b " * 1000))
    assert "\n" not in long and long.startswith("a b a b") and long.endswith(" [...]") and len(long) < 1100
