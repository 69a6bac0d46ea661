"""The GRPO package exports its config and trainer for subclassing, and importing them stays light: the
package is imported at plugin load for every CLI command."""

from __future__ import annotations

import json
import subprocess
import sys

import rlcore.plugins.grpo as grpo
from rlcore.plugins.grpo.config import GRPOConfig
from rlcore.plugins.grpo.trainer import GRPOTrainer

HEAVY = ["torch", "transformers", "ray", "vllm"]


def test_the_package_exports_its_config_and_trainer():
    assert grpo.__all__ == ["GRPOConfig", "GRPOTrainer"]
    assert grpo.GRPOConfig is GRPOConfig and grpo.GRPOTrainer is GRPOTrainer


def test_importing_them_imports_no_engine_library():
    probe = (f"from rlcore.plugins.grpo import GRPOConfig, GRPOTrainer\nimport json, sys\n"
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
