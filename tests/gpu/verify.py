"""`bash tests/gpu/run.sh verify 1` then `verify 2`: every GPU test and the smoke on one GPU machine, in two
commands of at most 9 minutes each, the session's GPU proof.

    source .gpu/stage/install.sh && bash tests/gpu/run.sh verify 1     # the first half, about 8.5 minutes
    bash tests/gpu/run.sh verify 2                                     # the rest, on the same machine
    python3 tests/gpu/verify.py merge DIR1 DIR2                         # here: one JSON into benchmarks/results/

Each entry is one pytest process (a module whose tests share an engine, or one test: one process holds one
in-process vLLM) or the smoke, with a timeout of its own. Entries run side by side in lanes on the one GPU, the
longest first; every vLLM engine they start takes a fixed KV cache (tests/gpu/verify_site), so none sizes its cache
from memory another entry holds. An entry that measures the device's free memory runs alone. A part stops starting
entries when its time is spent; part 2 runs what part 1 left (it reads part 1's state from /tmp, which lasts while
the machine is held), then its own half.

Writes as it goes, under $OUT (or --out): verify-N.log (one PASS/FAIL/SKIP line a test, and a failure's last lines),
verify-N.json (every test's outcome and seconds, rewritten after each entry) and, at the end, logs-N.tgz (each
entry's whole pytest log and junit XML).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"
STATE = Path(tempfile.gettempdir()) / "rlcore-verify"
PART_S = 510  # a part's time: 8.5 minutes, inside the device tool's 9 minutes a call
LANES = 8  # units of the GPU machine (16 cores, tiny models: the CPU and the starts are the cost) that entries share
KV_CACHE_BYTES = 1 << 30
SHARED = {  # modules whose tests share a module-scoped engine or model: one process each; estimated seconds
    "test_vllm_engine.py": 120, "test_hf_cuda.py": 90, "test_hf_packing_gpu.py": 90, "test_weight_replay_gpu.py": 90,
    "test_weight_sync_gpu.py": 60, "test_dtype_gpu.py": 120, "test_memory_gpu.py": 150, "test_megatron_gpu.py": 300,
}
SHARED_FUNCTIONS = {  # a test function whose cases start no vLLM: one process for all its cases
    "test_each_architecture_builds_what_the_mapping_names_and_equals_transformers": 150,
}
ALONE = {"test_vllm_engine.py"}  # reads the device's free memory: nothing else runs meanwhile, no fixed KV cache
PER_TEST_S = {"test_megatron_archs_gpu.py": 150, "test_megatron_cli.py": 180, "test_grpo_teacher_gpu.py": 180,
              "test_multi_turn_gpu.py": 180}
LEARNING_S = 450  # the learning check: seven runs of 24 steps side by side (three lanes' worth)
DEFAULT_TEST_S = 120
SMOKE_S = 450  # its own three lanes: three units; 11 rows took over 356 s on an H200 (gpu-verify-2026-12-04)
START_S, MARGIN = 15.0, 1.1  # a measured entry's estimate: a process's start (imports, CUDA) + 1.1 x its tests' seconds


@dataclass
class Entry:
    name: str  # a file name: the test id with its odd characters made `_`
    args: list[str]  # pytest's arguments, or the smoke's
    estimate: float
    smoke: bool = False
    alone: bool = False
    outcome: dict = field(default_factory=dict)

    @property
    def weight(self) -> int:
        return LANES if self.alone else 3 if self.smoke or "learn" in self.name else 1

    @property
    def timeout(self) -> float:
        return max(2.0 * self.estimate, 240.0)


def safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text.replace("tests/gpu/", ""))[:150]


def collect() -> list[str]:
    """Every GPU test's id, as pytest collects them (a module that fails to import is an error entry)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "--collect-only", "-p", "no:cacheprovider",
                           str(GPU)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and line.startswith("tests/gpu/")]
    if not ids:
        raise SystemExit(f"verify: pytest collected no GPU test:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return ids


def measured(results: Path | None = None) -> dict[str, float]:
    """Each GPU test's seconds in the newest verify record (benchmarks/results/gpu-verify-*.json), as it ran beside
    the others: passed, failed or skipped; a timeout or an error says nothing about how long the test takes."""
    records = sorted((results or ROOT / "benchmarks" / "results").glob("gpu-verify-*.json"))
    if not records:
        return {}
    tests = json.loads(records[-1].read_text()).get("tests", [])
    return {t["test"]: float(t["seconds"]) for t in tests if t.get("outcome") in ("passed", "failed", "skipped") and t.get("test")}


def estimate(tests: list[str], known: dict[str, float], default: float) -> float:
    """An entry's seconds: what its tests took in the last record, with the process's start and some margin, where
    every one of them has a figure; else `default`."""
    if tests and all(t in known for t in tests):
        return round(START_S + MARGIN * sum(known[t] for t in tests), 1)
    return default


def entries(ids: list[str], known: dict[str, float] | None = None) -> list[Entry]:
    """The smoke, one entry per shared module, one per other test; the longest first. Estimates come from `known`
    (test id -> seconds, `measured()`) where it has every test of an entry."""
    known = {} if known is None else known
    out = [Entry("smoke", [], SMOKE_S, smoke=True)]
    members: dict[str, list[str]] = {}
    for test in ids:
        module = test.split("::")[0].rsplit("/", 1)[-1]
        function = test.split("::")[1].split("[")[0]
        key = module if module in SHARED else test.split("[")[0] if function in SHARED_FUNCTIONS else test
        members.setdefault(key, []).append(test)
    for key, tests in members.items():
        module = key.split("::")[0].rsplit("/", 1)[-1]
        if module in SHARED and "::" not in key:
            default = SHARED[module]
            out.append(Entry(safe(module), [f"tests/gpu/{module}"], estimate(tests, known, default), alone=module in ALONE))
        elif key.split("::")[1] in SHARED_FUNCTIONS:
            out.append(Entry(safe(key), [key], estimate(tests, known, SHARED_FUNCTIONS[key.split("::")[1]])))
        else:
            default = LEARNING_S if "learn" in key else PER_TEST_S.get(module, DEFAULT_TEST_S)
            out.append(Entry(safe(key), [key], estimate(tests, known, default)))
    return sorted(out, key=lambda e: (not e.alone, -e.estimate, e.name))


def halves(all_entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """Two parts of about equal lane-seconds: the entries that run alone in part 1; the smoke (its rows run one after
    another, about 400 s: only part 2's time holds it) and the learning check in part 2; the rest where the load is
    less."""
    parts: tuple[list[Entry], list[Entry]] = ([], [])
    load = [0.0, 0.0]
    for entry in all_entries:
        i = 0 if entry.alone else 1 if entry.smoke or entry.weight > 1 else int(load[1] < load[0])
        parts[i].append(entry)
        load[i] += entry.estimate * entry.weight
    return parts


def junit_outcomes(xml: Path) -> list[dict]:
    """One record per test case of a junit XML: id, outcome, seconds, message."""
    if not xml.is_file():
        return []
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test = f"{classname.replace('.', '/')}.py::{name}" if classname else name
        outcome, message = "passed", ""
        for tag, label in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = label, (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
                break
        rows.append({"test": test, "outcome": outcome, "seconds": round(float(case.get("time", 0)), 1),
                     "message": message})
    return rows


class Runner:
    def __init__(self, out: Path, part: int, deadline: float):
        self.out, self.part, self.deadline = out, part, deadline
        self.logs = Path(tempfile.mkdtemp(prefix=f"rlcore-verify-{part}-"))
        self.free = LANES
        self.cond = threading.Condition()
        self.results: list[Entry] = []
        self.lines = open(out / f"verify-{part}.log", "a", buffering=1)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0"}

    def say(self, text: str) -> None:
        with self.cond:
            print(text, flush=True)
            self.lines.write(text + "\n")

    def run(self, entry: Entry) -> None:
        log, xml = self.logs / f"{entry.name}.log", self.logs / f"{entry.name}.xml"
        left = self.deadline - time.monotonic()
        timeout = min(entry.timeout, left - 5)
        env = dict(self.env)
        # a temp folder of the entry's own: tests build their models under tempfile.gettempdir(), and two entries
        # building one folder side by side would replace it under each other (short: Ray's sockets live below it)
        env["TMPDIR"] = tempfile.mkdtemp(prefix="v", dir="/tmp")
        if not entry.alone:
            env["PYTHONPATH"] = f"{GPU / 'verify_site'}{os.pathsep}{env.get('PYTHONPATH', '')}"
            env["RLCORE_VERIFY_KV_CACHE_BYTES"] = str(KV_CACHE_BYTES)
        if entry.smoke:
            cmd = [sys.executable, str(GPU / "smoke.py"), "--out", str(self.logs / "smoke")]
        else:
            cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-rA", "-p", "no:cacheprovider", f"--junitxml={xml}",
                   "-o", "junit_family=xunit1", *entry.args]
        start = time.monotonic()
        with open(log, "w") as handle:
            handle.write(f"$ {' '.join(cmd)}\n")
            handle.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=max(timeout, 1))
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                code, timed_out = -9, True
        seconds = round(time.monotonic() - start, 1)
        if entry.smoke:
            tests = smoke_outcomes(self.logs / "smoke" / "summary.json")
        else:
            tests = junit_outcomes(xml)
        if timed_out:
            tests.append({"test": " ".join(entry.args) or "smoke", "outcome": "timeout",
                          "seconds": seconds, "message": f"killed after {timeout:.0f} s"})
        elif not tests or (code not in (0, 5) and not any(t["outcome"] in ("failed", "error") for t in tests)):
            tests.append({"test": " ".join(entry.args) or "smoke", "outcome": "error", "seconds": seconds,
                          "message": f"exit {code}: " + tail(log, 3).replace("\n", " | ")})
        entry.outcome = {"entry": entry.name, "exit": code, "seconds": seconds, "tests": tests}
        for t in tests:
            mark = {"passed": "PASS", "skipped": "SKIP"}.get(t["outcome"], "FAIL")
            self.say(f"{mark} {t['seconds']:6.1f}s  {t['test']}" + (f"  -- {t['message']}" if mark != "PASS" and t["message"] else ""))
        if any(t["outcome"] not in ("passed", "skipped") for t in tests):
            self.say(tail(log, 15, prefix="    | "))

    def lane(self, queue: list[Entry]) -> None:
        while True:
            with self.cond:
                while True:
                    if not queue:
                        return
                    entry = queue[0]
                    left = self.deadline - time.monotonic()
                    # too little time left to run it: the next part takes it (the smoke, which is not cut in rows, whole)
                    if left < (1.0 if entry.smoke else 0.6) * entry.estimate:
                        return
                    if self.free >= entry.weight:
                        queue.pop(0)
                        self.free -= entry.weight
                        break
                    self.cond.wait(5)
            try:
                self.run(entry)
            except Exception as exc:  # noqa: BLE001 - a broken entry is its own failure, not the part's
                entry.outcome = {"entry": entry.name, "exit": None, "seconds": 0,
                                 "tests": [{"test": entry.name, "outcome": "error", "seconds": 0, "message": repr(exc)}]}
                self.say(f"FAIL {0:6.1f}s  {entry.name}  -- {exc!r}")
            with self.cond:
                self.free += entry.weight
                self.results.append(entry)
                self.cond.notify_all()
            self.write_json(queue)

    def write_json(self, queue: list[Entry]) -> None:
        with self.cond:
            record = {"part": self.part, "entries": [e.outcome for e in self.results], "left": [e.name for e in queue]}
            (self.out / f"verify-{self.part}.json").write_text(json.dumps(record, indent=1) + "\n")


def smoke_outcomes(summary: Path) -> list[dict]:
    if not summary.is_file():
        return []
    data = json.loads(summary.read_text())
    return [{"test": f"smoke::{row['name']}", "outcome": "passed" if row["status"] == "PASS" else "failed",
             "seconds": row["seconds"], "message": row["detail"][:300]} for row in data["rows"]]


def tail(path: Path, n: int, prefix: str = "") -> str:
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(prefix + line[:240] for line in lines[-n:])


def run_part(part: int, out: Path, seconds: float) -> int:
    began = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    all_entries = entries(collect(), measured())
    by_name = {e.name: e for e in all_entries}
    first, second = halves(all_entries)
    queue = first
    if part == 2:
        earlier = STATE / "part1.json"
        left = json.loads(earlier.read_text())["left"] if earlier.is_file() else [e.name for e in first]
        queue = [by_name[name] for name in left if name in by_name] + second
        if not earlier.is_file():
            print("verify: no part 1 state on this machine (it was given back?): part 2 runs part 1's entries too")
    queue.sort(key=lambda e: (not e.alone, not e.smoke, -e.estimate, e.name))
    runner = Runner(out, part, began + seconds)
    runner.say(f"verify {part}: {len(queue)} entries, {seconds:.0f} s, {LANES} lanes; logs in {runner.logs}")
    threads = [threading.Thread(target=runner.lane, args=(queue,), daemon=True) for _ in range(LANES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    runner.write_json(queue)
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / f"part{part}.json").write_text((out / f"verify-{part}.json").read_text())
    with tarfile.open(out / f"logs-{part}.tgz", "w:gz") as tar:
        tar.add(runner.logs, arcname=f"verify-{part}")
    tests = [t for e in runner.results for t in e.outcome["tests"]]
    bad = [t for t in tests if t["outcome"] not in ("passed", "skipped")]
    runner.say(f"verify {part}: {sum(t['outcome'] == 'passed' for t in tests)} passed, "
               f"{sum(t['outcome'] == 'skipped' for t in tests)} skipped, {len(bad)} failed, "
               f"{len(queue)} entries not started, {time.monotonic() - began:.0f} s")
    return 1 if bad or queue else 0


def merge(dirs: list[Path], kind: str, commit: str) -> Path:
    """The parts' JSONs as one record in benchmarks/results/gpu-verify-<date>-<kind>.json."""
    parts = [json.loads(p.read_text()) for d in dirs for p in sorted(d.glob("verify-*.json"))]
    tests = [t for p in parts for e in p["entries"] for t in e["tests"]]
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "skipped", "failed", "error", "timeout")}
    record = {"what": "bash tests/gpu/run.sh verify 1 and 2: every GPU test and the smoke on one machine",
              "device": kind, "date": datetime.date.today().isoformat(), "commit": commit, "counts": counts,
              "not_started": [n for n in (parts[-1]["left"] if parts else [])],
              "tests": sorted(tests, key=lambda t: t["test"])}
    path = ROOT / "benchmarks" / "results" / f"gpu-verify-{record['date']}-{kind}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash tests/gpu/run.sh verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("part", help="1 or 2 (on the GPU machine), or `merge` (here, with the parts' folders)")
    parser.add_argument("dirs", nargs="*", type=Path, help="with merge: the folders the parts wrote")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "verify-out"))
    parser.add_argument("--seconds", type=float, default=PART_S, help="this part's time")
    parser.add_argument("--kind", default="nvidia-h200", help="with merge: the machine's kind")
    parser.add_argument("--commit", default="", help="with merge: the commit that ran")
    args = parser.parse_args(argv)
    if args.part == "merge":
        print(merge(args.dirs, args.kind, args.commit))
        return 0
    if args.part not in ("1", "2"):
        parser.error("part must be 1, 2 or merge")
    return run_part(int(args.part), args.out, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
