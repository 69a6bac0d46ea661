"""A fuzzed CLI: `rlcore config validate` and `rlcore run --plugin grpo max_steps=1` given values drawn for every
key of the GRPO config (and a few nested ones) and for the environment variables rlcore and its libraries read:
each type's edges (0, negatives, huge finite numbers, inf/nan, empty and very long strings, deep nesting, wrong
types) and paths to files, folders, FIFOs and devices.

Each case either is valid (validate exits 0 and a run starts: it trains its step, or stops with one error line)
or is refused by both with exit 2, at most 4 lines of stderr and no traceback: validate and run agree.

Seeded and bounded: CI runs FUZZ_CASES cases, of which at most FUZZ_RUNS valid ones train a step; the long form
(`pytest -m fuzz tests/core/test_fuzz_cli.py`, RLCORE_FUZZ_CASES=N cases, 2000 by default) draws fresh cases
each time and trains every valid one.
"""

from __future__ import annotations

import contextlib
import os
import stat

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


FUZZ_CASES = int(os.environ.get("RLCORE_FUZZ_CASES", "15"))
FUZZ_RUNS = 1  # valid cases that train a step, in CI

KEYS = [
    "output_dir", "overwrite_output_dir", "seed", "nnodes", "nproc_per_node", "device_groups", "colocate_groups",
    "placement", "placement_timeout_s", "worker_timeout_s", "sleep_level", "learning_rate", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "lr_scheduler_type", "warmup_steps", "min_lr",
    "save_steps", "save_total_limit", "resume", "log_level", "logging_steps", "use_chat_template", "system",
    "max_prompt_length", "on_nonfinite", "model", "dataset", "per_device_train_batch_size",
    "gradient_accumulation_steps", "steps_per_generation", "num_iterations", "num_generations",
    "max_completion_length", "temperature", "top_p", "top_k", "beta", "epsilon", "epsilon_high", "delta", "loss_type",
    "importance_sampling_level", "scale_rewards", "advantage_estimator", "mask_truncated_completions",
    "dynamic_sample", "max_resample_times", "reward_funcs", "reward_weights", "reward_kwargs", "strict_rewards",
    "reward_timeout_s", "weight_sync_bucket_mb", "weight_sync_backend", "async_generate", "check_weight_sync",
    "train.gpus", "train.engine", "train.dtype", "train.engine_kwargs", "rollout.gpus", "rollout.dtype",
    "reference.model",
]
ENV = ["HF_HOME", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME", "TMPDIR", "RLCORE_PLUGINS",
       "RLCORE_RAY_ADDRESS"]
PATHS = ["{file}", "{dir}", "{fifo}", "/dev/null", "/dev/zero", "{dir}/missing/deeper", "{file}/under-a-file",
         "/proc/self/status", "{long_name}"]
EDGES = ["0", "-1", "1", "2", "-0.0", "1e308", "-1e308", "1e-320", "9223372036854775808", "99999999999999999999999",
         ".inf", "-.inf", ".nan", "''", "'" + "x" * 5000 + "'", "x" * 300, "null", "true", "[]", "{}", "[1, [2, [3]]]",
         "[" * 40 + "]" * 40, "{a: {b: {c: {d: 1}}}}", "'\\0'", "é", "~", "'a b'", "[sk-secret]", "!!binary aGk="]


def values() -> st.SearchStrategy[str]:
    numbers = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True)).map(
        lambda v: ".nan" if v != v else ".inf" if v == float("inf") else "-.inf" if v == float("-inf") else repr(v))
    text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
    return st.one_of(st.sampled_from(EDGES), st.sampled_from(PATHS), numbers, text.map(repr))


