"""rlcore's log: Python `logging` under the logger "rlcore", on stderr beside the progress bar and, for a run, in
`output_dir/run.log`. Third-party progress bars (transformers' "Loading weights", "Writing model shards") are
off unless the level is debug, and a hook's `print` while the bar runs lands on a line of its own. Python warnings
are records too, each distinct one once; in a run a library's (megatron-core's "Transformer Engine and Apex are
not installed") go to run.log and reach stderr only at debug, while the user's own (a plugin file's) show there too.
A Ray worker's library warnings come back through Ray's forwarded output and are logged the same way.

```python
from rlcore.log import logger
logger.warning("step %d: %s", step, what)        # stderr: "rlcore: warning: step 3: ..."
```
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import os
import re
import site
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("rlcore")
LEVELS = ("debug", "info", "warning", "error")
RUN_LOG = "run.log"
STOP = {"prefix": ""}  # extra= of a warning that says how a run stops: no "warning: " on stderr
BARE = {"bare": True}  # extra= of a line shown as it is on stderr (a step's metrics beside the bar)
_PREFIX = {logging.DEBUG: "debug: ", logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}


class _Stderr(logging.Handler):
    """`rlcore: warning: ...` on the stderr of the moment (a test's capture, the bar-safe stream of `bar_safe`)."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "library", False) and logger.getEffectiveLevel() > logging.DEBUG:
            return  # a library's warning: run.log keeps it
        try:
            text = self.format(record)
            name = "rlcore" if record.name.startswith("rlcore") else record.name
            prefix = getattr(record, "prefix", _PREFIX.get(record.levelno, ""))  # extra=STOP: a stop note
            sys.stderr.write(f"{text}\n" if getattr(record, "bare", False) else f"{name}: {prefix}{text}\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


MASK = "**********"
# userinfo of a URL (scheme://user:password@host, scheme://token@host): a credential wherever it appears
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/@'\"<>]+)@")
# environment variables whose values are secrets: the keys rlcore's plugins read (OPENAI_API_KEY) and the
# tokens of the hub and loggers, by their names' endings
_SECRET_ENV = re.compile(r"(API_KEY|APIKEY|_TOKEN|^TOKEN|SECRET|SECRET_KEY|PASSWORD|PASSWD)$", re.I)
# keys of a config whose values are secrets, whatever their type (a list given for api_key is one too)
SECRET_KEY = re.compile(r"^(\w*_)?(api_key|apikey)$|^(token|hf_token|hub_token|access_token|auth_token|password|passwd|"
                        r"secret|secret_key|access_key|secret_access_key)$", re.I)
MIN_SECRET = 4  # shorter values ("1", "on") are not replaced: they would blank ordinary text


def scrub(text: str) -> str:
    """`text` with every known secret (`redact`, the environment's secret variables) and every URL's
    credentials replaced by MASK."""
    if not text:
        return text
    for secret in sorted(_redact.secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    if _redact.encoded is not None:
        text = _redact.encoded.sub(MASK, text)
    return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{MASK}@", text)


def _encoded_forms(secret: str) -> tuple[set[str], set[str]]:
    """(the URL-encoded forms of `secret`, the cores of its base64 forms): what a library writes for it in a query
    string, a form body or an `Authorization: Basic` header (base64 of user:key, the key at any offset). A core is
    the base64 of the secret's bytes that fill whole 3-byte groups at one of the three alignments, in the standard
    and the URL-safe alphabet, so it is the same whatever precedes the secret; those under 8 characters are left out
    (they would mask ordinary text)."""
    from urllib.parse import quote, quote_plus

    raw = secret.encode()
    cores = set()
    for lead in range(3):
        encoded = base64.b64encode(b"\0" * lead + raw).decode()
        core = encoded[4 * (-(-lead // 3)): 4 * ((lead + len(raw)) // 3)]
        if len(core) >= 8:
            cores |= {core, core.translate(_URLSAFE)}
    return {quote(secret, safe=""), quote_plus(secret, safe="")} - {secret}, cores


_URLSAFE = str.maketrans("+/", "-_")


def scrub_data(value: Any) -> Any:
    """A copy of plain data (dicts, lists, strings) with `scrub` applied to every string, for files rlcore
    writes (a state file's config)."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {k: scrub_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_data(v) for v in value]
    return value


class _Redact(logging.Filter):
    """Secret values (a config's secret keys, the environment's, URL credentials) replaced by MASK in every
    record: its message and its traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()
        self.cores: set[str] = set()  # the secrets' base64 cores (`_encoded_forms`)
        # a core with the up to 3 base64 characters either side that hold the secret's first and last bytes
        self.encoded: re.Pattern[str] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format is logged as it is
            return True
        record.msg, record.args = scrub(text), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


_redact = _Redact()
_stderr = _Stderr()
_stderr.addFilter(_redact)
logger.addHandler(_stderr)  # rlcore's own lines, as before any setup(): info and up, on stderr
logger.setLevel(logging.INFO)
logger.propagate = False


_BAR_SWITCHES = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")
_QUIETED = "RLCORE_QUIETED_BARS"  # which of them rlcore set, so that debug unsets only those


def setup(level: str = "info") -> None:
    """Log at `level` (debug, info, warning, error) to stderr; third-party progress bars off above debug, in
    this process and in the workers it starts (through the environment)."""
    logger.setLevel(level.upper())
    quiet = level.lower() != "debug"
    if quiet:
        for name in _BAR_SWITCHES:
            if name not in os.environ:  # the user's own setting stays
                os.environ[name] = "1"
                os.environ[_QUIETED] = " ".join(filter(None, [os.environ.get(_QUIETED), name]))
    else:  # bars back on where rlcore turned them off (in this process, or in the one that started it)
        for name in os.environ.pop(_QUIETED, "").split():
            os.environ.pop(name, None)
    for module, off, on in (("huggingface_hub.utils", "disable_progress_bars", "enable_progress_bars"),
                            ("transformers.utils.logging", "disable_progress_bar", "enable_progress_bar"),
                            ("datasets.utils.logging", "disable_progress_bar", "enable_progress_bar")):
        if module in sys.modules:  # not imported here: `rlcore --help` stays fast; the environment covers later imports
            getattr(sys.modules[module], off if quiet else on)()


_warned: set[tuple[str, str]] = set()  # (category, text) of the warnings logged so far
_told = False  # whether stderr was told where libraries' warnings go
_hidden = False  # whether a library's warning was kept off stderr
_run_log: Path | None = None  # the run.log open now
_hide_libraries = False  # a library's warnings off stderr above debug (a run, whose run.log keeps them)


def route_warnings(hide_libraries: bool = False) -> None:
    """From now on Python warnings are records of `rlcore.warnings`, each distinct one once; with `hide_libraries`
    (the CLI's `run`: run.log keeps them) a library's reach stderr only at debug."""
    global _hide_libraries
    _hide_libraries = hide_libraries
    warnings.showwarning = _log_warning


def _log_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
    if file is not None:  # a caller that names its stream gets Python's own
        warnings._showwarning_orig(message, category, filename, lineno, file, line)  # type: ignore[attr-defined]
        return
    where, library = _origin(filename)
    _say(category.__name__, f"{where}:{lineno}", str(message), library)


def _say(category: str, where: str, message: str, library: bool) -> None:
    """Log a warning once per distinct (category, text); a library's off stderr where run.log keeps it."""
    global _hidden
    if (category, message) in _warned:
        return
    _warned.add((category, message))
    library = library and _hide_libraries  # elsewhere nothing keeps them but stderr
    logger.getChild("warnings").warning("%s from %s: %s", category, where, message, extra={"library": library})
    _hidden = _hidden or library
    _tell()


def _tell() -> None:
    """Once run.log is open and holds a library's warning kept off stderr, say so on stderr (at info)."""
    global _told
    if _hidden and not _told and _run_log is not None and logger.getEffectiveLevel() == logging.INFO:
        _told = True
        logger.info(f"libraries' warnings are written to {_run_log} only; --log-level debug shows them here too")


LIBRARY_LINE = "rlcore: library warning: "  # a Ray worker's line for a library's warning, which the driver logs
_LIBRARY_TEXT = re.compile(r"(\w+) from (.+?:\d+): (.*)")


def route_worker_warnings() -> None:
    """In a Ray worker: each distinct warning once on its stderr, which Ray forwards to the driver; a library's as
    a LIBRARY_LINE, which the driver's log takes out of Ray's output (`take_worker_lines`), the user's as rlcore's
    warning line, shown as it is."""
    warnings.showwarning = _worker_warning


def _worker_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: Any = None, line: str | None = None) -> None:
    if file is not None:
        warnings._showwarning_orig(message, category, filename, lineno, file, line)  # type: ignore[attr-defined]
        return
    key = (category.__name__, str(message))
    if key in _warned:
        return
    _warned.add(key)
    where, library = _origin(filename)
    text = scrub(" ".join(str(message).split()) if library else str(message))  # one line, for the driver to read back
    sys.stderr.write(f"{LIBRARY_LINE if library else 'rlcore: warning: '}{category.__name__} from {where}:{lineno}: "
                     f"{text}\n")
    sys.stderr.flush()


def take_worker_lines(data: dict[str, Any]) -> None:
    """A batch of a Ray worker's output, before Ray prints it: a library's warning leaves the batch and is logged
    here as one of the driver's own (run.log; stderr at debug), once however many workers said it; every other
    line is printed with its secrets masked (`scrub`: a hook's print of its API key, a URL's credentials)."""
    lines = data.get("lines") or []
    kept = []
    for line in lines:
        said = _LIBRARY_TEXT.fullmatch(line[len(LIBRARY_LINE):]) if line.startswith(LIBRARY_LINE) else None
        if said:
            _say(said[1], said[2], said[3], library=True)
        else:
            kept.append(scrub(line))
    if kept != lines:
        data["lines"] = kept


def _origin(filename: str) -> tuple[str, bool]:
    """Where a warning came from, shortened, and whether that is a library's code (the standard library, an
    installed package, rlcore's own modules) rather than the user's (a plugin file, a script)."""
    if filename.startswith("<"):
        return filename, filename.startswith("<frozen ")
    path = os.path.abspath(filename)
    for root, base in _library_roots():
        if path.startswith(root + os.sep):
            return os.path.relpath(path, base), True
    cwd = os.getcwd()
    return (os.path.relpath(path, cwd) if path.startswith(cwd + os.sep) else path), False


@functools.lru_cache(maxsize=1)
def _library_roots() -> list[tuple[str, str]]:
    """(folder, what a path in it is shown relative to): rlcore's packages (an editable install's too),
    site-packages and the standard library, the longest first so a path is shortened to its package."""
    import importlib.util

    roots = {(str(Path(__file__).parent), str(Path(__file__).parent.parent))}
    for name in ("rlcore.plugins", "rlcore.contrib"):
        with contextlib.suppress(ImportError, ValueError, AttributeError):
            for folder in importlib.util.find_spec(name).submodule_search_locations:
                roots.add((folder, str(Path(folder).parent)))
    sites = site.getsitepackages() + [site.getusersitepackages()]
    sites += [sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")]
    # PYTHONPATH's folders hold installed packages too (`pip install --target DIR`, as the GPU kit installs
    # megatron-core and vLLM); the working directory, where a user's own files are, stays theirs
    cwd = os.path.abspath(os.getcwd())
    sites += [folder for folder in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if folder and os.path.abspath(folder) != cwd]
    roots.update((folder, folder) for folder in sites)
    return sorted({(os.path.abspath(r), os.path.abspath(b)) for r, b in roots}, key=lambda rb: len(rb[0]), reverse=True)


def redact(values: Iterable[str]) -> None:
    """Never log these strings (API keys), nor their URL-encoded or base64 forms: every record has them replaced."""
    for value in values:
        if isinstance(value, str) and len(value) >= MIN_SECRET and value not in _redact.secrets:
            quoted, cores = _encoded_forms(value)
            _redact.secrets.update({value, *quoted})
            _redact.cores |= cores
    if _redact.cores:
        alternatives = "|".join(re.escape(c) for c in sorted(_redact.cores, key=len, reverse=True))
        _redact.encoded = re.compile(rf"[A-Za-z0-9+/_-]{{0,3}}(?:{alternatives})[A-Za-z0-9+/_=-]{{0,3}}")


def env_secrets(environ: Any = None) -> list[str]:
    """The values of the environment's secret variables (OPENAI_API_KEY, HF_TOKEN, WANDB_API_KEY, ...)."""
    environ = os.environ if environ is None else environ
    return [v for k, v in environ.items() if _SECRET_ENV.search(k) and v and v.upper() not in ("EMPTY", "NONE")]


def secrets_in_data(data: Any, secret: bool = False) -> list[str]:
    """Every value under a secret key (api_key, hf_token, ...) of raw config data, whatever its type (a
    list, a number), and the credentials inside URLs anywhere in it: registered before the config is
    validated, so an error about the value cannot show it."""
    found: list[str] = []
    if isinstance(data, dict):
        for k, v in data.items():
            found += secrets_in_data(v, secret or bool(SECRET_KEY.search(str(k).rsplit(".", 1)[-1])))
    elif isinstance(data, (list, tuple)):
        for v in data:
            found += secrets_in_data(v, secret)
    elif secret and data is not None:
        found.append(str(data))
    elif isinstance(data, str):
        for match in _URL_CREDENTIALS.finditer(data):
            found += [match["userinfo"], *match["userinfo"].split(":", 1)[1:]]
    return found


def secrets_of(config: Any) -> list[str]:
    """The values of `config`'s SecretStr keys, nested sections included, and the credentials of the URLs
    it holds."""
    from pydantic import BaseModel, SecretStr

    found: list[str] = []
    if isinstance(config, BaseModel):
        for name in type(config).model_fields:
            value = getattr(config, name, None)
            if isinstance(value, SecretStr):
                found.append(value.get_secret_value())
            elif isinstance(value, BaseModel):
                found += secrets_of(value)
            else:
                found += secrets_in_data(value, bool(SECRET_KEY.search(name)))
    return found


def open_own(path: str | os.PathLike, mode: str = "a", buffering: int = -1) -> Any:
    """One of rlcore's own files in output_dir opened to append ("a", "ab"), never through a symbolic link (one
    there could point at a user's file): RlcoreError naming the path instead."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        if os.path.islink(path):
            from .errors import RlcoreError

            raise RlcoreError(f"{path} is a symbolic link; rlcore never writes its own files through one (it could "
                              f"point at a file of yours): remove the link, or choose another output_dir") from None
        raise
    return os.fdopen(fd, mode, buffering, **({} if "b" in mode else {"encoding": "utf-8"}))


class _OwnFileHandler(logging.FileHandler):
    """run.log, appended to without following a symbolic link (`open_own`). A write it cannot make (a full disk, a
    file size limit) is said once on stderr, in one line, and the file is left as it is: no "--- Logging error ---"
    traceback for each record."""

    failed = False

    def _open(self) -> Any:
        return open_own(self.baseFilename, "a")

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if self.failed or not isinstance(error, OSError):
            return super().handleError(record) if not self.failed else None
        self.failed = True
        sys.stderr.write(f"rlcore: warning: cannot write {self.baseFilename}: {error.strerror or error}; run.log "
                         "ends here\n")

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the last flush on a full disk: said in handleError, or nothing was left to write
            self.stream = None


class _Held(logging.Handler):
    """What is logged before a run's `run.log` opens (the config's notes, the checks before the lock), kept to
    be written there first."""

    LIMIT = 1000  # records; a run logs a few dozen before its lock

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.LIMIT:
            self.records.append(record)


_held: _Held | None = None


def hold() -> None:
    """Keep every record from now until the next `to_file`, which writes them first (the CLI's `run`)."""
    global _held
    if _held is not None:
        logger.removeHandler(_held)
    _held = _Held()
    _held.addFilter(_redact)
    logger.addHandler(_held)


@contextlib.contextmanager
def to_file(output_dir: str | os.PathLike) -> Iterator[Path]:
    """Append the log to `output_dir/run.log` for the block (timestamped, every level the logger passes); an
    exception that ends the block is logged there too, so the file says how the run ended."""
    global _held, _run_log, last_detail
    path = _run_log = Path(output_dir) / RUN_LOG
    last_detail = None
    handler = _OwnFileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_redact)
    logger.addHandler(handler)

    def note(level: int, text: str) -> None:  # to the file only
        handler.handle(logger.makeRecord(logger.name, level, __file__, 0, text, None, None))

    note(logging.INFO, f"run of pid {os.getpid()}: {' '.join(sys.argv)}")
    if _held is not None:  # what was logged before the run took its output_dir
        logger.removeHandler(_held)
        for record in _held.records:
            if record.levelno >= logger.getEffectiveLevel():
                handler.handle(record)
        _held = None
    _tell()  # a library's warning said before the run took its output_dir is in run.log now
    try:
        yield path
    except BaseException as exc:
        note(logging.ERROR, f"run ended by {type(exc).__name__}" + (f": {exc}" if str(exc) else ""))
        detail = failure_detail(exc)
        if detail:
            note(logging.ERROR, detail)
            last_detail = path
        raise
    finally:
        logger.removeHandler(handler)
        handler.close()
        _run_log = None


last_detail: Path | None = None  # the run.log that holds the traceback of the last run's failure


def failure_detail(exc: BaseException) -> str:
    """What run.log keeps of an exception that ended a run, beyond its message: a worker's traceback (formatted in
    the worker, `rlcore.failures`), or the traceback of an exception that is not rlcore's own; else ''."""
    from .errors import RlcoreError
    from .failures import failure_of

    failure = failure_of(exc)
    if failure is not None and failure.traceback:
        return scrub(f"{failure.where()}, in {failure.method}():\n{failure.traceback.rstrip()}")
    if isinstance(exc, Exception) and not isinstance(exc, RlcoreError):
        return scrub("".join(traceback.format_exception(exc)).rstrip())
    return ""


class _BarSafe:
    """A text stream whose complete lines are written with the bar cleared first and redrawn after, so a
    `print` from a hook (or a worker's output that Ray forwards) never lands inside the bar's line."""

    def __init__(self, stream: Any, bar: Any):
        self._stream, self._bar, self._pending = stream, bar, ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            done, self._pending = self._pending.rsplit("\n", 1)
            self._emit(done + "\n")
        return len(text)

    def _emit(self, text: str) -> None:
        self._bar.clear()
        self._stream.write(scrub(text))
        self._stream.flush()
        self._bar.refresh()

    def flush(self) -> None:
        if self._pending:
            text, self._pending = self._pending, ""
            self._emit(text + "\n")
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def bar_safe(bar: Any) -> Iterator[None]:
    """stdout and stderr write around `bar` for the block."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _BarSafe(sys.stdout, bar), _BarSafe(sys.stderr, bar)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved
