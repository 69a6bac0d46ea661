"""ModelScope dataset ids (ms-swift's default hub: `dataset: AI-ModelScope/alpaca-gpt4-data-zh#2000`), read through
the `modelscope` package where it is installed: the dataset's data files are downloaded into ModelScope's cache and
the train split's file stands in for the id, `#N` still taking its first N rows. Without the package, or offline,
one line says how to get the file."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from urllib.parse import urlparse

from ..data import FORMATS, dataset_file, split_files
from ..errors import ConfigError

MODELSCOPE_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as ModelScope spells a dataset


def is_modelscope_id(dataset: str) -> bool:
    """`dataset` (its `#N` aside) is no local file or folder but is spelled as a ModelScope id."""
    file, _ = dataset_file(dataset)
    if file.suffix.lower() in FORMATS or not MODELSCOPE_ID.match(str(file)):
        return False  # the spelling first: a path the file system refuses (a name too long) is the dataset check's
    return not file.exists()


def modelscope_dataset(dataset: str) -> str:
    """The local train file `dataset` (a ModelScope id, maybe with `#N`) stands for, downloaded through the
    `modelscope` package; a ConfigError in one line where that cannot be done here."""
    file, first = dataset_file(dataset)
    name, cut = str(file), "" if first is None else f"#{first}"
    how = (f"download it where there is a network (`modelscope download --dataset {name} --local_dir DIR`) and give "
           f"its train file as dataset (DIR/FILE{cut})")
    if importlib.util.find_spec("modelscope") is None:
        raise ConfigError(f"dataset '{dataset}' is a ModelScope dataset id, and the modelscope package is not "
                          f"installed: `pip install modelscope` reads it, or {how}",
                          [("dataset", f"'{dataset}' is a ModelScope id; `pip install modelscope`, or {how}")])
    endpoint = _endpoint()
    offline = _unreachable(endpoint)
    if offline:
        raise ConfigError(f"dataset '{dataset}': this machine is offline ({endpoint} cannot be reached: {offline}); "
                          f"{how}", [("dataset", f"'{dataset}': this machine is offline ({endpoint} cannot be reached: "
                                      f"{offline}); {how}")])
    from modelscope.hub.snapshot_download import dataset_snapshot_download

    try:
        folder = dataset_snapshot_download(name, allow_patterns=[f"*{suffix}" for suffix in FORMATS])
    except Exception as exc:  # no such dataset, or the download failed
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"dataset '{dataset}' cannot be downloaded from ModelScope: {reason}",
                          [("dataset", f"'{dataset}' cannot be downloaded from ModelScope: {reason}")]) from None
    return hf_dataset(f"{folder}{cut}")


def _endpoint() -> str:
    """The ModelScope site the package asks (MODELSCOPE_DOMAIN, else www.modelscope.cn)."""
    domain = os.environ.get("MODELSCOPE_DOMAIN", "www.modelscope.cn")
    return domain if domain.startswith(("http://", "https://")) else f"https://{domain}"


def _unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Why one connection to `endpoint` fails, or None: asked once, before the package's retries."""
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as exc:
        return str(exc) or type(exc).__name__
    return None


def hf_dataset(dataset: str) -> str:
    """The local train file of the Hugging Face Hub dataset `dataset` (ms-swift's `use_hf: true`), `#N` kept."""
    file, first = dataset_file(dataset)
    files = split_files(str(file))
    cut = "" if first is None else f"#{first}"
    if len(files) > 1 and first is not None:
        raise ConfigError(f"dataset '{dataset}' has {len(files)} train files; give one as dataset: FILE{cut}",
                          [("dataset", f"'{dataset}' has {len(files)} train files: {', '.join(files)}; give one "
                                       f"as dataset: FILE{cut}")])
    return f"{files[0]}{cut}"
