import json

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


def test_plot_names_the_file_and_line_of_a_bad_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.1}\n{"step": 2, "rew\n{"step": 3, "reward": 0.3}\n')
    assert main(["plot", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path} line 2 is not a JSON object of metrics" in err[0]
