"""benchmarks/memory_measure.py's NVML sampler on a real GPU: a process holding 2 GiB shows up under its own pid, with
its parents, so `benchmarks/memory_plan.py` can name each process's role (it fails here where NVML reports pids of
another pid namespace, and the benchmark's per-role figures would be per pid only). The attribution of samples to
phases and roles is tests/benchmarks/test_memory_measure.py's.

Runs only on the GPU machine: `pytest -m gpu tests/gpu/test_memory_sampler_gpu.py`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
HOLD = """
import pathlib, sys, time
import torch
held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
pathlib.Path(sys.argv[1]).write_text("held")
time.sleep(120)
"""


def test_the_sampler_sees_a_process_by_its_pid_and_parents(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        measure, plan = importlib.import_module("memory_measure"), importlib.import_module("memory_plan")
    finally:
        sys.path.remove(str(BENCHMARKS))
    gpus, _, _ = plan.gpu_of_host()
    samples, ready = tmp_path / "nvml.jsonl", tmp_path / "ready"
    sampler = subprocess.Popen([sys.executable, "-c", measure.SAMPLER, str(samples), str(gpus[0])])
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ready)])
    try:
        deadline = time.time() + 120
        while not ready.exists() and holder.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the process holding 2 GiB on the GPU did not start"
        time.sleep(1.0)  # about 50 samples
        assert sampler.poll() is None, "the NVML sampler exited early (its error is above)"
    finally:
        holder.terminate()
        holder.wait()
        sampler.terminate()
        sampler.wait()
    rows, parents = measure.read_samples(samples)
    seen = max((row["pids"].get(holder.pid) or 0 for row in rows), default=0)
    listed = sorted({pid for row in rows for pid in row["pids"]})
    assert seen >= 2 << 30, f"NVML listed pids {listed}, not the holder's {holder.pid} with 2 GiB: another pid namespace?"
    assert os.getpid() in parents[holder.pid]
    probe = {"driver": 1, "roles": {"train": [os.getpid()]}}  # the holder is a child of a 'train' worker here
    assert measure.roles_of(probe, {holder.pid}, parents) == {holder.pid: "train"}
