"""Every demo resumes from the CLI as the docs say: `rlcore run --plugin NAME`, stopped by SIGINT (Ctrl-C), SIGTERM (a
scheduler) or kill -9 once its first step is saved, then `rlcore run --plugin NAME --resume` ends with every step
once and the run's whole output; `--resume` of a finished run says it is finished and exits 0.

CI runs one case (sample after SIGINT: its output file's state, the bug this test was written for; the suite's 20
minutes hold no more); `pytest -m resume_matrix tests/reliability/test_demo_resume.py` runs the other seventeen,
each a minute or two on two cores. The stop itself is one code path for every algorithm (`rlcore.signals`); what differs
per demo is what its checkpoint or its output file holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.data import load_rows
from rlcore.plugins.sampling.trainer import row_id, shard
from rlcore.testing import tiny_dataset

STEPS = 3
SMALL = [f"max_steps={STEPS}", "save_steps=1"]
SAMPLED = ["batch_size=2"]  # the preset's 8 prompts in 4 batches, each committed to the output
DEMOS = {  # the demo's keys (the preset's, made short), the signal CI stops it with (or none), whether a finish is checked
    "grpo": (SMALL, None, True),
    "gkd": (SMALL, None, False),
    "sft": (SMALL, None, True),
    "pt": (SMALL, None, False),
    "sample": (SAMPLED, signal.SIGINT, True),
    # distill has no preset: a local teacher (the tiny model) writes the answers; with api_base an endpoint would
    "distill": (SAMPLED + ["model=tiny", "dataset=tiny:toy", "data_range=[0,32]", "max_prompt_length=512",
                           "max_new_tokens=16"], None, True),
}
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}


def cases() -> list:
    out = []
    for demo, (_, ci, _) in DEMOS.items():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            marks = () if sig == ci else (pytest.mark.resume_matrix,)
            out.append(pytest.param(demo, sig, marks=marks, id=f"{demo}-{sig.name}"))
    return out


def rlcore(cwd: Path, demo: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlcore", "run", "--plugin", demo, *DEMOS[demo][0], "output_dir=out", *extra]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}


def saved_a_step(out: Path) -> bool:
    """A checkpoint holds step 1 or later, or the sampler's output committed a batch."""
    if any((p / "trainer_state.json").is_file() for p in out.glob("checkpoint-*")):
        return True
    try:
        return json.loads((out / ".samples.jsonl.state.json").read_text())["batches"] >= 1
    except (OSError, ValueError, KeyError):
        return False


def stopped(tmp_path: Path, demo: str, sig: signal.Signals) -> str:
    """The demo run, sent `sig` once its first step is saved; its stderr."""
    proc = subprocess.Popen(rlcore(tmp_path, demo), cwd=tmp_path, env=env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not saved_a_step(tmp_path / "out"):
            assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before a step was saved"
            assert time.monotonic() < deadline, "no step saved within 300 s"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT[sig], err[-3000:]
    if sig != signal.SIGKILL:
        assert f"rlcore: stopped by {sig.name}" in err and "(continue with --resume)" in err, err[-3000:]
    return err


@pytest.mark.parametrize("demo, sig", cases())
def test_a_demo_stopped_by_a_signal_resumes_from_the_cli(tmp_path, demo, sig):
    stopped(tmp_path, demo, sig)
    resumed = subprocess.run(rlcore(tmp_path, demo, "--resume"), cwd=tmp_path, env=env(), capture_output=True,
                             text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = tmp_path / "out"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    if demo in ("sample", "distill"):
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        prompts = shard(load_rows(tiny_dataset("tiny:toy", seed=42)), 0, 32)[1]  # the preset's shard of tiny:toy
        assert steps == [1, 2, 3, 4] and [r["id"] for r in rows] == [row_id(r) for r in prompts]
        assert not (out / ".samples.jsonl.partial").exists()
    else:
        assert steps == list(range(1, STEPS + 1))
        assert (out / f"checkpoint-{STEPS}").is_dir() and (out / "final").is_dir()
    if not DEMOS[demo][2]:
        return
    again = subprocess.run(rlcore(tmp_path, demo, "--resume"), cwd=tmp_path, env=env(), capture_output=True, text=True,
                           timeout=300, stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stderr[-3000:]
    sampled = demo in ("sample", "distill")
    said = "is already complete; nothing to resume" if sampled else f"is finished: it trained {STEPS} steps"
    assert said in again.stderr, again.stderr[-3000:]
