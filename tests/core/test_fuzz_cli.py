"""A fuzzed CLI: `rlcore config validate` and `rlcore run --plugin grpo max_steps=1` given values drawn for every
key of the GRPO config (and a few nested ones) and for the environment variables rlcore and its libraries read:
each type's edges (0, negatives, huge finite numbers, inf/nan, empty and very long strings, deep nesting, wrong
types) and paths to files, folders, FIFOs and devices; every numeric key of the composed GRPO config at and past
both ends of its declared range and at the extremes of 64-bit and float numbers; a config file with nested aliases
(up to a billion laughs) and merge keys; `--config` naming each kind of path.

Each case either is valid (validate exits 0 and a run starts: it trains its step, or stops with one error line)
or is refused by validate and run with exit 2, at most 4 lines of stderr and no traceback: they agree; `plan`
refuses it alike, or (a problem only the model's or the data's files show, which plan does not read) plans it.
Damaged files of each kind are fuzzed by tests/core/test_integrity.py (each piece, every damage) and, end to end
through `--resume`, by the long form's `test_the_long_fuzz_of_damaged_checkpoints`.

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


def _numeric_keys() -> list[tuple[str, float | None, float | None, bool]]:
    """(dotted key, lowest, highest, is an int) of every numeric key of the GRPO config as a run composes it."""
    from rlcore.manager import load_plugins
    from tests.core.test_bounds import ends, numeric_keys

    model = load_plugins().config_model("grpo")
    return [(".".join(path), *ends(info), int in (info.annotation, *getattr(info.annotation, "__args__", ())))
            for path, info in numeric_keys(model)]


def numeric_extremes() -> st.SearchStrategy[tuple[str, str]]:
    """(key, value) at or past either end of a numeric key's range, or at the extremes of int64 and float."""
    keys = _numeric_keys()

    def around(entry: tuple[str, float | None, float | None, bool]) -> st.SearchStrategy[tuple[str, str]]:
        key, low, high, integer = entry
        near = [low, high] + ([low - 1, high + 1] if integer else [low - abs(low) * 1e-9 - 1e-300, high * (1 + 1e-9)])
        extreme = [2**63 - 1, 2**63, -(2**63) - 1, 10**39, 10**40 + 1, 1.7976931348623157e308, -1e308, 5e-324, 0, -1]
        return st.sampled_from([repr(int(v)) if integer and float(v).is_integer() and abs(v) < 2**70 else repr(v)
                                for v in near + extreme]).map(lambda v: (key, v))

    return st.sampled_from(keys).flatmap(around)


BASE_CONFIG = "model: tiny\ndataset: tiny:toy\nseed: 42\n"  # a config that runs, but for the case


