"""Sampling: best-of-N selection, the exact JSONL of a deterministic engine and scorers, the demo, worker-count
independence on a real Ray, and kill -9 at several points of a run, resumed, byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore import ConfigError, load_config, load_plugins
from rlcore.plugins.sampling.config import DistillConfig, SampleConfig
from rlcore.plugins.sampling.select import aggregate_steps, normalize, select
from rlcore.plugins.sampling.trainer import SampleTrainer, shard
from rlcore.runtime.resources import plan_from_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray" / "sample"

FAKES = r"""'''A plugin file for the sampling tests (loaded with `load_plugins(extra=...)` or `--with`): a rollout engine
whose candidates are a fixed table, a process reward model scoring steps by their length, and an outcome
reward `contains_solution`. Deterministic, so the expected JSONL can be written by hand.'''

from rlcore import EngineSpec, Generation, RewardSpec, RolloutEngine, hookimpl

CANDIDATES = (
    "I guess.\n\n7",
    "Add 1 and 1.\n\nSo 2",
    "Hmm.\n\n3",
    "One plus one is two.\n\nThe answer is 2",
)


class TableEngine(RolloutEngine):
    '''Candidate j of every prompt is CANDIDATES[j % 4].'''

    def __init__(self, model, dtype="float32", seed=0, device="cpu"):
        self.model = model

    def generate(self, prompts, params):
        return [Generation(i, [1], [0.0], "stop", CANDIDATES[j % len(CANDIDATES)])
                for i in range(len(prompts)) for j in range(params.n)]

    def prompt_topk_logprobs(self, sequences, k):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def sleep(self, level=1):
        pass

    def wake_up(self, tags=None):
        pass


class StepLengthPrm:
    '''A step's score is min(1, len(step) / 20).'''

    def __init__(self, model_path, device="cpu", dtype="float32", batch_size=16, step_separator="\n\n", step_token=None):
        self.separator = step_separator

    def score(self, prompts, completions):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [[min(1.0, len(step) / 20) for step in text.split(self.separator)] for text in texts]


def contains_solution(prompts, completions, completion_ids=None, solution=None, **columns):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if s in t else 0.0 for t, s in zip(texts, solution)]


@hookimpl
def rlcore_engines():
    yield EngineSpec("table", kind="rollout", factory=TableEngine)
    yield EngineSpec("step_length", kind="reward", factory=StepLengthPrm)


@hookimpl
def rlcore_rewards():
    yield RewardSpec("contains_solution", fn=contains_solution)
