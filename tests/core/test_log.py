"""rlcore's log (core/log.py) as a user meets it through `python -m rlcore run`: the level (--log-level,
log_level), output_dir/run.log, third-party progress bars off unless debug, a hook's print on a line of its
own beside the bar, Python warnings as records (a library's in run.log, on stderr only at debug), one metric name
for the learning rate, and no secret in the log."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


def rlcore(cwd: Path, *args: str, **options) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    for name in os.environ.get("RLCORE_QUIETED_BARS", "").split():  # set by an in-process run of another test
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "rlcore", *args], cwd=cwd, env=env, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, **({"capture_output": True} | options))


NOISY = """
import warnings

import numpy
from rlcore import hookimpl

warnings.warn("noisy.py's own warning")  # the user's code: on stderr too

@hookimpl
def rlcore_step_end(trainer, step, metrics):
    numpy.mean([])  # a library's RuntimeWarning ("Mean of empty slice"), at every step
"""


def test_info_by_default_into_run_log_with_what_came_before_and_no_third_party_bars_or_warnings(tmp_path):
    """One run: the level (info), run.log with what was said before the run took its output_dir (the config's
    notes come before the lock on output_dir), no third-party bars, a library's warnings in run.log only."""
    (tmp_path / "noisy.py").write_text(NOISY)
    done = rlcore(tmp_path, "run", "--plugin", "grpo", "--with", "./noisy.py", "output_dir=out", "max_steps=2",
                  "logging_steps=1", "attn_implementation=sdpa")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[0].startswith('{"algorithm": "grpo"')
    said = done.stderr.splitlines()
    own = "rlcore: warning: UserWarning from noisy.py:7: noisy.py's own warning"
    note = "rlcore: TRL's attn_implementation: 'sdpa' (the engine picks its attention kernel"
    assert said[0] == own and said[1].startswith(note)
    assert said[2] == "rlcore: train: 1 worker, in this process, engine hf, float32"  # dtype auto on the CPU
    assert "Loading weights" not in done.stderr and "Writing model shards" not in done.stderr
    assert "Mean of empty slice" not in done.stderr and "RuntimeWarning" not in done.stderr
    assert done.stderr.count("rlcore: libraries' warnings are written to out/run.log only; --log-level debug") == 1
    log = (tmp_path / "out" / "run.log").read_text()
    lines = log.splitlines()
    assert "INFO rlcore: run of pid" in lines[0]
    assert f"WARNING {own.replace('rlcore: warning:', 'rlcore.warnings:')}" in lines[1] and f"INFO {note}" in lines[2]
    assert sum(note in line for line in lines) == 1
    for line in ("INFO rlcore: train: 1 worker, in this process, engine hf", "INFO rlcore: grpo step 1/2: reward=",
                 "INFO rlcore: grpo step 2/2: reward=", "INFO rlcore: the trained model (step 2) is in out/final",
                 "WARNING rlcore.warnings: RuntimeWarning from numpy/"):
        assert line in log
    assert log.count("Mean of empty slice") == 1  # each distinct warning once, though both steps warned
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all("learning_rate" in row and "lr" not in row for row in rows)  # SFT's name, TRL's too


def test_outside_a_run_warnings_are_rlcore_lines_each_once_a_librarys_too(tmp_path):
    """`config show` has no run.log to keep a library's warnings: stderr shows them, as rlcore's lines."""
    (tmp_path / "loud.py").write_text("import warnings\n\nimport numpy\n\nwarnings.warn('loud.py warns')\n"
                                      "numpy.mean([])\nnumpy.mean([])\n")
    done = rlcore(tmp_path, "config", "show", "--plugin", "grpo", "--with", "./loud.py")
    assert done.returncode == 0 and done.stdout.startswith("# GRPOConfig"), done.stderr
    said = done.stderr.splitlines()
    assert said[0] == "rlcore: warning: UserWarning from loud.py:5: loud.py warns"
    assert said[1].startswith("rlcore: warning: RuntimeWarning from numpy/") and said[1].endswith(": Mean of empty slice")
    assert "numpy" in said[2]  # numpy's second warning of the same call; the repeat call: none
    assert said[3:] == ["rlcore: the grpo demo preset: what `rlcore run --plugin grpo` uses without --config or a model"]


