"""The README, run top to bottom as written: its CPU commands (the shell blocks and the Python snippet) in order, in
one temporary directory, as a newcomer runs them after the install. A block after a `<!-- gpu -->` line needs GPUs:
its commands are listed (`-rP` shows them) and checked for the files they name, not run. The demos run with the
documented RLCORE_DEMO_MAX_STEPS=1, so the commands are the README's own text and the test stays short."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
from pathlib import Path

from rlcore.cli import main
from rlcore.extras import missing

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(<!-- gpu -->\n)?```(\w+)\n(.*?)```", re.S)
FILE = re.compile(r"^# [\w/.]+\.(py|toml)\b")  # a listing of a file (`# guess.py: ...`), not a snippet to run


def readme_blocks() -> list[tuple[str, str, bool]]:
    """(language, text, needs GPUs) of each fenced block, in order."""
    return [(lang, body, bool(gpu)) for gpu, lang, body in BLOCK.findall((ROOT / "README.md").read_text())]


def shell_commands(body: str) -> list[list[str]]:
    """Each command of a shell block as argv, continuations joined, comments dropped, `a && b` split."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        while argv:
            cut = argv.index("&&") if "&&" in argv else len(argv)
            out.append(argv[:cut])
            argv = argv[cut + 1:]
    return out


def installed(argv: list[str]) -> bool:
    """What an install line of the README sets up is what this test runs in: the test environment stands for it."""
    if argv[:3] == ["python3", "-m", "venv"] or argv[:1] in (["."], ["source"]):
        return True
    assert argv[:2] == ["pip", "install"], f"a README command this test does not know: {shlex.join(argv)}"
    for arg in argv[2:]:
        if arg == "./examples/plugin-template":
            assert importlib.metadata.distribution("rlcore-example-plugin")
        elif arg.startswith(".["):
            extras = arg[2:-1].split(",")
            assert not [e for e in extras if e in ("hf", "sft", "ray", "megatron") and missing(e)]
    return True


def rlcore(argv: list[str], capsys) -> tuple[int, str, str]:
    """`rlcore ARGV` in this process (as the console script calls it): exit status, stdout, stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:  # --help
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_the_readme_s_cpu_commands_run_in_order(tmp_path, monkeypatch, capsys):
    """In one process, as `main()` (the console script's entry point): a subprocess per command would load torch
    ten times and cost a minute of CI."""
    for key in [k for k in os.environ if k.startswith("RLCORE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("RLCORE_DEMO_MAX_STEPS", "1")  # the README documents it: a demo as a check of the install
    monkeypatch.chdir(tmp_path)
    ran, listed = [], []
    for lang, body, gpu in readme_blocks():
        if lang == "python" and not FILE.match(body):
            assert not gpu
            exec(compile(body, "README.md's Python snippet", "exec"), {"__name__": "readme"})
            capsys.readouterr()
            ran.append("python: the snippet")
            continue
        if lang != "bash":
            continue
        for argv in shell_commands(body):
            if gpu:
                listed.append(shlex.join(argv))
                for i, arg in enumerate(argv[:-1]):
                    if arg == "--config":
                        assert (ROOT / argv[i + 1]).is_file(), f"the README's GPU command names {argv[i + 1]}"
                continue
            if argv[0] != "rlcore":
                installed(argv)
                continue
            out = argv.index(">") if ">" in argv else None
            code, stdout, stderr = rlcore(argv[1:out], capsys)
            assert code == 0, f"README: {shlex.join(argv)}\n{stderr[-3000:]}"
            if out is not None:
                (tmp_path / argv[out + 1]).write_text(stdout)
            ran.append(shlex.join(argv))
            if argv[-1] == "--resume":  # after the run it continues finished: it says so
                assert "is finished" in stderr and "Nothing to resume" in stderr, stderr[-2000:]
    print("ran, in order:", *ran, "GPU commands, listed and not run:", *listed, sep="\n  ")
    assert listed and len(ran) >= 9
    assert (tmp_path / "output" / "grpo-demo" / "final").is_dir() and (tmp_path / "output" / "py-grpo" / "final").is_dir()
    assert (tmp_path / "my.yaml").read_text().startswith("# GRPOConfig")
    assert (tmp_path / "output" / "grpo-demo" / "metrics.png").is_file()