"""


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins") / "sampling_fakes.py"
    path.write_text(FAKES)
    return path


@pytest.fixture(scope="module")
def plugins(fakes):
    return load_plugins(extra=(str(fakes),))


# -- selection, as ms-swift's sampler selects -------------------------------------------------------------


def test_step_scores_aggregate_by_min_last_or_prod():
    steps = [0.9, 0.5, 0.8]
    assert aggregate_steps(steps, "min") == 0.5
    assert aggregate_steps(steps, "last") == 0.8
    assert aggregate_steps(steps, "prod") == pytest.approx(0.36)
    assert aggregate_steps([], "min") == 0.0
    with pytest.raises(ValueError, match="mean.*min, last, prod"):
        aggregate_steps(steps, "mean")


def test_normalisation_is_ms_swift_min_max():
    assert normalize([1.0, 3.0, 2.0]) == [0.0, 2 / (2 + 1e-5), 1 / (2 + 1e-5)]
    assert normalize([0.0, 0.0]) == [0.0, 0.0]
    assert normalize([0.4, 0.4]) == [0.4, 0.4] and normalize([7.0, 7.0]) == [1.0, 1.0]


def test_best_of_n_keeps_passing_candidates_with_the_worst_as_partner():
    picked = select([1.0, 0.0, 1.0, 0.0], [0.9, 0.2, 0.3, 0.1], n_best_to_keep=2)
    assert picked.chosen == (0, 2) and picked.rejected == 3
    # the best-scoring candidate fails the PRM threshold: only the passing one of the best two is kept
    picked = select([1.0, 0.0, 1.0, 0.0], [0.9, 0.2, 0.3, 0.1], n_best_to_keep=2, prm_threshold=0.5)
    assert picked.chosen == (0,) and picked.passed == (True, False, False, False)
    assert select([0.0, 0.0], None, 1).chosen == ()  # nothing passes the ORM (> 0)
    easy = select([1.0, 1.0, 1.0, 0.0], None, 1, easy_query_threshold=0.75)
    assert easy.easy and easy.chosen == ()
    assert select([1.0, 1.0, 0.0, 0.0], None, 1, easy_query_threshold=0.75).chosen == (0,)


def test_data_range_shards_drop_no_row():
    rows = list(range(10))
    shards = [shard(rows, i, 3) for i in range(3)]
    assert [s for _, s in shards] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [start for start, _ in shards] == [0, 4, 7]


# -- the exact output of a deterministic engine, ORM and PRM -------------------------------------------------

ROWS = [
    {"messages": [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}],
     "solution": "2", "source": "a"},
    {"messages": [{"role": "user", "content": "What is 1+2?"}], "solution": "3", "source": "b"},
    {"prompt": "Say 1.", "solution": "1", "source": "c"},
    {"prompt": "End with a period.", "solution": ".", "source": "d"},
]
SCORED = {"orm_model": "contains_solution", "prm_model": "any", "prm": {"engine": "step_length"},
          "prm_threshold": 0.1, "easy_query_threshold": 0.75, "num_return_sequences": 4, "batch_size": 3,
          "sampler": {"engine": "table"}}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def md5(row):
    return hashlib.md5(json.dumps(row, sort_keys=True).encode()).hexdigest()


def run(plugins, tmp_path, tiny_model, config=SampleConfig, use_ray=False, out="run", **keys):
    data = write_rows(tmp_path / "data.jsonl", keys.pop("rows", ROWS))
    keys.setdefault("max_prompt_length", 512)  # with max_new_tokens, within the tiny model's 1024 positions
    cfg = config(**{"model": str(tiny_model), "dataset": str(data), "output_dir": str(tmp_path / out), **keys})
    summary = SampleTrainer(cfg, plugins, use_ray=use_ray).fit()
    return summary, tmp_path / out


def test_the_sampler_never_sleeps_whatever_sleep_level_says(plugins, tmp_path, tiny_model):
    """Nothing trains beside it: `session_fixed` keeps the session's sleep_level 0 (the memory plan reads the same)."""
    data = write_rows(tmp_path / "data.jsonl", ROWS)
    cfg = SampleConfig(model=str(tiny_model), dataset=str(data), output_dir=str(tmp_path / "run"), sleep_level=2,
                       max_prompt_length=512, **SCORED)
    trainer = SampleTrainer(cfg, plugins)
    assert trainer.session.sleep_level == 0 and SampleTrainer.session_fixed == {"sleep_level": 0}


def test_exact_jsonl_of_a_deterministic_engine_orm_and_prm(plugins, tmp_path, tiny_model):
    """Candidates are the table's four; ORM: the solution is in the text; PRM: each step min(1, len/20),
    aggregated by min -> [0.05, 0.2, 0.05, 0.75]. Row 1: candidates 1 and 3 pass, 3 scores best, 0 and 2 tie
    last (the later one is the partner). Row 2: only candidate 2 has the solution and it fails prm_threshold.
    Row 3: candidate 1. Row 4: all four contain '.', an easy query (>= 0.75 of them pass the ORM)."""
    summary, out = run(plugins, tmp_path, tiny_model, **SCORED)
    a, c = ROWS[0], ROWS[2]
    expected = [
        {"messages": [{"role": "user", "content": "What is 1+1?"},
                      {"role": "assistant", "content": "One plus one is two.\n\nThe answer is 2"}],
         "solution": "2", "source": "a", "rejected_response": "Hmm.\n\n3", "id": md5(a)},
        {"prompt": "Say 1.", "solution": "1", "source": "c",
         "messages": [{"role": "user", "content": "Say 1."}, {"role": "assistant", "content": "Add 1 and 1.\n\nSo 2"}],
         "rejected_response": "Hmm.\n\n3", "id": md5(c)},
    ]
    text = (out / "samples.jsonl").read_text()
    assert text == "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in expected)
    assert summary == {"output": str(out / "samples.jsonl"), "prompts": 4, "rows": 2, "batches": 2}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and [m["prompts"] for m in metrics] == [3, 1]
    assert [m["kept"] for m in metrics] == [2, 0] and [m["easy_dropped"] for m in metrics] == [0, 1]
    assert metrics[0]["pass_rate"] == 3 / 12 and metrics[1]["pass_rate"] == 2 / 4  # row 4: candidates 1, 3
    assert metrics[0]["prompts_per_s"] > 0 and "time/generate" in metrics[0] and "time/score" in metrics[0]
    assert not list(out.glob(".samples.jsonl.partial"))

    _, dpo = run(plugins, tmp_path, tiny_model, out="dpo", output_format="dpo", **SCORED)
    pairs = [json.loads(line) for line in (dpo / "samples.jsonl").read_text().splitlines()]
    assert [list(p) for p in pairs] == [["prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"]] * 2
    assert pairs[0]["prompt"] == [{"role": "user", "content": "What is 1+1?"}]
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": "One plus one is two.\n\nThe answer is 2"}]
    assert pairs[0]["rejected"] == [{"role": "assistant", "content": "Hmm.\n\n3"}]
    best = 10 / (1 + 1e-5) + (0.75 - 0.05) / (0.75 - 0.05 + 1e-5)  # ms-swift: prm + 10 * orm, min-max normalised
    assert pairs[0]["chosen_reward"] == pytest.approx(best) and pairs[0]["rejected_reward"] == 0.0
    assert pairs[1]["prompt"] == [{"role": "user", "content": "Say 1."}]


