import json
import sys

import pytest

from rlcore import ConfigError
from rlcore.cli import main
from rlcore.plot import plot_metrics


@pytest.fixture
def metrics(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    rows = [{"step": s, "reward": 0.05 * s, "kl": None, "loss": 1.0 / s, "time/train": 0.1} for s in range(1, 11)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_writes_a_png_with_a_panel_per_metric(metrics, tmp_path, capsys):
    assert main(["plot", str(metrics), "--keys", "reward,loss", "-o", str(tmp_path / "curves.png")]) == 0
    png = tmp_path / "curves.png"
    assert capsys.readouterr().out.strip() == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    default = plot_metrics(metrics)  # reward, kl (all null: an empty panel), loss
    assert default == metrics.with_suffix(".png") and default.stat().st_size > 5000


def test_plot_names_unknown_metrics_and_missing_files(metrics, tmp_path):
    with pytest.raises(ConfigError, match=r"no metric 'rewrad'.*Did you mean 'reward'"):
        plot_metrics(metrics, ["rewrad"])
    with pytest.raises(ConfigError, match="does not exist"):
        plot_metrics(tmp_path / "nowhere.jsonl")
    assert main(["plot", str(tmp_path / "nowhere.jsonl")]) == 2


def test_plot_without_matplotlib_exits_2_as_every_missing_extra_does(metrics, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what Python does where it is not installed
    assert main(["plot", str(metrics)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlcore: error: rlcore plot needs the 'plot' extra")
    assert err[0].endswith("pip install 'rlcore[plot]'")


def test_plot_names_the_file_and_line_of_a_bad_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.1}\n{"step": 2, "rew\n{"step": 3, "reward": 0.3}\n')
    assert main(["plot", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path} line 2 is not a JSON object of metrics" in err[0]


def test_plot_takes_a_run_directory_and_draws_the_algorithms_panels(tmp_path):
    """`rlcore plot RUN_DIR` after a real run: the PNG beside its metrics, GRPO's panels (kl, null with the
    demo's beta 0, left out and named under the panels), integer step ticks."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}

    def rlcore(*args):
        return subprocess.run([sys.executable, "-m", "rlcore", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)

    assert rlcore("run", "--plugin", "grpo", "output_dir=out", "max_steps=3").returncode == 0
    done = rlcore("plot", "out")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "out/metrics.png"
    assert (tmp_path / "out" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = rlcore("plot", "elsewhere")
    assert missing.returncode == 2
    assert missing.stderr.splitlines()[0] == ("rlcore: error: plot: 'elsewhere' does not exist; pass a run's "
                                              "output_dir or its metrics.jsonl")

    from rlcore.plot import figure, metrics_file, run_note
    from rlcore.metrics import MetricsWriter

    path = metrics_file(tmp_path / "out")
    rows, keys = MetricsWriter(path).read(), run_note(path)["plot_keys"]
    assert run_note(path)["algorithm"] == "grpo" and keys[:2] == ["reward", "kl"]
    fig = figure(rows, keys, "grpo")
    assert [ax.get_ylabel() for ax in fig.axes][:2] == ["reward", "completions/mean_length"]  # no blank kl panel ...
    assert [t.get_text() for t in fig.texts] == ["grpo", "null at every step (not computed in this run), so not drawn: kl"]
    ticks = [t for t in fig.axes[-1].get_xticks() if 0.5 <= t <= 3.5]
    assert ticks == [1, 2, 3]  # whole steps only


def test_the_default_panels_are_the_algorithms_own_that_the_file_has(tmp_path):
    """GKD's note names eval/jsd, logged at a few steps only: it is a panel with a point per eval, the one before
    training (eval/jsd_start, in step 1's row) at step 0."""
    from rlcore.checkpoint import note_run
    from rlcore.plot import figure, plot_metrics

    run = tmp_path / "gkd-run"
    run.mkdir()
    rows = [{"step": s, "loss": 1 / s, "jsd": 0.5 / s, **({"eval/jsd": 0.4 / s} if s % 5 == 0 else {}),
             **({"eval/jsd_start": 0.6} if s == 1 else {})} for s in range(1, 21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    note_run(run, "finished", {"algorithm": "gkd", "plot_keys": ["loss", "eval/jsd", "jsd", "grad_norm"]})
    png = plot_metrics(run)
    assert png == run / "metrics.png"
    fig = figure(rows, ["loss", "eval/jsd", "jsd"], "gkd")
    assert [len(ax.lines[0].get_xdata()) for ax in fig.axes] == [20, 5, 20]
    assert list(fig.axes[1].lines[0].get_xdata())[:2] == [0, 5] and fig.axes[-1].get_xlim()[0] == -0.5
    from PIL import Image

    assert Image.open(png).size[1] == round(100 * (1.9 * 3 + 0.6))  # three panels: grad_norm, not logged, left out
    alike = [{**r, "jsd": r["loss"] + 1e-9} for r in rows]  # sft_alpha 0: the loss is the jsd, to float32's precision
    fig = figure(alike, ["loss", "eval/jsd", "jsd"], "gkd")
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "eval/jsd"]
    assert [t.get_text() for t in fig.texts] == ["gkd", "jsd: the same as loss at every step, so not drawn"]


def test_damaged_metrics_are_one_error_naming_the_file_and_line(tmp_path):
    from rlcore import RlcoreError
    from rlcore.plot import plot_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 1.0}\n{"step": 2, "loss": \xff}\n')
    with pytest.raises(RlcoreError, match=r"metrics.jsonl line 2 is not UTF-8 text \(byte 0xff\)"):
        plot_metrics(path)
    path.write_text('{"step": 1, "loss": 1.0}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(RlcoreError, match=r"metrics.jsonl line 2 is not a JSON object of metrics"):
        plot_metrics(path)


def test_a_png_target_of_the_wrong_kind_or_a_full_disk_is_one_line_and_leaves_no_torn_file(metrics, tmp_path):
    """-o a folder, a FIFO, or under a file; the run's folder given as a FIFO: one line naming it. A full disk (a
    file size limit, in a child process) ended in PIL's traceback: one line, exit 1, no partial PNG."""
    import os
    import subprocess
    import sys

    (tmp_path / "a-dir").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    (tmp_path / "a-file").write_text("notes\n")
    for out, said in [("a-dir", "-o .*a-dir: is a folder"), ("a-fifo", "-o .*a-fifo: is a FIFO"),
                      ("a-file/x.png", "its folder .*a-file is a file, not a folder")]:
        with pytest.raises(ConfigError, match=said):
            plot_metrics(metrics, out=tmp_path / out)
    with pytest.raises(ConfigError, match="a-fifo' is a FIFO"):
        plot_metrics(tmp_path / "a-fifo")
    full = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.RLIM_INFINITY)); "
            "from rlcore.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", full, "plot", str(metrics), "-o", str(tmp_path / "c.png")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.startswith("rlcore: error:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert errors == [f"rlcore: error: plot: cannot write {tmp_path / 'c.png'}: File too large; free some space, or "
                      "give -o elsewhere"], done.stderr
    assert not list(tmp_path.glob("*c.png*"))  # no torn PNG, no temporary one
