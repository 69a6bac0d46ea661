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
    "Environment",
    "EnvironmentSpec",
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
    "DeviceKeys",
    "SettingSpec",
    # multi-turn environments: what a third-party environment subclasses and returns
    "Step",
    "TeacherTrainWorker",
    "ToolCall",
    "Turn",
    # the algorithm contract: roles, their setups, the shared config sections and what a check reports
    "RoleTrainer",
    "TrainingConfig",
    "OptimizerKeys",
    "CheckpointKeys",
    "LoggingKeys",
    "NonfiniteKeys",
    "PromptKeys",
    "TrainRoleConfig",
    "RolloutRoleConfig",
    "GenerateRoleConfig",
    "default_of",
    "train_options",
    "rollout_options",
    "OptimizerOptions",
    "TrainOptions",
    "build_engine",
    "make_engine",
    "announce",
    "config_error",
    "config_model",
    "problems_of",
    "did_you_mean",
    "ModelUse",
    # rewards: found by name and called safely, for any algorithm that scores completions
    "RewardFailed",
    "call_reward",
    "resolve_reward",
    # data a plugin's step reads
    "PromptEncoder",
    "PromptSampler",
    "completion_text",
    "load_prompts",
    "load_rows",
    "prompt_view",
    "worker_plugins",
    "worker_rank",
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
    assert heavy_modules_after("import rlcore.testing") == []  # the tiny model's builder imports torch when called
    assert heavy_modules_after("import rlcore.runtime, rlcore.engines") == []  # weight sync: at first use


# What a plugin may import of core: `rlcore` and these named sub-APIs, each the names of its `__all__`. Every other
# module of core is internal: it may move or change without notice (docs/architecture.md, "The public surface").
SUB_APIS = ("rlcore", "rlcore.batch", "rlcore.bounds", "rlcore.data", "rlcore.engines", "rlcore.environments",
            "rlcore.episodes", "rlcore.head", "rlcore.memory", "rlcore.paths", "rlcore.rewards", "rlcore.runtime",
            "rlcore.sections", "rlcore.testing")


def plugin_imports_of_core(root) -> list[tuple[str, str, str]]:
    """(file, module, name) of every import of core in the .py files under `root`, at the top or in a function;
    name is "*" for `import rlcore.x`."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "rlcore":
                if not node.module.startswith("rlcore.plugins") and not node.module.startswith("rlcore.contrib"):
                    found += [(str(path.relative_to(root)), node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(str(path.relative_to(root)), a.name, "*") for a in node.names
                          if a.name.split(".")[0] == "rlcore" and a.name.split(".")[:2] not in (["rlcore", "plugins"],
                                                                                                  ["rlcore", "contrib"])]
    return found


def test_plugins_import_only_the_public_surface():
    """The built-in plugins, contrib and the plugin template import of core only `rlcore` and its named sub-APIs,
    and of each only the names its `__all__` lists; a plugin reaching into an internal module fails here."""
    import importlib
    from pathlib import Path

    repo = Path(rlcore.__file__).resolve().parent.parent
    outside = []
    for folder in ("plugins", "contrib", "examples/plugin-template"):
        for path, module, name in plugin_imports_of_core(repo / folder):
            if module not in SUB_APIS:
                outside.append(f"{folder}/{path}: {module} (not a public sub-API)")
            elif name != "*" and name not in importlib.import_module(module).__all__:
                outside.append(f"{folder}/{path}: {module}.{name} (not in its __all__)")
    assert outside == [], "\n".join(outside)
    for module in SUB_APIS:  # every exported name is there
        api = importlib.import_module(module)
        assert all(getattr(api, name) is not None for name in api.__all__), module


def test_the_surface_check_catches_an_internal_import(tmp_path):
    (tmp_path / "bad.py").write_text("from rlcore.runtime.weight_sync import BroadcastGroup\nimport rlcore.runtime.cluster\n"
                                     "def f():\n    from rlcore.engines import HeadModelOutputs\n")
    found = plugin_imports_of_core(tmp_path)
    assert found == [("bad.py", "rlcore.runtime.weight_sync", "BroadcastGroup"), ("bad.py", "rlcore.runtime.cluster", "*"),
                     ("bad.py", "rlcore.engines", "HeadModelOutputs")]
    assert [m for _, m, _ in found if m not in SUB_APIS] == ["rlcore.runtime.weight_sync", "rlcore.runtime.cluster"]


# Crossings still to move into core (issue 25): none left; a new one fails here.
LEFT: set[str] = set()


def test_builtin_plugins_import_no_other_plugins_internals():
    """A built-in plugin reaches another only through `rlcore` (and the toy task, the tiny model through
    `rlcore.testing`): nothing of `rlcore.plugins.<other>` is imported, at the top or inside a function,
    beyond the crossings LEFT names. Relative imports count too (`from ..gkd.workers import ...`)."""
    import ast
    from pathlib import Path

    root = Path(rlcore.__file__).resolve().parent.parent / "plugins"
    crossing = []
    for path in root.rglob("*.py"):
        own = path.relative_to(root).parts[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: resolved from the file's package
                package = ["rlcore", "plugins", *path.relative_to(root).parent.parts]
                base = package[: len(package) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
                if not node.module:  # `from .. import gkd`
                    names = [".".join(base + [a.name]) for a in node.names]
            else:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["rlcore", "plugins"] and len(parts) > 2 and parts[2] != own:
                    crossing.append(f"{path.relative_to(root)}: {name}")
    assert set(crossing) <= LEFT, sorted(set(crossing) - LEFT)


def test_rlcore_help_imports_no_engine_library():
    code = "from rlcore.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    assert heavy_modules_after(code) == []