def test_without_scorers_every_candidate_is_written(plugins, tmp_path, tiny_model):
    run(plugins, tmp_path, tiny_model, sampler={"engine": "table"}, num_return_sequences=2, rows=ROWS[:1],
        system="Be brief.")
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [r["messages"][-1]["content"] for r in rows] == ["I guess.\n\n7", "Add 1 and 1.\n\nSo 2"]
    assert rows[0]["messages"][:2] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}]
    assert "rejected_response" not in rows[0] and rows[0]["id"] == md5(ROWS[0])


def test_a_signal_stops_after_the_batch_naming_what_holds_it_not_a_checkpoint(fakes, tmp_path, tiny_model, capfd):
    """Ctrl-C as batch 1 is logged: the stop message names the output so far and its state file, which exist (it
    named a checkpoint-1 that sampling never writes), and rlcore_run.json says the run was stopped by SIGINT."""
    import signal

    from rlcore import hookimpl

    class Interrupt:
        @hookimpl
        def rlcore_step_end(self, trainer, step, metrics):
            if step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    plugins = load_plugins(extra=(str(fakes),))
    plugins.register(Interrupt(), "interrupt")
    with pytest.raises(KeyboardInterrupt):
        run(plugins, tmp_path, tiny_model, sampler={"engine": "table"}, num_return_sequences=2, batch_size=1)
    err = capfd.readouterr().err
    assert "stopped by SIGINT after step 1, which .samples.jsonl.partial with .samples.jsonl.state.json holds " \
           "(continue with --resume)" in err and "checkpoint-" not in err, err
    out = tmp_path / "run"
    assert (out / ".samples.jsonl.partial").is_file() and (out / ".samples.jsonl.state.json").is_file()
    assert json.loads((out / "rlcore_run.json").read_text())["state"] == "stopped"
    assert json.loads((out / "rlcore_run.json").read_text())["reason"] == "SIGINT"


def test_an_orm_reward_function_gets_the_candidates_token_ids(plugins, tmp_path, tiny_model):
    """soft_overlong scores by token count: every table candidate is one token, so all score 0 and tie; the
    first is kept, the last is its partner (without token ids the reward would fail on every candidate)."""
    run(plugins, tmp_path, tiny_model, sampler={"engine": "table"}, num_return_sequences=4, rows=ROWS[:1],
        orm_model="soft_overlong", orm_kwargs={"max_completion_length": 4, "soft_cache_length": 2}, orm_threshold=-1)
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["messages"][-1]["content"], r["rejected_response"]) for r in rows] == [
        ("I guess.\n\n7", "One plus one is two.\n\nThe answer is 2")]