def test_log_level_warning_keeps_stderr_and_run_log_to_warnings(tmp_path):
    done = rlcore(tmp_path, "run", "--plugin", "grpo", "output_dir=out", "max_steps=1", "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rlcore: train:" not in done.stderr and "final" not in done.stderr
    log = (tmp_path / "out" / "run.log").read_text().splitlines()
    assert len(log) == 1 and "INFO rlcore: run of pid" in log[0]  # the header only: no info line passed
    config = rlcore(tmp_path, "run", "--plugin", "grpo", "output_dir=out2", "max_steps=1", "log_level=warning")
    assert config.returncode == 0 and "rlcore: train:" not in config.stderr


HOOK = """

import numpy
from rlcore import hookimpl

@hookimpl
def rlcore_step_end(trainer, step, metrics):
    print(f"hook says {step}")
    numpy.mean([])
"""


def test_a_hooks_print_lands_on_a_line_of_its_own_beside_the_bar_and_debug_shows_bars_and_warnings(tmp_path):
    (tmp_path / "hook.py").write_text(HOOK)
    done = rlcore(tmp_path, "run", "--plugin", "grpo", "--with", "./hook.py", "output_dir=out", "max_steps=3",
                  "--log-level", "debug", capture_output=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-2000:]
    shown = [line.rsplit("\r", 1)[-1] for line in done.stdout.split("\n")]  # what a terminal shows of each line
    assert [line for line in shown if "hook says" in line] == ["hook says 1", "hook says 2", "hook says 3"]
    assert "Loading weights" in done.stdout  # debug: transformers' own bars too
    warned = [line for line in shown if "Mean of empty slice" in line]  # and libraries' warnings, each once
    assert len(warned) == 1 and warned[0].startswith("rlcore: warning: RuntimeWarning from numpy/"), warned
    assert "libraries' warnings are written to" not in done.stdout


class _Refusing(BaseHTTPRequestHandler):
    """An OpenAI-style endpoint that refuses the key and echoes it in its error, as some servers do."""

    def do_POST(self):
        key = self.headers.get("Authorization", "").removeprefix("Bearer ")
        body = json.dumps({"error": {"message": f"Incorrect API key provided: {key}", "type": "invalid_request_error"}})
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_an_api_key_never_reaches_stderr_or_run_log(tmp_path, refusing_endpoint):
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "Q?"}]}\n')
    secret = "sk-test-SECRET-1234"
    done = rlcore(tmp_path, "run", "--plugin", "distill", f"api_base={refusing_endpoint}", "model=t", "dataset=d.jsonl",
                  f"api_key={secret}", "output_dir=out", "max_retries=0")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("rlcore: error: the teacher t at")
    assert "Incorrect API key provided: **********" in done.stderr
    log = (tmp_path / "out" / "run.log").read_text()
    assert "Incorrect API key provided: **********" in log and "api_key=**********" in log
    assert secret not in done.stderr + done.stdout + log


def _everything_written(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())


@pytest.mark.parametrize("given", ["environment", "url", "list"])
def test_a_key_from_the_environment_a_url_or_a_list_never_reaches_stderr_or_a_file(tmp_path, refusing_endpoint,
                                                                                   given):
    """The key in OPENAI_API_KEY (echoed back inside the endpoint's error), as the credentials of api_base
    (user:key@host, in run.log and the state file), or given as a list (a validation error about it): never
    on stderr, stdout or in any file of output_dir, at debug level too (tracebacks)."""
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "Q?"}]}\n')
    secret = "sk-test-ENV-5678"
    base = refusing_endpoint
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLCORE_")}
    args = ["run", "--plugin", "distill", "model=t", "dataset=d.jsonl", "output_dir=out", "max_retries=0",
            "--log-level", "debug"]
    if given == "environment":
        env["OPENAI_API_KEY"] = secret
    elif given == "url":
        base = base.replace("http://", f"http://someone:{secret}@")
    else:
        (tmp_path / "c.yaml").write_text(f"api_key: [{secret}]\nmodel: t\ndataset: d.jsonl\n")
        args = ["config", "validate", "--plugin", "distill", "--config", "c.yaml"]
    done = subprocess.run([sys.executable, "-m", "rlcore", *args, f"api_base={base}"], cwd=tmp_path, env=env,
                          text=True, timeout=300, stdin=subprocess.DEVNULL, capture_output=True)
    said = done.stdout + done.stderr + _everything_written(tmp_path / "out")
    assert secret not in said, said[-3000:]
    if given == "list":
        assert done.returncode == 2 and "api_key" in done.stderr, done.stderr
    else:
        assert done.returncode == 1 and "rlcore: error: the teacher t at" in done.stderr, done.stderr[-2000:]
        assert "**********" in said
        if given == "environment":
            assert "Incorrect API key provided: **********" in done.stderr
        else:
            assert "someone" not in said and "http://**********@127.0.0.1" in (tmp_path / "out" / "run.log").read_text()


def test_scrub_hides_known_secrets_url_credentials_and_tracebacks(monkeypatch):
    from rlcore import log

    monkeypatch.setattr(log._redact, "secrets", set())
    log.redact(log.env_secrets({"HF_TOKEN": "hf_abcdef", "WANDB_API_KEY": "w4ndb", "PATH": "/usr/bin",
                                "OPENAI_API_KEY": "EMPTY"}))
    log.redact(log.secrets_in_data({"api_key": ["sk-a1", {"x": 12345}], "reward": {"hf_token": "tok-9"},
                                    "api_base": "https://u:pw-77@h/v1", "model": "m"}))
    assert log._redact.secrets == {"hf_abcdef", "w4ndb", "sk-a1", "12345", "tok-9", "u:pw-77", "pw-77",
                                   "u%3Apw-77"}  # and its URL-encoded form
    assert log.scrub("hf_abcdef in https://x:y@host/a and ssh://tok@h") == "********** in https://**********@host/a and ssh://**********@h"
    assert log.scrub_data({"a": ["sk-a1", 3], "b": "tok-9!"}) == {"a": ["**********", 3], "b": "**********!"}
    record = logging.LogRecord("rlcore", logging.ERROR, __file__, 1, "failed: %s", ("w4ndb",), None)
    try:
        raise ValueError("the key tok-9 was refused")
    except ValueError:
        record.exc_info = sys.exc_info()
    log._redact.filter(record)
    text = logging.Formatter().format(record)
    assert "failed: **********" in text and "the key ********** was refused" in text and "tok-9" not in text



