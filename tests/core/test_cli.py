"""The `rlcore` command through a subprocess: exit statuses, messages without tracebacks, lifecycle hooks."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

import rlcore
from rlcore.config import load_config

# Installed as a distribution next to the example, so its hooks observe `rlcore run --plugin example`.
OBSERVER = textwrap.dedent(
    """
    import json, os
    from rlcore import AlgorithmSpec, ConfigError, RunConfig, Trainer, hookimpl

    def log(**event):
        with open(os.environ["HOOK_LOG"], "a") as f:
            f.write(json.dumps(event) + "\\n")

    class Interrupted(Trainer):
        def fit(self):
            if os.environ.get("CTRL_C_AGAIN"):  # a second Ctrl-C while the process exits
                import signal, threading, time
                again = lambda: (time.sleep(0.5), os.kill(os.getpid(), signal.SIGINT))
                threading.Thread(target=again).start()  # not a daemon: the exit waits for it
            raise KeyboardInterrupt

    @hookimpl
    def rlcore_algorithms():
        yield AlgorithmSpec("interrupted", config=RunConfig, trainer=Interrupted)

    @hookimpl
    def rlcore_configure(config, algorithm):
        if algorithm == "example" and config.steps == 13:
            raise ConfigError("steps=13 is refused by the observer plugin")
        if algorithm == "example" and config.steps == 14:
            config.lr = -1.0  # validated on assignment: a configuration error
        if algorithm == "example":
            config.num_workers = 3
        log(event="configure", algorithm=algorithm)

    @hookimpl
    def rlcore_train_start(trainer):
        log(event="start", workers=trainer.config.num_workers)

    @hookimpl
    def rlcore_step_end(trainer, step, metrics):
        log(event="step", step=step, loss=metrics["loss"])

    @hookimpl
    def rlcore_train_end(trainer, metrics):
        log(event="end", w=metrics["w"])
    """
)


@pytest.fixture
def observed(rlcore_cli, make_distribution, tmp_path):
    """`rlcore` with the observer plugin installed; hook events land in tmp_path/hooks.jsonl."""
    site = make_distribution("rlcore-observer", "observer", "rlcore_observer", OBSERVER)
    env = {"PYTHONPATH": str(site), "HOOK_LOG": str(tmp_path / "hooks.jsonl")}
    return lambda *args, **extra: rlcore_cli(*args, env={**env, **extra})


def events(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "hooks.jsonl").read_text().splitlines()]


def assert_usage_error(done, *needles: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("rlcore: error: ") and "Traceback" not in done.stderr
    for needle in needles:
        assert needle in done.stderr


def test_version(rlcore_cli):
    done = rlcore_cli("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"rlcore {rlcore.__version__}")


def test_run_calls_configure_and_the_lifecycle_hooks(observed, tmp_path):
    done = observed("run", "--plugin", "example", "steps=5", "output_dir=out")
    assert done.returncode == 0, done.stderr
    seen = events(tmp_path)
    assert [e["event"] for e in seen] == ["configure", "start"] + ["step"] * 5 + ["end"]
    assert seen[1]["workers"] == 3  # rlcore_configure adjusted the config before the trainer was built
    assert [e["step"] for e in seen if e["event"] == "step"] == [1, 2, 3, 4, 5]
    assert seen[-1]["w"] == json.loads(done.stdout.splitlines()[-1])["w"]


def test_configure_can_reject_a_config(observed, tmp_path):
    assert_usage_error(observed("run", "--plugin", "example", "steps=13"), "steps=13 is refused")
    assert not (tmp_path / "output").exists()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["run", "--plugin", "exmaple"], ["no plugin or algorithm is called 'exmaple'", "Did you mean 'example'?"]),
        (["run", "--plugin", "example", "stpes=3"], ["stpes: unknown key 'stpes'. Did you mean 'steps'?"]),
        (["run", "--plugin", "example", "steps=many"], ["steps: Input should be a valid integer", "'many'"]),
        (["run", "--plugin", "example", "--config", "missing.yaml"], ["--config missing.yaml: does not exist"]),
        (["run", "--plugin", "interrupted", "--resume"], ["algorithm 'interrupted' has no 'resume' key"]),
        (["run", "--plugin", "example", "steps=14"], ["in rlcore_configure", "lr: Input should be greater than 0"]),
    ],
    ids=["unknown-plugin", "bad-key", "bad-value", "missing-file", "resume-unsupported", "bad-value-from-hook"],
)
def test_usage_and_config_errors_exit_2_without_a_traceback(observed, args, needles):
    assert_usage_error(observed(*args), *needles)


def test_argparse_usage_errors_exit_2(rlcore_cli):
    done = rlcore_cli("run")
    assert done.returncode == 2 and "--plugin" in done.stderr and "Traceback" not in done.stderr


def test_a_runtime_failure_exits_1_with_a_traceback_only_when_debugging(rlcore_cli):
    done = rlcore_cli("run", "--plugin", "example", "lr=50", "output_dir=diverged")
    assert done.returncode == 1
    assert "rlcore: error: example: training diverged" in done.stderr and "Traceback" not in done.stderr
    debug = rlcore_cli("run", "--plugin", "example", "lr=50", "output_dir=diverged2", env={"RLCORE_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_interrupt_exits_130(observed):
    done = observed("run", "--plugin", "interrupted")
    assert done.returncode == 130 and "interrupted" in done.stderr


def test_a_second_ctrl_c_while_exiting_ends_it_with_130(observed):
    done = observed("run", "--plugin", "interrupted", CTRL_C_AGAIN="1")
    assert done.returncode == 130, done.stderr  # not -2 (killed by SIGINT) from a KeyboardInterrupt at exit
    assert "Traceback" not in done.stderr


def test_resume_continues_a_run(rlcore_cli, tmp_path):
    assert rlcore_cli("run", "--plugin", "example", "steps=4", "output_dir=r").returncode == 0
    assert_usage_error(rlcore_cli("run", "--plugin", "example", "steps=6", "output_dir=r"), "--resume")
    done = rlcore_cli("run", "--plugin", "example", "--resume", "steps=6", "output_dir=r")
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_plugins_json_with_every_installed_plugin(rlcore_cli):
    done = rlcore_cli("plugins", "--json", env={"RLCORE_DISABLE_PLUGINS": ""})
    assert done.returncode == 0
    listed = {p["name"]: p for p in json.loads(done.stdout)}
    assert {"name", "version", "distribution", "provides"} <= set(listed["example"])
    assert listed["example"]["provides"]["placements"] == ["reverse"]
    assert listed["builtins"]["version"] == rlcore.__version__


def test_config_show_prints_a_config_that_loads_back(rlcore_cli, tmp_path):
    done = rlcore_cli("config", "show", "--plugin", "example", "lr=0.25")
    assert done.returncode == 0, done.stderr
    assert "# learning rate\nlr: 0.25\n" in done.stdout
    (tmp_path / "shown.yaml").write_text(done.stdout)
    config_model = rlcore.load_plugins().algorithms.get("example").config
    assert load_config(config_model, tmp_path / "shown.yaml") == config_model(lr=0.25)


def test_config_validate(rlcore_cli, tmp_path):
    (tmp_path / "good.yaml").write_text("steps: 3\nlr: 0.2\n")
    done = rlcore_cli("config", "validate", "--plugin", "example", "--config", "good.yaml", "steps=4")
    assert done.returncode == 0 and "valid for algorithm 'example'" in done.stdout
    (tmp_path / "bad.yaml").write_text("steps: 0\nlr: high\nnum_worker: 2\n")
    bad = rlcore_cli("config", "validate", "--plugin", "example", "--config", "bad.yaml")
    assert_usage_error(bad, "3 problems", "steps:", "lr:", "Did you mean 'num_workers'?")


def test_dashed_overrides_as_ms_swift_spells_them(tmp_path, capsys):
    """`--device_groups '{...}'` (a JSON string) and `--key=value` work like key=value overrides."""
    from rlcore.cli import main

    groups = '{"nproc_per_node": 4, "sample_group": {"device": "GPU", "ranks": "list(range(0, 2))", "workers": ["train"]}}'
    assert main(["config", "show", "--plugin", "grpo", "--device_groups", groups, "--max_steps=7"]) == 0
    shown = capsys.readouterr().out
    assert "max_steps: 7" in shown and "nproc_per_node: 4" in shown and "list(range(0, 2))" in shown
    assert main(["config", "show", "max_steps=5", "--plugin", "grpo", "--seed", "3", "temperature=0.5"]) == 0
    shown = capsys.readouterr().out
    assert "max_steps: 5" in shown and "seed: 3" in shown and "temperature: 0.5" in shown
    assert main(["config", "show", "--plugin", "grpo", "--max_stesp", "7"]) == 2
    assert "Did you mean 'max_steps'" in capsys.readouterr().err
    assert main(["config", "show", "--plugin", "grpo", "--max_steps"]) == 2  # a bare --key is true: not a number
    assert "max_steps: is a number, not a boolean" in capsys.readouterr().err


# -------------------------------------------------------------------------
# several plugins in one run: --plugin, --with, RLCORE_PLUGINS; replacing an installed algorithm
# -------------------------------------------------------------------------

# A hook-only plugin file: it adds no algorithm, it observes the run (here: writes what it would post).
HOOKS = textwrap.dedent(
    """
    import json
    from rlcore import hookimpl

    @hookimpl
    def rlcore_step_end(trainer, step, metrics):
        with open("posted.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "algorithm": trainer.name, "reward": metrics.get("reward")}) + "\\n")
    """
)

# The installed example algorithm, subclassed in a plain file under the same name.
STEEPER = textwrap.dedent(
    """
    from rlcore import AlgorithmSpec, hookimpl
    from rlcore_example.trainer import LineFitConfig, LineFitTrainer

    class Steeper(LineFitTrainer):
        def make_data(self):
            xs, ys = super().make_data()
            return xs, [y + 3.0 * x for x, y in zip(xs, ys)]

    @hookimpl
    def rlcore_algorithms():
        yield AlgorithmSpec("example", config=LineFitConfig, trainer=Steeper)
    """
)

TINY_GRPO = ["max_steps=2", "max_completion_length=8", "per_device_train_batch_size=16", "num_generations=4"]


def posted(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "posted.jsonl").read_text().splitlines()]


def test_a_hook_only_file_joins_a_grpo_run(rlcore_cli, tmp_path):
    (tmp_path / "hooks.py").write_text(HOOKS)
    done = rlcore_cli("run", "--plugin", "grpo", "--with", "./hooks.py", "output_dir=out", *TINY_GRPO,
                      env={"RLCORE_DISABLE_PLUGINS": "vllm"}, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert posted(tmp_path) == [{"step": r["step"], "algorithm": "grpo", "reward": r["reward"]} for r in rows]
    assert [r["step"] for r in rows] == [1, 2]


def test_a_plugin_file_replaces_an_installed_algorithm_for_the_run(rlcore_cli, tmp_path):
    (tmp_path / "steeper.py").write_text(STEEPER)
    done = rlcore_cli("run", "--plugin", "./steeper.py", "steps=60", "lr=0.3", "output_dir=out")
    assert done.returncode == 0, done.stderr
    line = ("rlcore: algorithm 'example' from ./steeper.py (Steeper) replaces the one of plugin 'example' "
            "(rlcore-example-plugin) for this run\n")
    assert line in done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["algorithm"] == "example" and summary["w"] == pytest.approx(5.0, abs=0.15)  # the subclass ran
    plain = rlcore_cli("run", "--plugin", "example", "steps=60", "lr=0.3", "output_dir=plain")
    assert json.loads(plain.stdout.splitlines()[-1])["w"] == pytest.approx(2.0, abs=0.1)
    assert "replaces" not in plain.stderr


def test_several_plugins_one_of_which_provides_the_algorithm(rlcore_cli, tmp_path):
    (tmp_path / "hooks.py").write_text(HOOKS)
    (tmp_path / "steeper.py").write_text(STEEPER)
    done = rlcore_cli("run", "--plugin", "./hooks.py", "--plugin", "example", "steps=3", "output_dir=out")
    assert done.returncode == 0, done.stderr
    assert [p["step"] for p in posted(tmp_path)] == [1, 2, 3]
    # the same algorithm named twice is one algorithm: the file's, which replaced the installed one
    twice = rlcore_cli("run", "--plugin", "example", "--plugin", "./steeper.py", "steps=60", "lr=0.3", "output_dir=o2")
    assert twice.returncode == 0 and json.loads(twice.stdout.splitlines()[-1])["w"] == pytest.approx(5.0, abs=0.15)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--plugin", "./hooks.py"], ["no plugin given with --plugin provides an algorithm: ./hooks.py "
                                      "(hooks: rlcore_step_end)", "--with ./hooks.py"]),
        (["--plugin", "example", "--plugin", "interrupted"], [
            "exactly one plugin given with --plugin may provide the algorithm, but 2 do: example (algorithm "
            "'example'); interrupted (algorithm 'interrupted')", "--with"]),
        (["--plugin", "example", "--with", "./nowhere.py"], ["plugin file './nowhere.py' does not exist"]),
        (["--plugin", "example", "--with", "observr"], ["--with observr: no plugin is called 'observr'",
                                                       "Did you mean 'observer'?"]),
        (["--with", "./hooks.py"], ["--plugin"]),
    ],
    ids=["hook-only", "two-algorithms", "missing-file", "unknown-with", "no-plugin"],
)
def test_plugin_selection_errors_exit_2(observed, tmp_path, args, needles):
    (tmp_path / "hooks.py").write_text(HOOKS)
    done = observed("run", *args, "steps=2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in done.stderr


def test_rlcore_plugins_loads_files_and_modules_for_every_run(rlcore_cli, tmp_path):
    (tmp_path / "hooks.py").write_text(HOOKS)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "steeper.py").write_text(STEEPER)
    env = {"RLCORE_PLUGINS": os.pathsep.join(["hooks.py", "pkg.steeper"]), "PYTHONPATH": str(tmp_path)}
    done = rlcore_cli("run", "--plugin", "example", "steps=60", "lr=0.3", "output_dir=out", env=env)
    assert done.returncode == 0, done.stderr
    assert "algorithm 'example' from pkg.steeper (Steeper) replaces" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["w"] == pytest.approx(5.0, abs=0.15)
    assert len(posted(tmp_path)) == 60
    listed = {p["name"]: p for p in json.loads(rlcore_cli("plugins", "--json", env=env).stdout)}
    assert listed["pkg.steeper"]["provides"] == {"algorithms": ["example"]} and "hooks" in listed


def test_config_show_and_validate_take_the_same_plugin_options(rlcore_cli, tmp_path):
    (tmp_path / "hooks.py").write_text(HOOKS)
    (tmp_path / "steeper.py").write_text(STEEPER)
    (tmp_path / "c.yaml").write_text("steps: 3\n")
    shown = rlcore_cli("config", "show", "--plugin", "./steeper.py", "--with", "./hooks.py", "lr=0.25")
    assert shown.returncode == 0 and "lr: 0.25" in shown.stdout and "replaces" in shown.stderr
    valid = rlcore_cli("config", "validate", "--plugin", "example", "--with", "./hooks.py", "--config", "c.yaml")
    assert valid.returncode == 0 and "valid for algorithm 'example'" in valid.stdout
    misspelled = rlcore_cli("config", "validate", "--with=./hooks.py", "--plugin=example", "--config", "c.yaml",
                            "--dispatch", "reverse_slcie")
    assert_usage_error(misspelled, "dispatch: dispatch 'reverse_slcie' is not registered",
                       "Did you mean 'reverse_slice'?")


def test_run_plan_show_validate_and_help_read_the_demo_preset_and_name_no_internal_path(capsys):
    """One story: with neither --config nor a model, every command reads what a bare `rlcore run` runs."""
    from rlcore.cli import main

    assert main(["config", "validate", "--plugin", "grpo"]) == 0  # no --config needed
    assert capsys.readouterr().out.strip() == "the grpo demo preset: valid for algorithm 'grpo'"
    assert main(["config", "show", "--plugin", "grpo"]) == 0
    shown, err = capsys.readouterr()
    assert "the grpo demo preset: what `rlcore run --plugin grpo` uses without --config or a model" in err
    assert "\nmodel: tiny\n" in shown and "\noutput_dir: output/grpo-demo\n" in shown
    assert main(["plan", "--plugin", "grpo"]) == 0
    assert "nothing to plan: the demo's tiny model runs on the CPU" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--plugin", "grpo", "--help"])
    assert "\n  model = tiny  " in capsys.readouterr().out
    assert main(["run", "--plugin", "grpo", "num_generaton=16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcore: error: invalid configuration in the grpo demo preset with the command line's keys")
    assert "demo.yaml" not in err and "Did you mean 'num_generations'?" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_gpus_asked_on_a_machine_without_one_name_the_key_that_asked_them(tmp_path, capsys):
    from rlcore.cli import main

    assert main(["run", "--plugin", "grpo", "train.gpus=1", f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[1].startswith("  train.gpus: puts the train role on GPUs, and without --use-ray it runs "
                                          "in this process, which sees no CUDA device")
    assert "device='cpu'" not in err and not (tmp_path / "out").exists()  # refused before anything was built
