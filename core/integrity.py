"""Whether the files rlcore reads back (a checkpoint's pieces: weights, optimizer, scheduler and RNG state, trainer
states) are whole, found without loading them: a damaged one is refused in one line naming it, before a library's
loader fails on it with a traceback of its own, or after half a model was restored. What to do then (pass over to an
older checkpoint, or stop) is the checkpoint rules' (`rlcore.Trainer.restore`)."""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

from .errors import RlcoreError

TORCH_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save's zip archives: optimizer.pt, rng_state.pth, training_args.bin
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def damage(path: str | os.PathLike) -> str | None:
    """Why the file `path` is damaged (torn, truncated, overwritten), or None when it looks whole: a torch archive
    whose every member's checksum holds, a safetensors file whose header and size agree, JSON that parses."""
    file = Path(path)
    try:
        if file.suffix in TORCH_SUFFIXES:
            return _torch_damage(file)
        if file.suffix == ".safetensors":
            return _safetensors_damage(file)
        if file.suffix == ".json":
            json.loads(file.read_bytes())
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'unreadable'}"[:300]
    return None


def _torch_damage(file: Path) -> str | None:
    if not zipfile.is_zipfile(file):
        return "not a torch archive (torn, truncated or overwritten)"
    with zipfile.ZipFile(file) as archive:
        bad = archive.testzip()
    return f"its member {bad} fails its checksum" if bad is not None else None


def _safetensors_damage(file: Path) -> str | None:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_SAFETENSORS_HEADER, size - 8):
            return f"its header claims {length} bytes, the file has {size}"
        header = json.loads(f.read(length))
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    return None if size == expected else f"{size} bytes where its header says {expected} (truncated or extended)"


def check_folder(folder: str | os.PathLike, what: str = "checkpoint") -> None:
    """Every piece in `folder` (its files and those of its subfolders) whole, else an `RlcoreError` of one line naming
    the first damaged one and why."""
    for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        why = damage(file)
        if why is not None:
            raise RlcoreError(f"{what} piece {file} is damaged: {why}")
