"""A worker's failure as one line: where it happened (role, rank, node, pid), the original exception's type and
message, and the advice rlcore has for it; the worker's traceback rides along for run.log.

A worker's exception is summarised where it was raised (`capture`), so its type, message and traceback reach the
driver as plain text even when the exception itself cannot be pickled (a pydantic ValidationError holding vLLM's
arguments): a Ray actor raises `RoleFailed` carrying the `Failure`, an in-process worker's exception is `tag`ged
with it and propagates as itself. The CLI prints `Failure.line()` and `advice()`; `rlcore.log` writes the
traceback to run.log.
"""

from __future__ import annotations

import os
import re
import socket
import traceback as tb
from dataclasses import dataclass
from typing import Any

from .errors import RoleFailed

SUMMARY_CHARS = 1000  # a message longer than this is cut on the terminal; run.log has it whole
_TAG = "_rlcore_failure"  # attribute of an in-process worker's exception: its Failure


@dataclass(frozen=True)
class Failure:
    """What a worker raised and where, as plain text (picklable whatever the exception was)."""

    role: str
    rank: int | None
    node: str
    pid: int | None
    method: str
    type: str  # the original exception's class name, e.g. ValidationError
    summary: str  # its message on one line (a ValidationError's errors, each with its location)
    message: str  # str() of the exception, whole
    traceback: str  # formatted in the worker, where it was raised

    def where(self) -> str:
        pid = f" (pid {self.pid})" if self.pid else ""
        return f"role '{self.role}' rank {self.rank} on node {self.node or '?'}{pid}"

    def line(self) -> str:
        """"role 'rollout' rank 0 on node 10.0.0.2 (pid 7) raised ValidationError in __init__(): ..." """
        return f"{self.where()} raised {self.type} in {self.method}(): {self.summary}"


def capture(exc: BaseException, *, role: str, rank: int | None, node: str | None = None, pid: int | None = None,
            method: str) -> Failure:
    """`exc` summarised where it was raised; `node` defaults to this host's name, `pid` to this process."""
    return Failure(
        role=role, rank=rank, node=socket.gethostname() if node is None else node,
        pid=os.getpid() if pid is None else pid, method=method, type=type(exc).__name__,
        summary=summarize(exc), message=_text(exc), traceback="".join(tb.format_exception(exc)),
    )


def summarize(exc: BaseException) -> str:
    """The exception's message on one line: a ValidationError's errors as `loc: msg` (without the inputs, which
    may be a whole config), anything else's str() with its whitespace collapsed; cut at SUMMARY_CHARS."""
    from pydantic_core import ValidationError

    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        each = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"] for e in errors)
        text = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''} for {exc.title}: {each}"
    else:
        text = _text(exc) or "(no message)"
    text = " ".join(text.split())
    return text if len(text) <= SUMMARY_CHARS else text[:SUMMARY_CHARS] + " [...]"


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails still gets reported
        return repr(exc)


def raised(exc: BaseException, *, role: str, rank: int | None, node: str, method: str) -> RoleFailed:
    """In a Ray actor: the RoleFailed that stands for `exc` (one already standing for a worker's is kept)."""
    if failure_of(exc) is not None and isinstance(exc, RoleFailed):
        return exc
    failure = capture(exc, role=role, rank=rank, node=node, method=method)
    return RoleFailed(failure.line(), role=role, rank=rank, node=failure.node, failure=failure)


def tag(exc: BaseException, *, role: str, method: str) -> None:
    """Mark an in-process worker's exception with its Failure (rank 0, this host); the innermost mark stays."""
    if failure_of(exc) is None:
        try:
            setattr(exc, _TAG, capture(exc, role=role, rank=0, method=method))
        except AttributeError:  # an exception without attributes of its own: it propagates unmarked
            pass


def failure_of(exc: BaseException) -> Failure | None:
    """The worker failure `exc` stands for: a RoleFailed's, or an in-process worker's tagged exception's."""
    if isinstance(exc, RoleFailed):
        return getattr(exc, "failure", None)  # Ray's copy of a worker's RoleFailed is made without __init__
    return getattr(exc, _TAG, None)


# -------------------------------------------------------------------------
# advice: the one line rlcore can add where it knows the fix
# -------------------------------------------------------------------------

_OOM = re.compile(r"\bout of memory\b|OutOfMemoryError", re.I)
_NCCL_TIMEOUT = re.compile(r"collective operation timeout|NCCL.*timed? ?out|timed? ?out.*NCCL|ProcessGroupNCCL.*timeout",
                           re.I)
_NCCL = re.compile(r"\bNCCL error\b|\bnccl\w*Error\b|NCCL communicator", re.I)
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


def advice(failure: Failure, plugins: Any = None) -> str:
    """One line saying what to change for a failure rlcore knows: an engine's own (`EngineSpec.advice`: vLLM's
    context longer than the model's, no room for its KV cache), else the GPU out of memory, an NCCL timeout or
    error, a missing module; '' where none knows one."""
    role, text = failure.role, f"{failure.type}: {failure.message}"
    if plugins is None:
        from . import manager

        plugins = manager.plugins()
    seen = set()
    for spec in plugins.engines:
        if spec.advice is not None and spec.advice not in seen:
            seen.add(spec.advice)
            said = spec.advice(failure)
            if said:
                return said
    if _OOM.search(text):
        return (f"the GPU ran out of memory: lower {role}.vllm_gpu_memory_utilization where vLLM shares the GPU, or "
                f"per_device_train_batch_size (the micro-batch); or set offload_model=true offload_optimizer=true "
                f"(colocated roles) or train.gradient_checkpointing=true")
    if _NCCL_TIMEOUT.search(text):
        return (f"a collective of role '{role}' timed out: a peer rank failed or stalled first (run.log has each "
                f"rank's error), or it is only slow: raise {role}.engine_kwargs.dist_timeout_s (600 by default)")
    if _NCCL.search(text):
        return ("an NCCL collective failed: a peer rank that failed first is the usual cause (run.log); "
                "NCCL_DEBUG=INFO in the environment says more")
    if match := _NO_MODULE.search(text):
        return _install(match[1])
    return ""


def _install(module: str) -> str:
    from .extras import EXTRAS

    for extra, modules in EXTRAS.items():
        if any(module == m or module.startswith(m + ".") or m.startswith(module + ".") for m in modules):
            return f"{module} is not installed where the worker runs: pip install 'rlcore[{extra}]'"
    return f"{module} is not installed where the worker runs (on every Ray node): pip install the package that provides it"
