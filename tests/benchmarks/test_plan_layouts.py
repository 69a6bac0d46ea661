"""docs/memory.md's table of the examples' multi-GPU layouts (benchmarks/plan_layouts.py) says what holds: it is the
rendering of benchmarks/results/plan_layouts.json, and that record is what `rlcore plan` predicts today (one example
planned again here; a change to the memory terms fails this until the record and the table are made again)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load():
    spec = importlib.util.spec_from_file_location("plan_layouts", BENCHMARKS / "plan_layouts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_records_and_says_it_is_predicted():
    layouts = load()
    record = json.loads(layouts.RESULT.read_text())
    text = layouts.DOCS.read_text()
    block = text[text.index(layouts.START): text.index(layouts.END) + len(layouts.END)]
    assert block == layouts.markdown(record)
    assert record["predicted"] and not record["measured"] and "Predicted, not measured" in block
    examples = sorted(str(p.relative_to(layouts.ROOT)) for p in layouts.EXAMPLES.glob("*/*.yaml"))
    assert [c["example"] for c in record["examples"]][: len(examples)] == examples  # every one, planned or said why not
    assert all("rows" in c or c["not_planned"] for c in record["examples"])


def test_the_record_is_what_the_plan_says_now(tmp_path):
    layouts = load()
    record = {c["example"]: c for c in json.loads(layouts.RESULT.read_text())["examples"]}
    example, extra = layouts.VARIANTS[-1]
    for name, extra in (("examples/ray/grpo/colocate.yaml", []), ("examples/ray/gkd/teacher_standalone.yaml", []),
                        (f"examples/ray/{example}", extra)):
        now = layouts.plan_example(layouts.ROOT / name, tmp_path, extra)
        name = " ".join([name, *extra])
        assert now == record[name], f"{name}: run `python benchmarks/plan_layouts.py --docs` (the plan changed)"
    assert layouts.ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3, 8, 10-11"