def test_a_fresh_run_never_overwrites_and_resume_needs_something(plugins, tmp_path, tiny_model):
    run(plugins, tmp_path, tiny_model, **SCORED)
    before = (tmp_path / "run" / "samples.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="samples.jsonl already exists; a fresh run never overwrites it"):
        run(plugins, tmp_path, tiny_model, **SCORED)
    assert (tmp_path / "run" / "samples.jsonl").read_bytes() == before
    done, _ = run(plugins, tmp_path, tiny_model, resume="auto", **SCORED)  # finished: nothing to do
    assert done["rows"] == 2
    with pytest.raises(ConfigError, match="holds no unfinished samples.jsonl"):
        run(plugins, tmp_path, tiny_model, out="other", resume="auto", **SCORED)


@pytest.mark.parametrize(
    "keys, problem",
    [
        ({"data_range": [3, 3]}, "data_range"),
        ({"output_format": "dpo"}, "output_format"),
        ({"orm_model": "accuracy", "n_best_to_keep": 8}, "n_best_to_keep"),
        ({"prm_aggregation": "mean"}, "prm_aggregation"),
        ({"output_file": "../x.jsonl"}, "output_file"),
    ],
)
def test_bad_keys_are_named(keys, problem):
    with pytest.raises(ConfigError) as err:
        load_config(SampleConfig, None, [f"{k}={json.dumps(v)}" for k, v in keys.items()])
    assert problem in [key for key, _ in err.value.problems]


@pytest.mark.parametrize("keys, key, message", [
    ({"orm_model": "accuarcy"}, "orm_model", "neither a registered reward function .* Did you mean 'accuracy'"),
    ({"orm_model": "accuracy", "orm_kwargs": {"tolerance": 1}}, "orm_kwargs", "orm_kwargs: this reward takes no options"),
    ({"orm_model": "cosine", "orm_kwargs": {"maxlen": 1}}, "orm_kwargs.maxlen", "has no option 'maxlen'.*'max_len'"),
    ({"sampler": {"engine": "vlm"}}, "sampler.engine", "rollout/vlm' is not registered.*Did you mean 'rollout/vllm'"),
    ({"prm_model": "org/prm", "prm": {"engine": "nope"}}, "prm.engine", "reward/nope' is not registered"),
])
def test_names_are_checked_before_anything_is_built(plugins, tmp_path, tiny_model, keys, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        run(plugins, tmp_path, tiny_model, **keys)
    assert key in [k for k, _ in err.value.problems]
    assert not (tmp_path / "run").exists()  # nothing written, no worker started


def test_distill_keys_are_distills_own():
    with pytest.raises(ConfigError, match="api_base"):
        load_config(SampleConfig, None, ["api_base=http://127.0.0.1:1/v1"])
    with pytest.raises(ConfigError, match="model"):
        load_config(DistillConfig, None, ["api_base=http://127.0.0.1:1/v1"])


def test_examples_load_and_place():
    plugins = load_plugins()
    sampling = load_config(SampleConfig, EXAMPLES / "sampling.yaml")
    roles = SampleTrainer.roles(sampling)
    assert roles == ["sampler", "prm", "orm"] and sampling.sampler.engine == "vllm"
    plan = plan_from_config(sampling, roles=roles, plugins=plugins)
    assert plan.ranks_of("sampler") == (0, 1) and plan.ranks_of("prm") == plan.ranks_of("orm") == (2, 3)
    assert plan.roles_on(2) == ("prm", "orm")
    distill = load_config(DistillConfig, EXAMPLES / "distill.yaml", ["model=Qwen/Qwen3-8B"])
    assert distill.api_base == "http://127.0.0.1:8000/v1" and SampleTrainer.roles(distill) == []


# -- worker-count independence ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prm_model(tmp_path_factory):
    from rlcore.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "prm", num_labels=2, seed=5)


@pytest.mark.ray
def test_the_output_does_not_depend_on_the_number_of_workers(ray_local, plugins, tmp_path, tiny_model, prm_model):
    """One in-process sampler, then two Ray sampler workers and a Ray group holding prm and orm (ms-swift's
    device_groups form): a real tiny model samples, a real tiny PRM and the toy reward score, and the files are
    byte for byte the same, because candidates are drawn per prompt and normalised over all of a prompt's."""
    from rlcore.testing import toy_dataset

    keys = dict(rows=toy_dataset(12, seed=1), num_return_sequences=3, max_new_tokens=6, batch_size=6,
                orm_model="toy", prm_model=str(prm_model), prm={"batch_size": 1}, prm_threshold=0.0, n_best_to_keep=1)
    local, _ = run(plugins, tmp_path, tiny_model, out="local", **keys)
    groups = {"sample_group": {"device": "CPU", "ranks": 2, "workers": ["sampler"]},
              "rm_group": {"device": "CPU", "ranks": 1, "workers": ["prm", "orm"]}}
    spread, _ = run(plugins, tmp_path, tiny_model, use_ray=True, out="ray", device_groups=groups, **keys)
    assert local["rows"] == spread["rows"] > 0
    text = (tmp_path / "local" / "samples.jsonl").read_bytes()
    assert text == (tmp_path / "ray" / "samples.jsonl").read_bytes()
    assert len({json.loads(line)["messages"][-1]["content"] for line in text.splitlines()}) > 1  # sampled, not fixed


# -- kill -9 at several points, resumed: the same bytes ------------------------------------------------------

KILLER = """
import os, signal

_WHEN = os.environ["SAMPLING_KILL"]  # "fsync:N": before the N-th fsync of the partial file; "state:N": before the
_calls = {"fsync": 0, "state": 0, "final": 0}  # N-th rename of the state file; "final": before the final file's rename
_fsync, _replace = os.fsync, os.replace


def _die(kind):
    _calls[kind] += 1
    if _WHEN in (f"{kind}:{_calls[kind]}", kind):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync(fd):
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
        _die("fsync")
    return _fsync(fd)


def replace(src, dst, **kw):
    if str(dst).endswith(".state.json"):
        _die("state")
    elif str(src).endswith(".partial"):
        _die("final")
    return _replace(src, dst, **kw)


os.fsync, os.replace = fsync, replace
"""


def test_kill_9_at_any_point_then_resume_gives_the_same_bytes(plugins, fakes, tmp_path, tiny_model):
    """Eight prompts in four batches, kill -9 in a real CLI process: before batch 1's lines are fsynced (written,
    not committed); resumed, before batch 3's state rename (its lines fsynced, the state still at batch 2);
    resumed, before the final rename (the state says done); resumed once more. The file equals an
    uninterrupted run's byte for byte, and each kill's lock was taken over."""
    rows = [dict(ROWS[i % 4], n=i) for i in range(8)]
    keys = {**SCORED, "batch_size": 2, "easy_query_threshold": None, "max_prompt_length": 512}
    run(plugins, tmp_path, tiny_model, rows=rows, out="whole", **keys)
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    overrides = [f"model={tiny_model}", f"dataset={tmp_path / 'data.jsonl'}", f"output_dir={tmp_path / 'killed'}"]
    overrides += [f"{k}={json.dumps(v)}" for k, v in keys.items()]
    command = [sys.executable, "-m", "rlcore", "run", "--plugin", "sample", "--with", str(fakes), "--with", str(killer)]
    partial = tmp_path / "killed" / ".samples.jsonl.partial"
    state = tmp_path / "killed" / ".samples.jsonl.state.json"
    # (kill point, resume?, batches the state holds after the kill, uncommitted bytes in the partial file?)
    points = (("fsync:2", [], 0, True), ("state:3", ["--resume"], 2, True), ("final", ["--resume"], 4, False),
              ("never", ["--resume"], 4, False))
    for when, resume, batches, torn in points:
        done = subprocess.run(command + resume + overrides, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "SAMPLING_KILL": when})
        saved = json.loads(state.read_text())
        assert saved["batches"] == batches, (when, saved)
        if when == "never":
            assert done.returncode == 0, done.stderr[-3000:]
            assert "already complete" in done.stderr  # the last kill came after the state said done
            continue
        assert done.returncode == -9, (when, done.stderr[-3000:])
        assert partial.is_file() and not (tmp_path / "killed" / "samples.jsonl").exists()
        assert (partial.stat().st_size > saved["bytes"]) == torn and saved["done"] == (when == "final")
    whole = (tmp_path / "whole" / "samples.jsonl").read_bytes()
    assert whole.count(b"\n") == 6  # rows 1, 3 and 4 of each four kept (no easy_query_threshold)
    assert (tmp_path / "killed" / "samples.jsonl").read_bytes() == whole
    assert not partial.exists()
    metrics = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3, 4]  # a batch made twice is logged once


