"""Paths given to rlcore (options, config keys, environment variables) checked for their kind before use: a file
where a file is read, a writable folder where one is written, each refusal one line naming what gave the path
(`--config`, `dataset_cache_dir`, `RLCORE_DATA_CACHE`). A FIFO or a device is never opened (a read would block or
never end)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ConfigError


def read_regular_file(path: str | os.PathLike, what: str, kind: str, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes; else a `ConfigError` of one line naming `what`
    (the option or key) and the path: missing, a folder, a FIFO or a device (never opened: a FIFO would block),
    unreadable, or too large."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: does not exist; give {kind}") from None
    except NotADirectoryError:
        raise ConfigError(f"{what} {path}: does not exist (a part of its path is a file, not a folder); give {kind}") \
            from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}; give {kind}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{what} {path}: is {file_kind(mode)}, not a file; give {kind}")
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot be read ({exc.strerror or exc}); give {kind}") from None
    if len(raw) > limit:
        raise ConfigError(f"{what} {path}: is over rlcore's limit of {limit >> 20} MiB for {kind}; give a smaller one")
    return raw


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words ("a folder", "a FIFO (named pipe)", "a character device")."""
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((word for test, word in kinds if test(mode)), "not a regular file")



def folder_problem(path: str | os.PathLike) -> str | None:
    """Why rlcore cannot keep files in the folder `path` (made if missing), or None: it is a file, a FIFO or a
    device, or it (or, missing, its nearest existing parent) is not a writable folder."""
    here = Path(path).expanduser()
    try:
        mode = os.stat(here).st_mode
    except (FileNotFoundError, NotADirectoryError):
        parent = next((p for p in here.absolute().parents if os.path.lexists(p)), None)
        if parent is None or not parent.is_dir():
            return f"cannot be made: {parent} is not a folder"
        return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be made: {parent} is not writable"
    except OSError as exc:
        return str(exc.strerror or exc)
    if not stat.S_ISDIR(mode):
        return f"is {file_kind(mode) if not stat.S_ISREG(mode) else 'a file'}, not a folder"
    return None if os.access(here, os.W_OK | os.X_OK) else "is a folder this user cannot write to"


def writable_folder(path: str | os.PathLike, what: str) -> Path:
    """The folder `path`, made if missing; else a `ConfigError` of one line naming `what` gave it and why."""
    problem = folder_problem(path)
    if problem is None:
        try:
            Path(path).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problem = f"cannot be made ({exc.strerror or exc})"
    if problem is not None:
        raise ConfigError(f"{what} {path}: {problem}; give a writable folder")
    return Path(path).expanduser()


__all__ = ["file_kind", "folder_problem", "read_regular_file", "writable_folder"]
