"""Write benchmarks/README.md from benchmarks/results/*.json: each benchmark's latest run (its method, hardware,
commit, ratio and spread, and targets) and every run of it, so no figure is copied by hand.

    python benchmarks/report.py           # rewrite benchmarks/README.md
    python benchmarks/report.py --check   # exit 1 when the checked-in README.md is not what the results give

The results were written by scripts of different ages, so each field is read where present and left out where
not: a ratio is a number (`ratio`, `ratio_step`, `small_call_ratio`, ...), a dict of them (`ratios`), a spread
over rounds (`ratio: {median, min, max, rounds, per_round}`, or `median_ratio` with `spread` and the per-round
list), per-row ratios (`rows`), or, where none is recorded, the sides' throughput against the base side
(`targets_base`, else `trl`). The output depends on the files' names and contents alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"

# `<benchmark>-<YYYY-MM-DD>-<kind>[-<call>]`: kind is the machine kind (nvidia-h200, nvidia-h200-x2), call a
# letter for a later run the same day (none: the first), or a word such as `partial`
NAME = re.compile(r"^(?P<group>.+?)-(?P<date>\d{4}-\d{2}-\d{2})(?:-(?P<kind>[a-z]+-[a-z0-9]+(?:-x\d+)?))?(?:-(?P<call>.+))?$")
# the script each benchmark's results come from, where the name's first part is not a benchmarks/*.py
SCRIPTS = {"gpu-smoke": "../tests/gpu/smoke.py", "gpu-verify": "../tests/gpu/verify.py", "reliability": "../tests/reliability/report.py"}
# groups that record test runs, not a comparison
RECORDS = {"gpu": "GPU test sessions: what each call ran and gave"}
RATIO_KEY = re.compile(r"(^|_)ratios?($|_)")
SKIP = {"settings", "labels", "environment", "host", "per_run", "per_run_step_s", "step_s", "losses", "tokens_per_step",
        "same", "shape", "model", "work", "differences", "explanation", "by_design", "load_average_1_5_15min",
        "candidates_per_s", "mean_chars", "rlcore_phases_s", "calls", "sides", "rows", "rounds", "runs", "targets"}


def fmt(x: Any) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def spread_text(median: float, low: float | None, high: float | None, per_round: list | None) -> str:
    text = fmt(median)
    if low is not None and high is not None:
        text += f" (spread {fmt(low)}-{fmt(high)}"
        text += f" over {len(per_round)} rounds: {', '.join(fmt(v) for v in per_round)})" if per_round else ")"
    return text


def ratios_of(d: dict, depth: int = 0) -> list[str]:
    """Every ratio a result records, as 'label: value' lines."""
    out: list[str] = []
    r = d.get("ratio")
    if isinstance(r, dict) and "median" in r:
        out.append("ratio: " + spread_text(r["median"], r.get("min"), r.get("max"), r.get("per_round")))
    elif isinstance(r, (int, float)) and not isinstance(r, bool):
        out.append(f"ratio: {fmt(r)}")
    if isinstance(d.get("median_ratio"), (int, float)):
        per_round_key = next((k for k, v in d.items() if k.startswith("ratio_") and isinstance(v, list)), None)
        low, high = (d["spread"] + [None, None])[:2] if isinstance(d.get("spread"), list) else (None, None)
        label = per_round_key[len("ratio_"):].replace("_", " ") if per_round_key else "ratio"
        out.append(f"{label} (median): " + spread_text(d["median_ratio"], low, high, d.get(per_round_key) if per_round_key else None))
    for key, value in d.items():
        if key in ("ratio", "median_ratio") or key in SKIP:
            continue
        is_ratio = bool(RATIO_KEY.search(key))
        if is_ratio and isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(f"{key}: {fmt(value)}")
        elif is_ratio and isinstance(value, dict):
            prefix = "" if key == "ratios" else f"{key} "
            for sub, v in value.items():
                if isinstance(v, dict) and "median" in v:  # a spread over rounds per side
                    out.append(f"{prefix}{sub}: " + spread_text(v["median"], v.get("min"), v.get("max"), v.get("per_round")))
                elif isinstance(v, (int, float)) and not isinstance(v, bool) and sub != "raw":
                    out.append(f"{prefix}{sub}: {fmt(v)}")
        elif is_ratio and isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for row in value:  # e.g. [{engine, train_x_hf, peak_x_hf, met}]
                label = row.get("engine") or row.get("name") or row.get("side") or "row"
                nums = [f"{k} {fmt(v)}" for k, v in row.items()
                        if ("_x_" in k or RATIO_KEY.search(k)) and isinstance(v, (int, float)) and not isinstance(v, bool)]
                out.append(f"{label}: {', '.join(nums)}")
        elif isinstance(value, dict) and depth == 0 and key not in SKIP:
            out += ratios_of(value, depth + 1)
    rows = d.get("rows")
    if isinstance(rows, list):
        first = next((r for r in rows if isinstance(r, dict) and r.get("ratio") == 1.0), {})
        for row in rows:
            if isinstance(row, dict) and isinstance(row.get("ratio"), (int, float)) and row["ratio"] != 1.0:
                label = ", ".join(str(row[k]) for k in ("variant", "transport", "shape") if k in row)
                if "in_process" in row:
                    label += ", in process" if row["in_process"] else ", own processes"
                base = row.get("baseline") or first.get("variant") or first.get("transport")
                out.append(f"{label}: {fmt(row['ratio'])}x the time" + (f" of {base}" if base else ""))
    if not out and isinstance(d.get("sides"), dict):
        out += side_ratios(d)
    return out


def side_ratios(d: dict) -> list[str]:
    """Each side's throughput over the base side's, where a result records the sides but no ratio."""
    sides, labels = d["sides"], d.get("labels") or {}
    base = d.get("targets_base") or ("trl" if "trl" in sides else None)
    ref = sides.get(base) if base else None
    out = []
    for name, side in sides.items():
        if name == base or not isinstance(side, dict):
            continue
        label = labels.get(name, name) if isinstance(labels, dict) else name
        if "failed" in side:
            out.append(f"{label}: failed")
        elif isinstance(ref, dict) and ref.get("tokens_per_s") and side.get("tokens_per_s"):
            out.append(f"{label}: {fmt(side['tokens_per_s'] / ref['tokens_per_s'])}x the tokens/s of "
                       f"{labels.get(base, base) if isinstance(labels, dict) else base}")
    return out


def summary_of(d: dict) -> list[str]:
    """The outcome of a result that records test rows or totals rather than a comparison."""
    if isinstance(d.get("totals"), dict):
        return [", ".join(f"{k} {fmt(v)}" for k, v in d["totals"].items())]
    if isinstance(d.get("counts"), dict) and isinstance(d.get("tests"), list):  # tests/gpu/verify.py
        failed = [t["test"] for t in d["tests"] if t.get("outcome") not in ("passed", "skipped")]
        started = f", {len(d.get('not_started') or [])} entries not started" if d.get("not_started") else ""
        return [", ".join(f"{fmt(v)} {k}" for k, v in d["counts"].items() if v) + started
                + (f"; not passed: {', '.join(failed)}" if failed else "")]
    if isinstance(d.get("rows"), list) and "passed" in d:
        failed = d.get("failed") or []
        rows = ", ".join(f"{r.get('name')} {r.get('status')}" for r in d["rows"] if isinstance(r, dict))
        return [f"{fmt(d['passed'])} rows passed, failed: {', '.join(map(str, failed)) or 'none'} ({rows})"]
    rows = d.get("rows")
    if isinstance(rows, list):  # timings without a baseline
        return [f"{r.get('transport', r.get('name', 'row'))} {r.get('shape', '')}: {fmt(r['rlcore_ms'])} ms".replace(" :", ":")
                for r in rows if isinstance(r, dict) and isinstance(r.get("rlcore_ms"), (int, float))]
    return []


def targets_of(d: dict, depth: int = 0) -> list[str]:
    out = []
    t = d.get("target")
    if isinstance(t, str) and t:
        out.append(t)
    targets = d.get("targets")
    if isinstance(targets, dict):
        out += [f"{k}: {fmt(v)}" for k, v in targets.items()]
    if depth == 0:
        for key, value in d.items():
            if isinstance(value, dict) and key not in SKIP and key != "targets":
                out += targets_of(value, 1)
        rows = d.get("rows")
        if isinstance(rows, list):
            out += [f"{r.get('transport', '')} {r.get('shape', '')}: {r['target']}".strip()
                    for r in rows if isinstance(r, dict) and isinstance(r.get("target"), str) and r["target"]]
    return out


def met_of(d: dict, depth: int = 0) -> list[str]:
    out = []
    m = d.get("met")
    if isinstance(m, bool):
        out.append("met" if m else "not met")
    elif isinstance(m, dict):
        out += [f"{k}: {'met' if v else 'not met'}" for k, v in m.items() if isinstance(v, bool)]
    elif isinstance(m, str):
        out.append(m)
    for key, value in d.items():
        if isinstance(value, dict) and key not in SKIP and depth == 0:
            out += met_of(value, 1)
        elif RATIO_KEY.search(key) and isinstance(value, list):
            out += [f"{r.get('engine', 'row')}: {'met' if r['met'] else 'not met'}"
                    for r in value if isinstance(r, dict) and isinstance(r.get("met"), bool)]
    return out


def method_of(d: dict) -> str:
    parts = [d[k] for k in ("work", "batch", "data") if isinstance(d.get(k), str)]
    if isinstance(d.get("mode"), str):
        parts.insert(0, f"mode {d['mode']}")
    if isinstance(d.get("example"), str):
        parts.append(f"example {d['example']}")
    if isinstance(d.get("steps"), int):
        skip = d.get("warmup", d.get("skip"))
        parts.append(f"{d['steps']} steps" + (f", the first {skip} not timed" if isinstance(skip, int) else ""))
    if isinstance(d.get("repeats"), int):
        parts.append(f"{d['repeats']} repeats")
    if isinstance(d.get("rounds_asked"), int):
        parts.append(f"{d['rounds_asked']} interleaved rounds")
    if isinstance(d.get("torch_threads"), int):
        parts.append(f"{d['torch_threads']} torch threads")
    differ = d.get("differ") or d.get("settings_differ")
    if isinstance(differ, list) and differ:
        parts.append("settings that differ between the sides: " + ", ".join(map(str, differ)))
    elif isinstance(d.get("same"), dict):
        parts.append("the same settings on both sides")
    if isinstance(d.get("what"), str):
        parts.append(d["what"])
    return "; ".join(parts) or "see the JSON"


def hardware_of(d: dict, kind_from_name: str | None) -> str:
    kind = d.get("kind") or kind_from_name
    if not kind:
        env = d.get("environment") if isinstance(d.get("environment"), dict) else {}
        cpus = env.get("cpu_count", env.get("cpus"))
        if cpus:
            kind = f"CPU, {cpus} cores"
        elif isinstance(d.get("machine"), str):
            kind = d["machine"]
        elif isinstance(d.get("device"), str):
            kind = d["device"]
    host = d.get("host") if isinstance(d.get("host"), dict) else {}
    if host.get("gpus"):
        kind = f"{kind} ({host['gpus'][0].split(',')[0]} x{len(host['gpus'])}, {host.get('cpus', '?')} CPUs)"
    return str(kind or "not recorded")


def commit_of(d: dict) -> str:
    commit = d.get("commit")
    if not isinstance(commit, str):
        for holder in (d.get("rounds") or []) + list((d.get("sides") or {}).values()) + [d.get("call_a") or {}]:
            if isinstance(holder, dict):
                found = holder.get("commit") or next((v.get("commit") for v in holder.values()
                                                      if isinstance(v, dict) and isinstance(v.get("commit"), str)), None)
                if isinstance(found, str):
                    commit = found
                    break
    if not isinstance(commit, str):
        return "not recorded"
    head = commit.split()[0]
    return head[:7] if re.fullmatch(r"[0-9a-f]{7,40}", head) else head


def status_of(d: dict) -> str:
    notes = []
    if d.get("complete") is False:
        notes.append("partial")
    if d.get("smoke") is True:
        notes.append("smoke")
    sides = d.get("sides") if isinstance(d.get("sides"), dict) else {}
    failed = sorted(name for name, side in sides.items() if isinstance(side, dict) and "failed" in side)
    if failed:
        notes.append("failed sides: " + ", ".join(failed))
    return "; ".join(notes)


def load_runs(results: Path) -> tuple[dict[str, list[dict]], list[Path]]:
    groups: dict[str, list[dict]] = {}
    others = []
    for path in sorted(results.iterdir()):
        if path.suffix != ".json":
            if path.is_file():
                others.append(path)
            continue
        m = NAME.match(path.stem)
        group, date, kind, call = (m["group"], m["date"], m["kind"], m["call"] or "") if m else (path.stem, "", None, "")
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            d = {"unreadable": str(error)}
        if not isinstance(d, dict):
            d = {"rows": d}
        full_date = str(d.get("date") or date)
        date = date or full_date[:10]
        call_rank = ord(call) - ord("a") if re.fullmatch(r"[a-z]", call) else 0  # none: the day's first run
        groups.setdefault(group, []).append({
            "file": path.name, "date": date, "order": (date, call_rank, full_date, path.name),
            "hardware": hardware_of(d, kind), "commit": commit_of(d), "method": method_of(d),
            "result": ratios_of(d) or summary_of(d), "targets": targets_of(d), "met": met_of(d), "status": status_of(d)})
    for runs in groups.values():
        runs.sort(key=lambda r: r["order"], reverse=True)
    return groups, others


def script_of(group: str) -> str | None:
    if group in SCRIPTS:
        return SCRIPTS[group]
    first = group.split("-")[0]
    return f"{first}.py" if (HERE / f"{first}.py").exists() else None


def cell(lines: list[str]) -> str:
    return "; ".join(lines).replace("|", "/") or "-"


def render(results: Path = RESULTS) -> str:
    groups, others = load_runs(results)
    benches = sorted(g for g in groups if g not in RECORDS)
    out = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/report.py` from [results/](results/); do not edit it by hand (CI runs",
        "`python benchmarks/report.py --check`, which fails when this file is not what the results give). Each",
        "benchmark script prints a table and writes one JSON per run under `results/`, with its settings, the machine",
        "and the commit; run one with `--smoke` first to check its code paths on the CPU. A ratio's meaning (which",
        "side is divided by which) is in its label and its target; a spread is the range of the per-round ratios",
        "of one run, whose sides ran interleaved.",
        "",
        "## Latest runs",
        "",
        "| benchmark | latest run | hardware | commit | result | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for group in benches:
        run = groups[group][0]
        out.append(f"| [{group}](#{anchor(group)}) | [{run['date'] or 'undated'}](results/{run['file']}) | {run['hardware']} | "
                   f"{run['commit']} | {cell(run['result'])} | {cell(run['targets'])} | {cell(run['met'])} |")
    for group in benches + sorted(g for g in groups if g in RECORDS):
        runs = groups[group]
        run = runs[0]
        script = script_of(group)
        out += ["", f"## {group}", ""]
        if group in RECORDS:
            out.append(RECORDS[group] + ".")
        else:
            out += [f"- script: [{script.removeprefix('../')}]({script})" if script else "- script: not recorded",
                    f"- latest run: [{run['file']}](results/{run['file']})" + (f" ({run['status']})" if run["status"] else ""),
                    f"- method: {run['method']}",
                    f"- hardware: {run['hardware']}; commit: {run['commit']}"]
            out += ["- result:"] + [f"  - {line}" for line in run["result"]] if run["result"] else ["- result: see the JSON"]
            if run["targets"]:
                out.append(f"- target: {'; '.join(run['targets'])}" + (f" ({'; '.join(run['met'])})" if run["met"] else ""))
        out += ["", "| run | date | hardware | commit | result |", "|---|---|---|---|---|"]
        out += [f"| [{r['file']}](results/{r['file']}){' (' + r['status'] + ')' if r['status'] else ''} | {r['date'] or 'undated'} | "
                f"{r['hardware']} | {r['commit']} | {cell(r['result'])} |" for r in runs]
    if others:
        out += ["", "## Other files", ""] + [f"- [{p.name}](results/{p.name})" for p in others]
    return "\n".join(out) + "\n"


def anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^a-z0-9_\- ]", "", title.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when benchmarks/README.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = README.read_text() if README.exists() else ""
        if current != text:
            print(f"{README} is not what benchmarks/results/ gives: "
                  "run `python benchmarks/report.py` and commit it", file=sys.stderr)
            return 1
        return 0
    README.write_text(text)
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
