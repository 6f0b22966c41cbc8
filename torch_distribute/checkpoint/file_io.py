"""Checkpoint files on disk: atomic writes, safe loading, and the corruption errors.

Files are written atomically (temporary file in the same directory, ``fsync``, rename), so
a crash leaves the previous file intact, and loaded with ``torch.load(weights_only=True)``,
which never runs pickled code. A file is a ``torch.save`` zip archive of
``{"format": FORMAT, "version": VERSION, "save_counter": n, "objects": {...}}``.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "data")
>>> atomic_write(path, lambda f: f.write(b"payload"))
>>> open(path, "rb").read()
b'payload'
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from typing import IO, Any

import torch

from torch_distribute.errors import CheckpointError

__all__ = [
    "FORMAT",
    "LAYOUT_FILENAME",
    "VERSION",
    "atomic_write",
    "check_payload",
    "checkpoint_exists",
    "directory_of",
    "is_sharded_checkpoint",
    "load_payload",
    "remove_checkpoint",
]

#: In a sharded checkpoint directory: the payload with tensors replaced by their keys, and
#: torch.distributed.checkpoint's index of the shards.
LAYOUT_FILENAME = "layout.pt"
_DCP_METADATA = ".metadata"

FORMAT = "torch-distribute-checkpoint"
VERSION = 1

# Permissions for new files: mkstemp creates 0600, torch.save would honour the umask.
_UMASK = os.umask(0)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK


def directory_of(path: str) -> str:
    """The directory part of ``path``; ``"."`` for a bare file name."""
    return os.path.dirname(path) or "."


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory."""
    return os.path.isfile(os.path.join(path, LAYOUT_FILENAME)) and os.path.isfile(os.path.join(path, _DCP_METADATA))


def checkpoint_exists(path: str) -> bool:
    """Whether ``path`` is a checkpoint: a file, or a sharded checkpoint directory."""
    return os.path.isfile(path) or is_sharded_checkpoint(path)


def remove_checkpoint(path: str) -> None:
    """Delete the checkpoint ``path`` (a file or a sharded directory); gone already is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temporary file in the same directory, then rename it."""
    directory = directory_of(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (not on Windows)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_payload(path: str) -> dict[str, Any]:
    """Load and check the checkpoint file ``path`` (which exists) on the CPU.

    Raises ``CheckpointError`` if the file is truncated or corrupt, holds values that
    ``weights_only`` loading refuses, is not a torch-distribute checkpoint, or has a newer
    format version.
    """
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"Checkpoint file {path!r} is corrupt or truncated (not a torch.save archive); "
            "restore an earlier checkpoint, e.g. from CheckpointManager.checkpoints."
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).strip().splitlines()
        detail = next((line for line in reason if "WeightsUnpickler error" in line), reason[0] if reason else "")
        raise CheckpointError(
            f"Checkpoint file {path!r} could not be loaded safely (weights_only=True): "
            f"{type(exc).__name__}: {detail}. The file is corrupt, or holds values other than "
            "tensors and plain Python values (a state_dict() with functions or custom classes)."
        ) from exc
    return check_payload(path, payload)


def check_payload(path: str, payload: Any) -> dict[str, Any]:
    """``payload`` if it is a torch-distribute checkpoint this version reads, else ``CheckpointError``."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"File {path!r} is not a torch-distribute checkpoint (no format tag "
            f"{FORMAT!r}); write it with td.Checkpoint(...).save() or .write()."
        )
    if not isinstance(payload.get("version"), int) or payload["version"] > VERSION:
        raise CheckpointError(
            f"Checkpoint {path!r} has format version {payload.get('version')!r}; this "
            f"torch-distribute reads version {VERSION} and earlier. Upgrade torch-distribute."
        )
    if not isinstance(payload.get("objects"), dict):
        raise CheckpointError(f"Checkpoint {path!r} is corrupt: it has no 'objects' dict.")
    return payload
