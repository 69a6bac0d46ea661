"""One exception family: everything rlcore raises on purpose is an `RlcoreError`.

Usage and configuration mistakes (`ConfigError`, `PluginError`) make the CLI exit with status 2 and a
one-paragraph message; failures at run time (`ResourceError`, `RoleFailed`, ...) exit with status 1.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class RlcoreError(Exception):
    """Base of every error rlcore raises on purpose."""

    exit_code = 1


class ConfigError(RlcoreError):
    """A configuration is invalid. `problems` holds one `(key path, message)` pair per mistake."""

    exit_code = 2

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


class PluginError(RlcoreError):
    """A plugin failed to load, registered a name twice, or a name is not registered."""

    exit_code = 2


class NotRegistered(PluginError, KeyError):
    """A name was asked of a registry that does not hold it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ResourceError(RlcoreError):
    """The cluster cannot give what a resource plan asks for, or did not in time."""


class RoleFailed(RlcoreError):
    """A worker of a role died or raised; the message names role, rank, node and cause. `failure` (an
    `rlcore.failures.Failure`) is what the worker raised, as text: type, message and traceback."""

    def __init__(self, message: str, *, role: str = "", rank: int | None = None, node: str = "",
                 failure: Any = None):  # errors sit below failures, which builds on them: not typed here
        super().__init__(message)
        self.role, self.rank, self.node, self.failure = role, rank, node, failure


class RoleRestarted(RoleFailed):
    """A worker of a role that holds training state died and Ray restarted the role's workers (`max_restarts`): they
    were built again as the run started them, so what they had trained is gone; the trainer resumes the run from its
    last checkpoint, in the same run."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' Did you mean 'x'?' for the closest known name, or '' when nothing is close."""
    match = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f" Did you mean '{match[0]}'?" if match else ""
