"""GRPO from the command line, as a user runs it: `rlcore run --plugin ... --use-ray --config EXAMPLE key=value`
in a subprocess, for the four example layouts scaled down to two GPUs (nvidia-h200-x2):

- colocate.yaml: train and rollout share GPUs 0 and 1 (vLLM sleeps, the policy offloads), CUDA IPC sync;
- separate.yaml: train on GPU 0, rollout on GPU 1, NCCL broadcast, async generation (one step off-policy);
- colocate_device_groups.yaml and separate_device_groups.yaml: the same two in ms-swift's device_groups form.

Each run must exit 0 after 6 steps, write them to metrics.jsonl, print its summary as the last JSON line on
stdout, and prove that trained weights reached the rollout engine. The proof comes from a plugin file
(`PROBE`, written next to the run and passed as `--plugin`): it registers the algorithm `grpo_probe` (GRPO
unchanged) and hooks that score a fixed sequence with the rollout engine after every weight sync. There the
rollout must agree with the train engine (check_weight_sync raises otherwise) and, over the run, move away
from its initial log-probs by more than that check tolerates.

The model is Qwen2-0.5B's shape (as benchmarks/grpo_gpu.py builds it) with 4 layers instead of 24, random
bf16 weights, built offline; the data is a small JSONL of sums. Rewards: `toy` (its vowel fraction gives
every group a spread, so the policy gets gradients from a random model) and `format`.
tests/gpu/run.sh runs each layout in a pytest process of its own: `bash tests/gpu/run.sh cli`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ray" / "grpo"
STEPS = 6
LEARNING_RATE = 5e-3  # large enough that a few steps move the rollout's log-probs visibly
TIMEOUT_S = 420  # per run; a hang fails with the run's output instead of stalling the suite
# Qwen2-0.5B: hidden 896, 14 heads, 2 KV heads, MLP 4864 (vocabulary 32000 as in the GPU benchmark), 4 layers.
SHAPE = dict(hidden_size=896, num_layers=4, num_heads=14, num_kv_heads=2, intermediate_size=4864,
             vocab_size=32000, max_position_embeddings=2048, dtype="bfloat16")

COLOCATED = ["train: 2 workers, GPU 0-1 (shared with rollout), engine hf, bfloat16",  # dtype auto: the checkpoint's
             "rollout: 2 workers, GPU 0-1 (shared with train), engine vllm, bfloat16"]
SEPARATE = ["train: 1 worker, GPU 0, engine hf, bfloat16", "rollout: 1 worker, GPU 1, engine vllm, bfloat16"]


class Layout(NamedTuple):
    example: str  # under examples/ray/grpo
    scale: list[str]  # the overrides that fit it on two GPUs
    transport: str  # how weights must reach the rollout engine
    async_generate: bool
    placement: list[str]  # what `rlcore run` prints before the first step


LAYOUTS = {
    "colocate": Layout("colocate.yaml", ["train.gpus=2", "rollout.gpus=2"], "cuda_ipc", False, COLOCATED),
    "separate": Layout("separate.yaml", ["train.gpus=1", "rollout.gpus=1", "async_generate=true"], "nccl", True, SEPARATE),
    "colocate_device_groups": Layout(
        "colocate_device_groups.yaml", ["device_groups.nproc_per_node=2", "device_groups.policy_group.ranks=[0,1]"],
        "cuda_ipc", False, COLOCATED,
    ),
    "separate_device_groups": Layout(
        "separate_device_groups.yaml",
        ["device_groups.nproc_per_node=2", "device_groups.train_group.ranks=[0]", "device_groups.rollout_group.ranks=[1]",
         "async_generate=true"],
        "nccl", True, SEPARATE,
    ),
}

PROBE = textwrap.dedent('''
    """grpo_probe: GRPO unchanged, plus hooks that probe the weight sync and write {output_dir}/sync_probe.json."""

    import json
    from pathlib import Path

    from rlcore import AlgorithmSpec, hookimpl

    K = 4
    initial = []  # the rollout's sorted top-k log-probs after the first sync (the initial weights)
    record = {"transport": None, "initial_check": None, "syncs": []}


    @hookimpl
    def rlcore_algorithms():
        from rlcore.plugins.grpo.config import GRPOConfig
        from rlcore.plugins.grpo.trainer import GRPOTrainer

        yield AlgorithmSpec("grpo_probe", config=GRPOConfig, trainer=GRPOTrainer,
                            description="GRPO with a weight-sync probe (tests/gpu/test_grpo_cli.py)")


    def probe(trainer):
        """The train-vs-rollout check on the probe sequence, and the rollout's sorted top-k log-probs of it."""
        session, sequence = trainer.session, trainer.experience.probe_sequence()
        check = session.check_weight_sync("train", "rollout", sequence)  # raises on a mismatch; wakes the KV cache
        topk = session["rollout"].prompt_topk_logprobs([sequence], K).logprobs[0].float().cpu()  # [T, k]
        return float(check), topk.sort(dim=-1, descending=True).values


    def write(trainer):
        (Path(trainer.config.output_dir) / "sync_probe.json").write_text(json.dumps(record))


    @hookimpl
    def rlcore_train_start(trainer):
        record["transport"] = trainer.session.transports[("train", "rollout")]  # what the session chose at start
        record["initial_check"], topk = probe(trainer)
        initial.append(topk)
        write(trainer)


    @hookimpl
    def rlcore_step_end(trainer, step, metrics):
        if step < trainer.config.max_steps:  # every step but the last ends with a sync
            check, topk = probe(trainer)
            record["syncs"].append({"step": step, "check": check, "moved": float((topk - initial[0]).abs().max())})
            write(trainer)
