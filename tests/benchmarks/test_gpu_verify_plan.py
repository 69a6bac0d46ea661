"""The GPU verify run's plan, on the CPU (tests/gpu/verify.py): which entries each part runs, what runs alone, how a
pytest run's outcomes are read back, the merged record, and the fixed KV cache its side-by-side entries' vLLM takes.
A mistake here shows only on a GPU lease, as a part that overruns its call or a vLLM engine sizing its cache beside
another entry."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "gpu"


def load_verify():
    spec = importlib.util.spec_from_file_location("gpu_verify", GPU / "verify.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


IDS = [
    "tests/gpu/test_vllm_engine.py::test_generate", "tests/gpu/test_vllm_engine.py::test_sleep",
    "tests/gpu/test_hf_cuda.py::test_a", "tests/gpu/test_grpo_gpu.py::test_x[1]", "tests/gpu/test_grpo_gpu.py::test_y",
    "tests/gpu/test_megatron_archs_gpu.py::test_each[qwen2]", "tests/gpu/test_megatron_archs_gpu.py::test_grpo_learns",
    "tests/gpu/test_megatron_archs_gpu.py::test_each_architecture_builds_what_the_mapping_names_and_equals_transformers[a]",
    "tests/gpu/test_megatron_archs_gpu.py::test_each_architecture_builds_what_the_mapping_names_and_equals_transformers[b]",
]


def test_every_test_is_in_one_entry_of_one_part_with_what_runs_alone_and_the_smoke_first():
    verify = load_verify()
    entries = verify.entries(IDS)
    names = [e.name for e in entries]
    assert len(names) == len(set(names))
    covered = [a for e in entries for a in e.args]
    assert "tests/gpu/test_vllm_engine.py" in covered and "tests/gpu/test_hf_cuda.py" in covered  # one process each
    assert {i for i in IDS if i.split("::")[0].rsplit("/", 1)[-1] not in verify.SHARED and "builds" not in i} <= set(covered)
    assert covered.count(  # every case of a shared function in one process
        "tests/gpu/test_megatron_archs_gpu.py::test_each_architecture_builds_what_the_mapping_names_and_equals_transformers") == 1
    first, second = verify.halves(entries)
    assert sorted(e.name for e in first + second) == sorted(names)
    assert first[0].alone and first[0].weight == verify.LANES  # alone, first
    smoke = next(e for e in entries if e.smoke)
    assert smoke in second and smoke.estimate > verify.PART_S * 0.8  # its rows in a row: only part 2's time holds it
    learning = next(e for e in entries if "learns" in e.name)
    assert learning in second and learning.weight == 3  # seven runs side by side: three lanes' worth
    assert all(e.name.isascii() and "/" not in e.name and "[" not in e.name for e in entries)  # files that come back


def test_estimates_come_from_the_last_record_where_it_has_every_test_of_an_entry(tmp_path):
    """An entry's estimate is its tests' seconds in the newest gpu-verify record plus a process's start; an entry one
    of whose tests has no figure there (new, or it timed out) keeps the table's estimate."""
    verify = load_verify()
    results = tmp_path / "results"
    results.mkdir()
    tests = [{"test": "tests/gpu/test_grpo_gpu.py::test_x[1]", "outcome": "failed", "seconds": 40.0},
             {"test": "tests/gpu/test_hf_cuda.py::test_a", "outcome": "passed", "seconds": 30.0},
             {"test": "tests/gpu/test_grpo_gpu.py::test_y", "outcome": "timeout", "seconds": 356.0}]
    (results / "gpu-verify-2026-12-01-nvidia-h200.json").write_text(json.dumps({"tests": []}))
    (results / "gpu-verify-2026-12-04-nvidia-h200.json").write_text(json.dumps({"tests": tests}))
    known = verify.measured(results)
    assert known == {"tests/gpu/test_grpo_gpu.py::test_x[1]": 40.0, "tests/gpu/test_hf_cuda.py::test_a": 30.0}
    by_name = {e.name: e for e in verify.entries(IDS, known)}
    assert by_name[verify.safe("tests/gpu/test_grpo_gpu.py::test_x[1]")].estimate == verify.START_S + verify.MARGIN * 40
    assert by_name[verify.safe("tests/gpu/test_grpo_gpu.py::test_y")].estimate == verify.DEFAULT_TEST_S
    assert by_name["test_hf_cuda.py"].estimate == verify.START_S + verify.MARGIN * 30  # its one test here
    assert by_name["test_vllm_engine.py"].estimate == verify.SHARED["test_vllm_engine.py"]  # no figure for either


def test_a_pytest_runs_outcomes_and_the_merged_record(tmp_path):
    verify = load_verify()
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_a" name="test_ok[x]" time="1.5"/>'
        '<testcase classname="tests.gpu.test_a" name="test_bad" time="2"><failure message="assert 1 == 2&#10;more"/>'
        '</testcase><testcase classname="tests.gpu.test_a" name="test_two" time="0"><skipped message="needs 2 GPUs"/>'
        '</testcase></testsuite></testsuites>')
    got = verify.junit_outcomes(xml)
    assert [(t["test"], t["outcome"], t["message"]) for t in got] == [
        ("tests/gpu/test_a.py::test_ok[x]", "passed", ""), ("tests/gpu/test_a.py::test_bad", "failed", "assert 1 == 2"),
        ("tests/gpu/test_a.py::test_two", "skipped", "needs 2 GPUs")]
    part = tmp_path / "p1"
    part.mkdir()
    (part / "verify-1.json").write_text(json.dumps({"part": 1, "entries": [{"tests": got}], "left": ["e9"]}))
    verify.ROOT = tmp_path  # the merged record goes to ROOT/benchmarks/results
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    record = json.loads(verify.merge([part], "nvidia-h200", "abc1234").read_text())
    assert record["counts"] == {"passed": 1, "skipped": 1, "failed": 1, "error": 0, "timeout": 0}
    assert record["not_started"] == ["e9"] and record["commit"] == "abc1234"


def test_the_side_by_side_entries_vllm_takes_a_fixed_kv_cache_unless_its_caller_chose_one(tmp_path):
    engine = tmp_path / "vllm" / "engine"
    engine.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (engine / "__init__.py").write_text("")
    (engine / "arg_utils.py").write_text(  # vLLM's EngineArgs fields the patch touches, as vLLM 0.26 has them
        "from dataclasses import dataclass\n@dataclass\nclass EngineArgs:\n    gpu_memory_utilization: float = 0.9\n"
        "    kv_cache_memory_bytes: int | None = None\n    enable_flashinfer_autotune: bool | None = None\n"
        "    def __post_init__(self):\n        self.seen = (self.gpu_memory_utilization, self.kv_cache_memory_bytes)\n")
    probe = ("from vllm.engine.arg_utils import EngineArgs as E; "
             "print(E().seen, E(kv_cache_memory_bytes=5).seen, E().enable_flashinfer_autotune)")
    path = f"{GPU / 'verify_site'}{os.pathsep}{tmp_path}"
    out = {}
    for name, value in (("fixed", "1024"), ("unset", "")):
        env = {**os.environ, "PYTHONPATH": path, "RLCORE_VERIFY_KV_CACHE_BYTES": value}
        out[name] = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                   check=True).stdout.strip()
    assert out["fixed"] == "(0.05, 1024) (0.9, 5) False"
    assert out["unset"] == "(0.9, None) (0.9, 5) None"
