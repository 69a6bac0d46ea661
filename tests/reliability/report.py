"""`python -m tests.reliability.report [NAME-PART ...]`: run every fault scenario (or those whose name
contains one of the given parts) and print a table (fault, outcome, seconds) with the totals: faults
tried, survived, hangs, steps lost. The same goes as JSON to benchmarks/results/reliability.json (only
for a run of every scenario; `--keep` keeps each scenario's temp dir)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from .faults import SCENARIOS, Outcome, run_scenario

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "reliability.json"


def outcome_word(o: Outcome) -> str:
    if o.hang:
        return "HANG"
    if not o.survived:
        return "FAILED"
    return "survived"


def totals(outcomes: list[Outcome]) -> dict[str, int]:
    return {
        "faults tried": len(outcomes),
        "survived": sum(o.survived for o in outcomes),
        "hangs": sum(o.hang for o in outcomes),
        "steps lost": sum(o.steps_lost for o in outcomes),
    }


def table(outcomes: list[Outcome]) -> str:
    width = max(len(o.fault) for o in outcomes)
    rows = [f"{'fault':<{width}}  {'outcome':<8}  {'seconds':>7}", "-" * (width + 19)]
    for o in outcomes:
        rows.append(f"{o.fault:<{width}}  {outcome_word(o):<8}  {o.seconds:>7.1f}")
    rows.append("-" * (width + 19))
    rows.append(", ".join(f"{k}: {v}" for k, v in totals(outcomes).items()))
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    keep = "--keep" in argv
    parts = [a for a in argv if a != "--keep"]
    chosen = [s for s in SCENARIOS if not parts or any(p.lower() in s.name.lower() for p in parts)]
    outcomes = []
    started = time.monotonic()
    for scenario in chosen:
        outcome = run_scenario(scenario, keep=keep)
        outcomes.append(outcome)
        print(f"{outcome_word(outcome):<8} {outcome.seconds:6.1f}s  {outcome.fault}: {outcome.detail}",
              file=sys.stderr, flush=True)
    print(table(outcomes))
    if not parts:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent).stdout
        RESULTS.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "commit": commit.strip() or "unknown",
            "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, CPU only",
            "max_steps": 6,
            "seconds": round(time.monotonic() - started, 1),
            "totals": totals(outcomes),
            "outcomes": [o.__dict__ for o in outcomes],
        }, indent=1) + "\n")
        print(f"wrote {RESULTS}")
    return 0 if all(o.survived for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