@contextlib.contextmanager
def environment(changes: dict[str, str]):
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def refused_cleanly(rc: int, err: str, what: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, f"{what}: a traceback:\n{err[-3000:]}"
    assert rc == 2 and len(lines) <= 4, f"{what}: exit {rc}, {len(lines)} lines:\n{err[-3000:]}"


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    (base / "a-file").write_text("not a model\n")
    (base / "a-dir").mkdir()
    os.mkfifo(base / "a-fifo")
    return {"file": str(base / "a-file"), "dir": str(base / "a-dir"), "fifo": str(base / "a-fifo"),
            "long_name": str(base / ("n" * 300))}, base


def case(draw_key, draw_value, draw_env, places) -> tuple[list[str], dict[str, str]]:
    where, _ = places
    def placed(text: str) -> str:
        for name, path in where.items():
            text = text.replace("{" + name + "}", path)
        return text

    override = [f"{draw_key}={placed(draw_value)}"] if draw_key else []
    env = {draw_env[0]: placed(draw_env[1])} if draw_env else {}
    return override, env


runs_left = [FUZZ_RUNS]


def check(cli, places, tmp_path_factory, key: str | None, value: str, env_pair: tuple[str, str] | None) -> None:
    override, env = case(key, value, env_pair, places)
    work = tmp_path_factory.mktemp("case")
    what = f"{' '.join(override)} {env}"
    cwd = os.getcwd()
    os.chdir(work)
    (work / "c.yaml").write_text("model: tiny\ndataset: tiny:toy\nseed: 42\n")  # a config that runs, but for the case
    try:
        with environment(env):
            rc, err = cli("config", "validate", "--plugin", "grpo", "--config", "c.yaml", *override)
            if rc != 0:
                refused_cleanly(rc, err, f"config validate {what}")
            runs = rc == 0 and runs_left[0] > 0
            if rc != 0 or runs:
                if runs:
                    runs_left[0] -= 1
                run_rc, run_err = cli("run", "--plugin", "grpo", "--config", "c.yaml", "max_steps=1",
                                      "max_completion_length=4", "output_dir=out", *override)
                assert "Traceback" not in run_err, f"run {what}: a traceback:\n{run_err[-3000:]}"
                if rc != 0:  # refused by validate: refused by run too, the same way
                    refused_cleanly(run_rc, run_err, f"run {what} (validate refused it)")
                else:  # valid: the run starts, and trains its step or stops with one error line
                    errors = [line for line in run_err.splitlines() if line.startswith("rlcore: error:")]
                    assert run_rc == 0 or (run_rc != 2 and len(errors) == 1), \
                        f"run {what}: validate accepted it, the run exited {run_rc}:\n{run_err[-3000:]}"
    finally:
        os.chdir(cwd)


KEY = st.one_of(st.none(), st.sampled_from(KEYS))
ENV_PAIR = st.one_of(st.none(), st.tuples(st.sampled_from(ENV), st.sampled_from(PATHS)))
SETTINGS = dict(database=None, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True,
                phases=(Phase.explicit, Phase.generate))  # no shrinking: a failing case is shown as drawn


@settings(max_examples=FUZZ_CASES, derandomize=True, **SETTINGS)
@given(key=KEY, value=values(), env_pair=ENV_PAIR)
def test_every_bad_input_is_refused_in_one_paragraph_and_validate_and_run_agree(cli, places, tmp_path_factory, key,
                                                                                 value, env_pair):
    check(cli, places, tmp_path_factory, key, value, env_pair)


@pytest.mark.fuzz
@settings(max_examples=int(os.environ.get("RLCORE_FUZZ_CASES", "2000")), derandomize=False, **SETTINGS)
@given(key=KEY, value=values(), env_pair=ENV_PAIR)
def test_the_long_fuzz(cli, places, tmp_path_factory, key, value, env_pair):
    runs_left[0] = 10**9  # every valid case trains its step
    check(cli, places, tmp_path_factory, key, value, env_pair)


def test_a_fifo_and_a_device_are_not_read_as_a_config(cli, places):
    where, _ = places
    assert stat.S_ISFIFO(os.stat(where["fifo"]).st_mode)
    for path in (where["fifo"], "/dev/zero"):
        rc, err = cli("config", "validate", "--plugin", "grpo", "--config", path)
        refused_cleanly(rc, err, f"--config {path}")


@pytest.mark.parametrize("override, key", [
    ("train.gpus=3466765310564", "train.gpus"),  # a plan of 3e12 ranks: MemoryError before
    ("output_dir=/dev/null", "output_dir"),  # run refused it, validate did not
    ("resume=/no/such/checkpoint", "resume"),
    ("train.engine=", "train.engine"),  # an engine no plugin registers
    ("dataset=/tmp/" + "n" * 300, "dataset"),  # a name too long: run said "cannot use" with exit 1
])
def test_the_long_fuzzs_finds_are_refused_by_validate_and_run_alike(cli, tmp_path, monkeypatch, override, key):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("model: tiny\ndataset: tiny:toy\nseed: 42\n")
    rc, err = cli("config", "validate", "--plugin", "grpo", "--config", "c.yaml", override)
    assert rc == 2 and key in err and "Traceback" not in err, err
    run_rc, run_err = cli("run", "--plugin", "grpo", "--config", "c.yaml", "max_steps=1", "output_dir=out", override)
    assert run_rc == 2 and "Traceback" not in run_err, run_err


def test_a_one_token_prompt_still_checks_the_weight_sync(cli, tmp_path, monkeypatch):
    """max_prompt_length=1: the weight-sync probe (the first prompt, cut to one token) is padded to the two tokens
    the check scores; the run refused it after placing its roles before."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("model: tiny\ndataset: tiny:toy\nseed: 42\n")
    rc, err = cli("run", "--plugin", "grpo", "--config", "c.yaml", "max_steps=1", "max_completion_length=4",
                  "output_dir=out", "max_prompt_length=1", "check_weight_sync=true")
    assert rc == 0, err
