"""The GPU smoke's plan, on the CPU: which rows share the GPU at once and which wait (tests/gpu/smoke.py). A mistake
here shows on a GPU lease only as a table over its 8 minutes or a vLLM engine sizing its cache beside another."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

SMOKE = Path(__file__).resolve().parents[1] / "gpu" / "smoke.py"


def load_smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SMOKE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_vllm_lanes_run_at_once_and_a_row_waits_for_its_after_rows(tmp_path):
    smoke = load_smoke()
    rows = [smoke.Row("a", [], None, 1, lane=0), smoke.Row("b", [], None, 1, lane=1),
            smoke.Row("c", [], None, 1, vllm=False), smoke.Row("d", [], None, 1, vllm=False, after=("a", "b"))]
    started = {row.name: threading.Event() for row in rows}
    order: list[str] = []

    def run(row):
        started[row.name].set()
        if row.name == "a":  # only ends if b runs meanwhile, in the other lane
            assert started["b"].wait(30), "the second vLLM lane did not start while the first ran"
        order.append(row.name)
        return smoke.Result(row.name, "PASS", 0.0)

    done = smoke.lanes(rows, run, tmp_path, parallel=True)
    assert set(done) == {"a", "b", "c", "d"}
    assert order.index("d") > max(order.index("a"), order.index("b"))  # after its rows, not after c alone

    order.clear()
    started["b"].set()  # serial: one lane in the rows' order, which never waits on a row behind it
    smoke.lanes([rows[3], *rows[:3]], run, tmp_path, parallel=False)
    assert order == ["d", "a", "b", "c"]


def test_every_vllm_engine_of_the_gpu_rows_takes_a_fixed_kv_cache(tmp_path):
    smoke = load_smoke()
    models = {name: str(tmp_path / name) for name in smoke.GPU_SHAPES}
    (tmp_path / "data").mkdir()
    rows = {row.name: row for row in smoke.make_rows(models, smoke.write_data(tmp_path / "data"), gpu=True)}
    for row in rows.values():
        engines = {a.split(".vllm_gpu_memory_utilization=")[0] for a in row.args if ".vllm_gpu_memory_utilization=" in a}
        kv = {a.split(".vllm_engine_kwargs=")[0] for a in row.args if a.endswith(f".vllm_engine_kwargs={smoke.VLLM_KWARGS}")}
        assert kv == engines, f"{row.name}: vLLM engines {sorted(engines)}, with a fixed KV cache {sorted(kv)}"
        assert not row.vllm or engines, f"{row.name} is in a vLLM lane but starts no vLLM engine"
    assert "kv_cache_memory_bytes: 1073741824" in smoke.VLLM_KWARGS
    distill = rows["distill"]
    assert distill.serve and not distill.vllm and set(distill.after) == set(smoke.FINAL_SERVED) <= set(rows)
    lane = {name: rows[name].lane for name in ("grpo-hf", "grpo-megatron") if rows[name].vllm}
    assert sorted(lane.values()) == [0, 1]  # the two cold GRPO rows start side by side
