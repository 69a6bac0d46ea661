"""Dispatch overhead: rlcore's @function calls against raw Ray calls, on 4 CPU actors.

(a) a small-payload group call (dispatch `all`, collect `none`) against `ray.get([a.f.remote(x) ...])`;
(b) a 64 MB torch tensor sent to 4 actors with dispatch `all` against passing it to each actor's call.
Measurements alternate (ours, raw, ours, ...) so that noise hits both. Prints a table; `--json PATH`
writes `small_call_ratio` (ours / raw, medians) and `broadcast_ratio` (ours / naive, medians), with the commit
measured and the machine's CPUs and load (other processes slow both sides, the hand-overs between threads most).
An A/B of rlcore's own change runs it once per version, alternating (`PYTHONPATH` to the other version's tree,
`--commit` naming it).

    python benchmarks/dispatch.py --json benchmarks/results/dispatch-YYYY-MM-DD.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import ray
import torch

from rlcore import function, worker
from rlcore.runtime import cluster, workers
from rlcore.specs import Slot

WORKERS = 4


@worker(group="bench")
class Bench:
    @function(group="bench")
    def echo(self, x):
        return x

    @function(group="bench")
    def first_value(self, tensor):
        return float(tensor[0])


class RawBench:
    def echo(self, x):
        return x

    def first_value(self, tensor):
        return float(tensor[0])


def timed(fn, repeat: int) -> float:
    """Seconds per call of `fn`, over `repeat` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def measure(ours, raw, rounds: int, repeat: int) -> tuple[list[float], list[float]]:
    ours_t, raw_t = [], []
    for i in range(rounds):
        pair = ((ours, ours_t), (raw, raw_t)) if i % 2 == 0 else ((raw, raw_t), (ours, ours_t))
        for fn, out in pair:
            out.append(timed(fn, repeat))
    return ours_t, raw_t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--rounds", type=int, default=120, help="alternating rounds of small calls")
    parser.add_argument("--repeat", type=int, default=5, help="calls per round")
    parser.add_argument("--broadcast-rounds", type=int, default=12)
    parser.add_argument("--commit", help="the rlcore commit measured (default: this checkout's HEAD)")
    opts = parser.parse_args()
    commit = opts.commit or subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                                           capture_output=True, text=True).stdout.strip()

    cluster.init(num_cpus=2 * WORKERS, num_gpus=0)
    slots = {"bench": [Slot("bench", i, WORKERS, 0, None, 0.0, 1.0) for i in range(WORKERS)]}
    raw_actors = [ray.remote(num_cpus=1)(RawBench).remote() for _ in range(WORKERS)]
    with workers.runtime(slots, use_ray=True):
        ours = Bench()
        x = {"step": 1, "prompt": "hello"}
        assert ours.echo(x) == [x] * WORKERS == ray.get([a.echo.remote(x) for a in raw_actors])
        small_ours, small_raw = measure(
            lambda: ours.echo(x), lambda: ray.get([a.echo.remote(x) for a in raw_actors]), 4, opts.repeat
        )  # warm-up
        small_ours, small_raw = measure(
            lambda: ours.echo(x), lambda: ray.get([a.echo.remote(x) for a in raw_actors]),
            opts.rounds, opts.repeat,
        )
        tensor = torch.arange(16 * 1024 * 1024, dtype=torch.float32)  # 64 MB
        assert ours.first_value(tensor) == [0.0] * WORKERS
        big_ours, big_raw = measure(
            lambda: ours.first_value(tensor),
            lambda: ray.get([a.first_value.remote(tensor) for a in raw_actors]),
            opts.broadcast_rounds, 1,
        )
    cluster.kill(raw_actors)
    cluster.shutdown()

    rows = [
        ("small call, 4 actors (ms)", small_ours, small_raw, "ray.get([a.f.remote(x) ...])"),
        ("64 MB tensor to 4 actors (ms)", big_ours, big_raw, "tensor passed per call"),
    ]
    result = {
        "small_call_ratio": statistics.median(small_ours) / statistics.median(small_raw),
        "broadcast_ratio": statistics.median(big_ours) / statistics.median(big_raw),
        "small_call_ms": {"ours": statistics.median(small_ours) * 1e3, "raw": statistics.median(small_raw) * 1e3,
                          "calls_each": opts.rounds * opts.repeat},
        "broadcast_ms": {"ours": statistics.median(big_ours) * 1e3, "naive": statistics.median(big_raw) * 1e3,
                         "calls_each": opts.broadcast_rounds},
        "targets": {"small_call_ratio": 1.15, "broadcast_ratio": 0.2},
        "commit": commit,
        "rounds_asked": opts.rounds,
        "environment": {"cpu_count": os.cpu_count(), "load_average_1_5_15min": list(os.getloadavg())},
    }
    print(f"{'measurement':32} {'rlcore':>10} {'baseline':>10} {'ratio':>7}  baseline is")
    for name, a, b, what in rows:
        ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        print(f"{name:32} {ma:10.3f} {mb:10.3f} {ma / mb:7.3f}  {what}")
    print("targets: small_call_ratio <= 1.15, broadcast_ratio <= 0.2")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