def test_a_secret_in_base64_or_url_encoded_never_reaches_stderr_run_log_or_metrics(tmp_path, monkeypatch):
    """A server echoing `Authorization: Basic base64(user:key)`, a key in a query string or a form body: masked
    in every record and in metrics.jsonl, whatever precedes the key inside the base64."""
    import base64
    import json
    from urllib.parse import quote, quote_plus

    from rlcore import log
    from rlcore.metrics import MetricsWriter

    for name in ("secrets", "cores"):
        monkeypatch.setattr(log._redact, name, set())
    monkeypatch.setattr(log._redact, "encoded", None)
    key = "sk-pr0j/Ab+c d&e=f?g"
    log.redact([key])
    said = []
    for user in ("", "u", "us", "someone"):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            said.append(f"401: Authorization: Basic {encode(f'{user}:{key}'.encode()).decode()} was refused")
    said += [f"GET /v1?api_key={quote(key, safe='')}&x=1", f"body: key={quote_plus(key)}",
             f"raw {base64.b64encode(key.encode()).decode()}"]
    record = logging.LogRecord("rlcore", logging.ERROR, __file__, 1, "%s", ("\n".join(said),), None)
    log._redact.filter(record)
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    metrics.write({"step": 1, "error": "\n".join(said)})
    for text in (record.getMessage(), json.loads((tmp_path / "metrics.jsonl").read_text())["error"]):
        assert text.count(log.MASK) == len(said), text
        for token in text.replace(log.MASK, " ").split():
            for decode in (base64.b64decode, base64.urlsafe_b64decode):
                with contextlib.suppress(ValueError):
                    assert b"pr0j" not in decode(token + "=="), (token, text)
        assert "pr0j" not in text and "Ab%2Bc" not in text
    assert log.scrub("Basic dXNlcjpvdGhlcg== stays") == "Basic dXNlcjpvdGhlcg== stays"  # user:other is no secret


def test_a_ray_workers_forwarded_lines_are_scrubbed_before_ray_prints_them(monkeypatch):
    """Ray forwards a worker's prints to the driver's stdout; the driver's hook (`take_worker_lines`, installed in
    Ray's dispatcher by rlcore.runtime.cluster) masks the run's secrets in them and lets other lines through."""
    from rlcore import log

    monkeypatch.setattr(log._redact, "secrets", set())
    log.redact(["sk-worker-7781"])
    data = {"lines": ["reward call with key sk-worker-7781", "POST https://user:pw@host/v1", "step 3 done"]}
    log.take_worker_lines(data)
    assert data["lines"] == ["reward call with key **********", "POST https://**********@host/v1", "step 3 done"]
    plain = {"lines": ["nothing secret"]}
    log.take_worker_lines(plain)
    assert plain == {"lines": ["nothing secret"]}


def test_debug_turns_back_on_only_the_bars_rlcore_turned_off(monkeypatch):
    """A run at info turns third-party bars off through the environment, which the processes it starts inherit
    (a test's in-process run, a worker); `--log-level debug` there turns them back on, and a user's own switch
    stays as it was."""
    from rlcore import log

    for name in (*log._BAR_SWITCHES, log._QUIETED):
        monkeypatch.delenv(name, raising=False)
    log.setup("info")
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
    log.setup("debug")
    assert not {*log._BAR_SWITCHES, log._QUIETED} & set(os.environ)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the user's
    log.setup("info")
    log.setup("debug")
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ
    log.setup("info")  # as the suite's other tests leave it


def test_a_package_on_pythonpath_counts_as_a_librarys_code(tmp_path, monkeypatch):
    """`pip install --target DIR` + PYTHONPATH (how the GPU kit installs megatron-core and vLLM): a warning from
    there is a library's, kept to run.log; a file of the user's elsewhere is theirs."""
    from rlcore import log

    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    log._library_roots.cache_clear()
    try:
        where, library = log._origin(str(tmp_path / "site" / "megatron" / "core" / "optimizer.py"))
        assert (where, library) == (os.path.join("megatron", "core", "optimizer.py"), True)
        assert log._origin(str(tmp_path / "my_plugin.py")) == (str(tmp_path / "my_plugin.py"), False)
    finally:
        log._library_roots.cache_clear()