def config_texts() -> st.SearchStrategy[str]:
    """The base config plus YAML aliases: nested lists of aliases (10**(levels+1) values: over the limit from 5
    levels), an alias as a section's value, merge keys."""
    def laughs(levels: int) -> str:  # under one free-form key, so that at most one problem is not the expansion
        lines = ["train:", "  engine_kwargs:", "    nest:", "      a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
        lines += [f"      a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
        return "\n".join(lines) + "\n"

    return st.one_of(
        st.integers(1, 9).map(lambda n: BASE_CONFIG + laughs(n)),
        st.just(BASE_CONFIG + "base: &b {gpus: 0, dtype: float32}\ntrain: *b\n"),
        st.just(BASE_CONFIG + "base: &b {gpus: 0}\ntrain: {<<: *b, dtype: float32}\nrollout: {<<: *b}\n"),
        st.just(BASE_CONFIG + "r: &r [accuracy]\nreward_funcs: *r\n"),
    )


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


def placed(text: str, places) -> str:
    """`text` with {file}, {dir}, ... replaced by the paths of those kinds."""
    where, _ = places
    for name, path in where.items():
        text = text.replace("{" + name + "}", path)
    return text


def case(draw_key, draw_value, draw_env, places) -> tuple[list[str], dict[str, str]]:
    override = [f"{draw_key}={placed(draw_value, places)}"] if draw_key else []
    env = {draw_env[0]: placed(draw_env[1], places)} if draw_env else {}
    return override, env


runs_left = [FUZZ_RUNS]


def check(cli, places, tmp_path_factory, key: str | None, value: str, env_pair: tuple[str, str] | None,
          text: str = BASE_CONFIG, config: str | None = None) -> None:
    """The case `key=value` with `env_pair` set, on a config file of `text` (or `config`, a path of some kind)."""
    override, env = case(key, value, env_pair, places)
    work = tmp_path_factory.mktemp("case")
    config = placed(config, places) if config else "c.yaml"
    what = f"{' '.join(override)} {env} --config {config}" + (f" holding {text[:200]!r}" if config == "c.yaml" else "")
    cwd = os.getcwd()
    os.chdir(work)
    (work / "c.yaml").write_text(text)
    try:
        with environment(env):
            rc, err = cli("config", "validate", "--plugin", "grpo", "--config", config, *override)
            if rc != 0:
                refused_cleanly(rc, err, f"config validate {what}")
                plan_rc, plan_err = cli("plan", "--plugin", "grpo", "--config", config, *override)
                if plan_rc != 0:  # plan refuses the config's own problems; it reads no model file, nor the data
                    refused_cleanly(plan_rc, plan_err, f"plan {what} (validate refused it)")
                assert "Traceback" not in plan_err, f"plan {what}: a traceback:\n{plan_err[-3000:]}"
            runs = rc == 0 and runs_left[0] > 0
            if rc != 0 or runs:
                if runs:
                    runs_left[0] -= 1
                run_rc, run_err = cli("run", "--plugin", "grpo", "--config", config, "max_steps=1",
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


KEY_VALUE = st.one_of(st.tuples(st.one_of(st.none(), st.sampled_from(KEYS)), values()), numeric_extremes())
ENV_PAIR = st.one_of(st.none(), st.tuples(st.sampled_from(ENV), st.sampled_from(PATHS)))
TEXT = st.one_of(st.just(BASE_CONFIG), config_texts())
CONFIG = st.one_of(st.none(), st.none(), st.sampled_from(PATHS))  # None: the case's c.yaml
SETTINGS = dict(database=None, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True,
                phases=(Phase.explicit, Phase.generate))  # no shrinking: a failing case is shown as drawn


@settings(max_examples=FUZZ_CASES, derandomize=True, **SETTINGS)
@given(key_value=KEY_VALUE, env_pair=ENV_PAIR, text=TEXT, config=CONFIG)
def test_every_bad_input_is_refused_in_one_paragraph_and_validate_and_run_agree(cli, places, tmp_path_factory,
                                                                                 key_value, env_pair, text, config):
    check(cli, places, tmp_path_factory, *key_value, env_pair, text, config)


@pytest.mark.fuzz
@settings(max_examples=int(os.environ.get("RLCORE_FUZZ_CASES", "2000")), derandomize=False, **SETTINGS)
@given(key_value=KEY_VALUE, env_pair=ENV_PAIR, text=TEXT, config=CONFIG)
def test_the_long_fuzz(cli, places, tmp_path_factory, key_value, env_pair, text, config):
    runs_left[0] = 10**9  # every valid case trains its step
    check(cli, places, tmp_path_factory, *key_value, env_pair, text, config)


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


@pytest.fixture(scope="module")
def finished_run(cli, tmp_path_factory):
    """A GRPO run of 2 steps with checkpoint-1 and checkpoint-2, for the damaged-checkpoint fuzz to copy."""
    work = tmp_path_factory.mktemp("finished")
    (work / "c.yaml").write_text(BASE_CONFIG)
    rc, err = cli("run", "--plugin", "grpo", "--config", str(work / "c.yaml"), "max_steps=2", "save_steps=1",
                  "max_completion_length=4", f"output_dir={work / 'run'}")
    assert rc == 0, err
    return work


@pytest.mark.fuzz
@settings(max_examples=int(os.environ.get("RLCORE_FUZZ_CASES", "200")) // 10 or 1, derandomize=False, **SETTINGS)
@given(data=st.data())
def test_the_long_fuzz_of_damaged_checkpoints(cli, finished_run, tmp_path_factory, data):
    """A piece of the newest checkpoint (any of its files) truncated, emptied, overwritten in part or extended, then
    `--resume` to step 3: it passes over the damaged checkpoint (or the damage is harmless) and trains, every step
    once in metrics.jsonl; or it stops in one error line with no traceback."""
    import json
    import random
    import shutil

    work = tmp_path_factory.mktemp("damaged")
    shutil.copytree(finished_run / "run", work / "run")
    pieces = sorted(p for p in (work / "run" / "checkpoint-2").rglob("*") if p.is_file())
    piece = data.draw(st.sampled_from(pieces))
    how = data.draw(st.sampled_from(["truncate", "empty", "overwrite", "append"]))
    raw = bytearray(piece.read_bytes())
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    if how == "truncate":
        raw = raw[: rng.randrange(len(raw))] if raw else raw
    elif how == "empty":
        raw = bytearray()
    elif how == "overwrite" and raw:
        at = rng.randrange(len(raw))
        raw[at: at + 64] = bytes(rng.randrange(256) for _ in range(len(raw[at: at + 64])))
    else:
        raw += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 100)))
    piece.write_bytes(bytes(raw))
    what = f"{how} {piece.relative_to(work)}"
    rc, err = cli("run", "--plugin", "grpo", "--config", str(finished_run / "c.yaml"), "max_steps=3", "save_steps=1",
                  "max_completion_length=4", f"output_dir={work / 'run'}", "--resume")
    errors = [line for line in err.splitlines() if line.startswith("rlcore: error:")]
    assert "Traceback" not in err, f"{what}: a traceback:\n{err[-3000:]}"
    if rc == 0:
        steps = [json.loads(line)["step"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3], (what, steps)
    else:
        assert rc in (1, 2) and len(errors) == 1, f"{what}: exit {rc}:\n{err[-3000:]}"