# -- the embedded demo --------------------------------------------------------------------------------------


def test_the_embedded_demo(tmp_path, unlisted_metrics):
    """`rlcore run --plugin sample`: the tiny model samples 8 toy prompts, the toy reward picks the best of 4."""
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "rlcore", "run", "--plugin", "sample", f"output_dir={out}"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["algorithm"] == "sample" and summary["prompts"] == 8 and 0 < summary["rows"] <= 8
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == summary["rows"] and all(r["target"] == "aeiou" and "rejected_response" in r for r in rows)
    assert "prompt/s" in done.stderr and "pass_rate=" in done.stderr
    assert unlisted_metrics(out / "metrics.jsonl") == []  # README's metric names
    from rlcore.metrics import MetricsWriter
    from rlcore.plot import figure, run_note

    rows = MetricsWriter(out / "metrics.jsonl").read()
    fig = figure(rows, run_note(out / "metrics.jsonl")["plot_keys"], "sample")  # what `rlcore plot` draws
    assert [ax.get_ylabel() for ax in fig.axes] == ["pass_rate", "kept", "prompts_per_s", "candidates/mean_chars",
                                                    "orm/mean"]
    assert [t for t in fig.axes[-1].get_xticks() if 0.5 <= t <= len(rows) + 0.5] == [1, 2]  # whole batches
