"""Fixtures for the core tests: the installed example plugin, the `rlcore` command, tiny distributions."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

RLCORE = Path(sys.executable).with_name("rlcore")


@pytest.fixture(scope="session")
def example_plugin() -> md.Distribution:
    """The example third-party plugin, installed as a real distribution (as .ci/run does)."""
    try:
        return md.distribution("rlcore-example-plugin")
    except md.PackageNotFoundError:
        pytest.fail(
            "the example plugin distribution is not installed in this environment: run "
            "`pip install ./examples/plugin-template` (bash .ci/run does it)"
        )


@pytest.fixture
def rlcore_cli(example_plugin, tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """Run the installed `rlcore` console script in tmp_path; returns the completed process.

    Installed plugins other than `builtins` and `example` are disabled (RLCORE_DISABLE_PLUGINS) so the
    CLI's own behaviour is tested quickly; pass env={"RLCORE_DISABLE_PLUGINS": ""} to load them all.
    """
    if not RLCORE.exists():
        pytest.fail(f"the rlcore console script is missing at {RLCORE}: pip install -e . first")
    others = sorted({ep.name for ep in md.entry_points(group="rlcore.plugins")} - {"builtins", "example"})

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
        full_env["RLCORE_DISABLE_PLUGINS"] = ",".join(others)
        full_env.update(env or {})
        return subprocess.run(
            [str(RLCORE), *args], cwd=tmp_path, env=full_env, capture_output=True, text=True,
            timeout=timeout, stdin=subprocess.DEVNULL,
        )

    return run


@pytest.fixture
def make_distribution(tmp_path) -> Callable[..., Path]:
    """A factory installing one-module plugin distributions into a fresh folder; returns the folder."""
    return lambda *args: _write_distribution(tmp_path / "site", *args)


def _write_distribution(root: Path, dist: str, entry_point: str, module: str, source: str) -> Path:
    """Install a one-module distribution into `root` as pip would: the module plus a .dist-info folder
    with METADATA and entry_points.txt (group rlcore.plugins). Put `root` on sys.path or PYTHONPATH."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[rlcore.plugins]\n{entry_point} = {module}\n")
    (info / "RECORD").write_text(f"{module}.py,,\n{info.name}/METADATA,,\n{info.name}/entry_points.txt,,\n")
    return root


@pytest.fixture
def python_m_rlcore(tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """`python -m rlcore ARGS` in tmp_path with every installed plugin, as a user types it; returns the
    completed process. HF_HUB_OFFLINE is set unless `env` says otherwise."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
        full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
        return subprocess.run([sys.executable, "-m", "rlcore", *args], cwd=tmp_path, env=full_env,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    return run


def cli_in_process(*args: str) -> tuple[int, str]:
    """`rlcore ARGS` in this process (no interpreter start, so a test may try many inputs): its exit status and
    stderr, a traceback that escapes included."""
    import contextlib
    import io
    import traceback

    from rlcore.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(list(args))
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 2
        except BaseException as exc:  # noqa: BLE001 - what the user would see: a traceback
            err.write("".join(traceback.format_exception(exc)))
            rc = 1
    return rc, err.getvalue()


@pytest.fixture(scope="session")
def cli() -> Callable[..., tuple[int, str]]:
    """`cli_in_process`: `rlcore ARGS` in this process, giving (exit status, stderr)."""
    return cli_in_process