''')


@pytest.fixture(scope="module")
def model_dir():
    from rlcore.testing import build_tiny_model

    # a fixed place, so the pytest processes of tests/gpu/run.sh build it once (same arguments: reused)
    return str(build_tiny_model(Path(tempfile.gettempdir()) / "rlcore-gpu-tests" / "qwen2-0.5b-shape-4l", **SHAPE))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "math.jsonl"
    rows = [{"prompt": f"What is {a} + {b}?", "solution": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def needs_gpus(n: int) -> None:
    import torch

    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs (nvidia-h200-x2); this machine has {torch.cuda.device_count()}")


def tails(stdout: str, stderr: str) -> str:
    return f"--- stdout (end) ---\n{stdout[-3000:]}\n--- stderr (end) ---\n{stderr[-6000:]}"


def rlcore_run(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """`rlcore run ARGS` (the console script's module, with this interpreter) -> exit code, stdout, stderr.

    The run gets a process group of its own, so a timeout ends it together with the Ray processes it started.
    """
    env = {**os.environ, "RLCORE_DEBUG": "1"}  # a failure prints its traceback
    cmd = [sys.executable, "-m", "rlcore", "run", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"`rlcore run` did not finish in {TIMEOUT_S} s: {' '.join(cmd)}\n{tails(out, err)}")
    return proc.returncode, out, err


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_from_the_cli(layout, model_dir, dataset, tmp_path):
    needs_gpus(2)
    spec = LAYOUTS[layout]
    probe_file = tmp_path / "grpo_probe.py"
    probe_file.write_text(PROBE)
    out = tmp_path / "run"
    overrides = [
        f"model={model_dir}", f"dataset={dataset}", f"output_dir={out}", f"max_steps={STEPS}",
        f"learning_rate={LEARNING_RATE}", "reward_funcs=[toy,format]", "num_generations=4",
        "per_device_train_batch_size=8", "max_completion_length=32",
        "train.dtype=bfloat16", "rollout.dtype=bfloat16", "rollout.vllm_gpu_memory_utilization=0.25",
        "rollout.vllm_enforce_eager=true", "rollout.vllm_max_model_len=512",
        *spec.scale,
    ]
    code, stdout, stderr = rlcore_run(
        ["--plugin", str(probe_file), "--use-ray", "--config", str(EXAMPLES / spec.example), *overrides], cwd=tmp_path
    )
    assert code == 0, f"rlcore run exited {code}\n{tails(stdout, stderr)}"
    for line in spec.placement:  # the roles' placement, printed to stderr before the first step
        assert f"rlcore: {line}" in stderr.splitlines(), f"no '{line}' in the placement printed:\n{stderr[:3000]}"

    # stdout ends with the summary, one JSON line (Ray may print worker lines before it)
    summaries = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"algorithm"')]
    assert summaries, f"no summary line on stdout:\n{stdout[-3000:]}"
    assert summaries[-1]["algorithm"] == "grpo_probe" and summaries[-1]["step"] == STEPS

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    synced = rows[:-1]  # the last step ends without a sync
    assert all(r["weight_sync/seconds"] > 0 and r["weight_sync/gb_per_s"] > 0 for r in synced)
    assert all(r["grad_norm"] > 0 and r["loss"] is not None for r in rows)  # gradients flowed; NaN is written as null
    assert all(0 < r["completions/mean_length"] <= 32 for r in rows)
    assert all(r["off_policy_steps"] == float(spec.async_generate) for r in rows)
    assert all("rewards/toy/mean" in r and "rewards/format/mean" in r for r in rows)
    assert (out / f"checkpoint-{STEPS}").is_dir()

    probe = json.loads((out / "sync_probe.json").read_text())
    assert probe["transport"] == spec.transport, f"{layout}: weights went by {probe['transport']}, not {spec.transport}"
    syncs = probe["syncs"]
    assert [s["step"] for s in syncs] == list(range(1, STEPS))
    assert probe["initial_check"] <= 0.5 and all(s["check"] <= 0.5 for s in syncs)  # check_weight_sync's atol
    # the rollout moved further from its initial log-probs than check_weight_sync tolerates, and still matched
    # the train engine after every sync: the trained weights arrived
    assert max(s["moved"] for s in syncs) > 0.5, f"the rollout's log-probs barely moved: {syncs}"
