"""What `memory_plan.py` measures of a run on Ray: each GPU's memory per process and per phase, each process named by
its role, beside the plan's prediction per role.

Two records meet here, both read from files the run leaves:
- the sampler (`SAMPLER`, a process beside the run, pynvml): every 20 ms one JSON line per GPU, `{"t", "gpu", "used",
  "pids": {pid: bytes}}` (the device's used memory and NVML's per-process figures, `usedGpuMemory`), and for a pid
  seen for the first time `{"t", "pid", "parents": [pid, ...]}` (its parent processes, so a child of a role's worker,
  vLLM's engine core when it runs apart, counts as that role);
- the probe (`PROBE`, a hook-only plugin loaded in the driver with --with): `{"driver": pid, "roles": {role: [pid per
  rank]}, "phases": [{"phase", "start", "end"}]}`: the trainer's phases as its timer sees them and the roles' worker
  pids from `RoleSession.processes()`. The probe touches no CUDA: the driver holds no GPU memory of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GiB = 1 << 30
# the trainers' timed phases -> the plan's: the train role's forward passes (GRPO's old log-probs, GKD's colocated
# teacher) are its training phase too
PHASES = {"generate": "generation", "score": "scoring", "train": "training", "logprobs": "training",
          "teacher": "training", "sync": "weight sync"}

# --with: the trainer's phases timed and the roles' worker pids written down (no CUDA in the driver)
PROBE = '''
import contextlib, json, os, time
from rlcore import hookimpl

OUT = {out!r}
RECORD = {{"driver": os.getpid(), "roles": {{}}, "phases": []}}


def write(trainer):
    session = getattr(trainer, "session", None)
    for role, pids in (session.processes() if session is not None and session.groups else {{}}).items():
        seen = RECORD["roles"].setdefault(role, [])
        seen += [pid for pid in pids if pid not in seen]  # a restarted worker's new pid too
    with open(OUT + ".part", "w") as f:
        json.dump(RECORD, f)
    os.replace(OUT + ".part", OUT)


class Probe:
    def __init__(self, trainer):
        self.trainer, self.timer = trainer, trainer.timer

    def __getattr__(self, name):
        return getattr(self.timer, name)

    @contextlib.contextmanager
    def __call__(self, phase):
        start = time.time()
        try:
            with self.timer(phase):
                yield
        finally:
            RECORD["phases"].append({{"phase": phase, "start": start, "end": time.time()}})
            write(self.trainer)


@hookimpl
def rlcore_train_start(trainer):
    trainer.timer = Probe(trainer)
    write(trainer)
'''

# python -c SAMPLER OUT GPU [GPU ...]: one JSON line per GPU every 20 ms until terminated
SAMPLER = '''
import json, sys, time
import psutil, pynvml

pynvml.nvmlInit()
handles = [(int(i), pynvml.nvmlDeviceGetHandleByIndex(int(i))) for i in sys.argv[2:]]
seen = set()
with open(sys.argv[1], "w", buffering=1) as f:
    while True:
        for index, handle in handles:
            t = time.time()
            used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            pids = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            f.write(json.dumps({"t": t, "gpu": index, "used": used, "pids": pids}) + "\\n")
            for pid in pids.keys() - seen:
                seen.add(pid)
                try:
                    parents = [p.pid for p in psutil.Process(pid).parents()]
                except psutil.Error:  # gone, or outside this pid namespace (NVML may report the host's pids)
                    parents = []
                f.write(json.dumps({"t": t, "pid": pid, "parents": parents}) + "\\n")
        time.sleep(0.02)
'''


def read_samples(path: Path) -> tuple[list[dict[str, Any]], dict[int, list[int]]]:
    """The sampler's GPU rows (pids as ints) and each pid's parents; a line cut short by the sampler's end is skipped."""
    rows, parents = [], {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "parents" in row:
            parents[int(row["pid"])] = [int(p) for p in row["parents"]]
        else:
            rows.append({**row, "pids": {int(pid): used for pid, used in row["pids"].items()}})
    return rows, parents


def roles_of(probe: dict[str, Any], pids: set[int], parents: dict[int, list[int]]) -> dict[int, str]:
    """Each pid the GPUs list -> the role whose worker it is, or whose worker started it; `driver` for the driver;
    `pid N` for a process of no role (another run, or NVML's pids from outside this pid namespace)."""
    owner = {pid: role for role, ranks in probe.get("roles", {}).items() for pid in ranks}
    owner.setdefault(probe.get("driver"), "driver")
    out = {}
    for pid in pids:
        role = next((owner[p] for p in [pid, *parents.get(pid, [])] if p in owner), None)
        out[pid] = role or f"pid {pid}"
    return out


def attribute(samples: list[dict[str, Any]], parents: dict[int, list[int]], probe: dict[str, Any],
              baseline: dict[int, int]) -> dict[str, Any]:
    """Per plan phase and GPU: the device's peak (used memory less `baseline`, what the GPU held before the run) and
    each role's peak (the sum of its processes' memory at one sample, at its highest), over the samples inside any
    of that phase's windows; `roles_of` says which pid was which role."""
    pids = {pid for row in samples for pid in row["pids"]}
    role_of = roles_of(probe, pids, parents)
    windows = [(PHASES[p["phase"]], p["start"], p["end"]) for p in probe.get("phases", []) if p["phase"] in PHASES]
    phases: dict[str, dict[str, Any]] = {}
    for row in samples:
        for phase, start, end in windows:
            if not start <= row["t"] <= end:
                continue
            gpu = phases.setdefault(phase, {}).setdefault(str(row["gpu"]), {"device_peak": 0, "roles": {}, "samples": 0})
            gpu["samples"] += 1
            gpu["device_peak"] = max(gpu["device_peak"], row["used"] - baseline.get(row["gpu"], 0))
            held: dict[str, int] = {}
            for pid, used in row["pids"].items():
                held[role_of[pid]] = held.get(role_of[pid], 0) + (used or 0)  # None: NVML cannot say (no permission)
            for role, used in held.items():
                gpu["roles"][role] = max(gpu["roles"].get(role, 0), used)
    out = {"phases": phases, "pids": {str(pid): role for pid, role in sorted(role_of.items())}}
    if pids and not set(role_of.values()) & set(probe.get("roles", {})):
        out["note"] = ("no pid NVML lists is a role's worker or its child (NVML may report pids of another pid "
                       "namespace): the roles' figures are per pid only")
    return out


def baseline_of(samples: list[dict[str, Any]], started: float) -> dict[int, int]:
    """Each GPU's used memory before the run began (other processes' and the driver's reserve): the least in the
    samples of the run's first half second, or 0 where none came then."""
    out: dict[int, int] = {}
    for row in samples:
        if row["t"] < started + 0.5:
            out[row["gpu"]] = min(out.get(row["gpu"], row["used"]), row["used"])
    return out


def error_of(predicted: int, measured: int) -> dict[str, Any]:
    """The prediction's error against a measured peak and whether it meets the target: within 10%, and never under
    by more than 5%."""
    if not measured:
        return {}
    within = 95 * measured <= 100 * predicted <= 110 * measured  # in whole bytes: 5% under is still in
    return {"error": round(predicted / measured - 1, 3), "meets_target": within}


def compare(predicted: dict[str, Any], measured: dict[str, Any], gpus: list[int]) -> list[dict[str, Any]]:
    """One row per GPU and phase of the plan: the predicted and measured peaks of the device and of each role, their
    errors, and the plan's components per role; plan rank r is NVML device `gpus[r]`."""
    rows = []
    for plan_row in predicted.get("rows", []):
        for rank in plan_row["gpus"]:
            device = gpus[rank] if rank < len(gpus) else rank
            seen = measured["phases"].get(plan_row["phase"], {}).get(str(device))
            roles: dict[str, dict[str, Any]] = {}
            for term in plan_row["terms"]:
                role = roles.setdefault(term["role"], {"predicted_bytes": 0, "components": {}})
                role["predicted_bytes"] += term["bytes"] or 0
                role["components"][term["component"]] = round((term["bytes"] or 0) / GiB, 2)
            for name in (seen or {}).get("roles", {}):
                roles.setdefault(name, {"predicted_bytes": 0, "components": {}})  # measured, not in the plan
            for name, role in roles.items():
                planned = role.pop("predicted_bytes")
                role["predicted_gib"] = round(planned / GiB, 2)
                if seen and name in seen["roles"]:
                    role["measured_gib"] = round(seen["roles"][name] / GiB, 2)
                    role.update(error_of(planned, seen["roles"][name]))
            row = {"gpu": device, "phase": plan_row["phase"], "predicted_gib": round(plan_row["peak_bytes"] / GiB, 2),
                   "roles": roles}
            if seen:
                row.update(device_peak_gib=round(seen["device_peak"] / GiB, 2), samples=seen["samples"],
                           **error_of(plan_row["peak_bytes"], seen["device_peak"]))
            rows.append(row)
    return rows


def met(cases: dict[str, Any]) -> dict[str, bool]:
    """Whether each case's measured phases meet the target (the device's peak), as `<case> GPU <i> <phase>`; an
    overflow case meets it where the plan refused it and the forced run ran out of memory; a `--fit` case where the
    fitted run finished without running out of memory (and its phases as any case's)."""
    out = {}
    for name, case in cases.items():
        if "overflow_shown" in case:
            out[f"{name} refused by the plan, out of memory when forced"] = case["overflow_shown"]
            continue
        if "fit_shown" in case:
            out[f"{name} --fit's change runs within the GPU"] = case["fit_shown"]
        out.update({f"{name} GPU {row['gpu']} {row['phase']}": row["meets_target"] for row in case["rows"]
                    if "meets_target" in row})
    return out


def table(cases: dict[str, Any]) -> list[str]:
    """The printed table: per case, GPU and phase, the device's predicted and measured peaks, then each role's."""
    lines = [f"{'case':<14} {'gpu':>3} {'phase':<12} {'who':<10} {'predicted':>10} {'measured':>10} {'error':>7}  target"]
    for name, case in cases.items():
        for row in case["rows"]:
            lines.append(f"{name:<14} {row['gpu']:>3} {row['phase']:<12} {'device':<10} {row['predicted_gib']:>9.1f}G "
                         f"{row.get('device_peak_gib', '-'):>9}G {row.get('error', '-'):>7}  {row.get('meets_target', '-')}")
            for role, seen in row["roles"].items():
                lines.append(f"{'':<14} {'':>3} {'':<12} {role:<10} {seen['predicted_gib']:>9.1f}G "
                             f"{seen.get('measured_gib', '-'):>9}G {seen.get('error', '-'):>7}")
        if case.get("note"):
            lines.append(f"{name:<14} note: {case['note']}")
        if "overflow_shown" in case:
            lines.append(f"{name:<14} predicted to overflow: {not case['predicted_fits']}; "
                         f"ran out of memory: {case['out_of_memory']}")
        if "fit_shown" in case:
            lines.append(f"{name:<14} --fit applied {' '.join(case['fit_changes'])}; its plan fits: "
                         f"{case['predicted_fits']}; the run finished: {case['returncode'] == 0}, out of memory: "
                         f"{case['out_of_memory']}")
    return lines
