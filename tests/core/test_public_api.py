"""The public surface: `rlcore.__all__` is deliberate, and importing rlcore stays light."""

from __future__ import annotations

import json
import subprocess
import sys

import rlcore

EXPECTED = [
    "AlgorithmSpec",
    "BaseConfig",
    "Batch",
    "CollectorSpec",
    "ConfigError",
    "DispatcherSpec",
    "EngineSpec",
    "Generation",
    "ModelOutputs",
    "NotRegistered",
    "PlacementRequest",
    "PlacementSpec",
    "PluginError",
    "Plugins",
    "Registry",
    "ResourceError",
    "RewardSpec",
    "RlcoreError",
    "RoleConfig",
    "RoleFailed",
    "RoleSpec",
    "RolloutEngine",
    "RunConfig",
    "SamplingParams",
    "Slot",
    "TopK",
    "TrainEngine",
    "Trainer",
    "__version__",
    "function",
    "hookimpl",
    "hookspec",
    "load_config",
    "load_plugins",
    "plan_from_config",
    "Registered",
    "render_config",
    "worker",
    "GenerateWorker",
    "PhaseTimer",
    "RoleSession",
    "RoleSetup",
    "ScoreWorker",
    "TrainWorker",
    "bind",
    "ConfigProblems",
    "SettingSpec",
]

HEAVY = ["torch", "transformers", "ray", "vllm"]


def test_all_is_the_expected_list():
    assert sorted(rlcore.__all__) == sorted(EXPECTED)
    assert len(set(rlcore.__all__)) == len(rlcore.__all__)
    for name in rlcore.__all__:
        assert getattr(rlcore, name) is not None


def heavy_modules_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_import_rlcore_imports_no_engine_library():
    assert heavy_modules_after("import rlcore") == []


def test_rlcore_help_imports_no_engine_library():
    code = "from rlcore.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    assert heavy_modules_after(code) == []
