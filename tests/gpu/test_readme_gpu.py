"""The README's GPU commands (the blocks after `<!-- gpu -->`, which tests/core/test_readme.py lists and does not
run) on one GPU: `rlcore plan` then `rlcore run --use-ray` exactly as written, with the hub model and the dataset `D`
replaced by local ones (the GPU machine has no network) and the example scaled to one GPU and two short steps.
The plan must be sized in full and fit (`[ok]`, no `UNKNOWN`), and the run must train its two steps."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from test_grpo_cli import dataset, model_dir  # noqa: F401 - the fixtures: Qwen2-0.5B's shape, 4 layers; sums

ROOT = Path(__file__).resolve().parents[2]
ONE_GPU = ["train.gpus=1", "rollout.gpus=1", "max_steps=2", "max_completion_length=64", "save_steps=0"]


def gpu_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- gpu -->\n```bash\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [argv for argv in (shlex.split(line, comments=True) for line in lines) if argv[:1] == ["rlcore"]]


def test_the_readme_s_gpu_commands_plan_and_run_on_one_gpu(tmp_path, model_dir, dataset):  # noqa: F811
    commands = gpu_commands()
    assert [argv[1] for argv in commands] == ["plan", "run"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    for argv in commands:
        local = [f"model={model_dir}" if a.startswith("model=") else f"dataset={dataset}" if a == "dataset=D" else a
                 for a in argv[1:]]
        done = subprocess.run([sys.executable, "-m", "rlcore", *local, *ONE_GPU, f"output_dir={tmp_path / 'out'}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"README: {shlex.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if argv[1] == "plan":
            assert "[ok]" in done.stdout and "UNKNOWN" not in done.stdout, done.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (tmp_path / "out" / "final").is_dir()
