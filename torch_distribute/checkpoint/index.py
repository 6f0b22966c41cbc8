"""The ``checkpoint`` index file of a directory, and ``latest_checkpoint``.

``Checkpoint.save`` and ``CheckpointManager`` record the files they write in a JSON index
(``{"latest": name, "all": [names, oldest first]}``) named ``checkpoint``, written
atomically. Without a usable index, the ``<prefix>-<n>`` files of the directory are scanned.

>>> import tempfile, torch_distribute as td
>>> td.latest_checkpoint(tempfile.mkdtemp()) is None
True
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from torch_distribute.checkpoint.file_io import (
    atomic_write,
    checkpoint_exists,
    directory_of,
    is_sharded_checkpoint,
)
from torch_distribute.errors import CheckpointError

__all__ = [
    "INDEX_FILENAME",
    "NUMBERED",
    "available",
    "latest_checkpoint",
    "missing_path_error",
    "read_index",
    "scan_numbered",
    "write_index",
]

INDEX_FILENAME = "checkpoint"
NUMBERED = re.compile(r"^(?P<name>.+)-(?P<number>\d+)$")  # a numbered file: <name>-<number>


def read_index(directory: str) -> dict[str, Any] | None:
    """The index of ``directory``; ``None`` if it is missing or unreadable."""
    try:
        with open(os.path.join(directory, INDEX_FILENAME), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get("all", []), list):
        return None
    return index


def write_index(directory: str, latest: str | None, all_names: list[str]) -> None:
    """Atomically write the index of ``directory``."""
    data = json.dumps({"latest": latest, "all": all_names}, indent=2).encode("utf-8")
    atomic_write(os.path.join(directory, INDEX_FILENAME), lambda f: f.write(data))


def scan_numbered(directory: str, name: str | None = None) -> list[str]:
    """Basenames of ``<name>-<n>`` files in ``directory``, oldest (smallest n) first."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = NUMBERED.match(entry.name)
        if entry.name.startswith(".") or match is None or not checkpoint_exists(entry.path):
            continue
        if name is None or match["name"] == name:
            found.append((int(match["number"]), entry.stat().st_mtime, entry.name))
    return [basename for _, _, basename in sorted(found)]


def available(directory: str) -> list[str]:
    """Every checkpoint file the index or a directory scan knows of, oldest first."""
    index = read_index(directory) or {}
    names = [n for n in index.get("all", []) if isinstance(n, str)]
    names += [n for n in scan_numbered(directory) if n not in names]
    return [os.path.join(directory, n) for n in names if checkpoint_exists(os.path.join(directory, n))]


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest checkpoint in ``directory``, or ``None`` if it holds none.

    Reads the ``checkpoint`` index file that ``Checkpoint.save`` and ``CheckpointManager``
    keep; without a usable index, the ``<prefix>-<n>`` file with the largest ``n``.

    >>> import tempfile, torch_distribute as td
    >>> td.latest_checkpoint(tempfile.mkdtemp()) is None
    True
    """
    directory = os.fspath(directory)
    index = read_index(directory)
    if index is not None:
        candidates = [index.get("latest")] + list(reversed(index.get("all", [])))
        for name in candidates:
            if isinstance(name, str) and checkpoint_exists(os.path.join(directory, name)):
                return os.path.join(directory, name)
    scanned = scan_numbered(directory)
    return os.path.join(directory, scanned[-1]) if scanned else None


def missing_path_error(path: str) -> CheckpointError:
    """The error for a checkpoint ``path`` that is no file, naming the checkpoints there are."""
    directory = directory_of(path)
    if os.path.isdir(path) and not is_sharded_checkpoint(path):
        return CheckpointError(
            f"Checkpoint path {path!r} is a directory; pass a checkpoint file, e.g. "
            f"td.latest_checkpoint({path!r})."
        )
    if not os.path.isdir(directory):
        return CheckpointError(f"Checkpoint path {path!r} does not exist (no directory {directory!r}).")
    found = available(directory)
    if not found:
        return CheckpointError(
            f"Checkpoint path {path!r} does not exist, and {directory!r} holds no checkpoints."
        )
    return CheckpointError(
        f"Checkpoint path {path!r} does not exist. Checkpoints in {directory!r}: "
        f"{', '.join(os.path.basename(p) for p in found)}; "
        f"td.latest_checkpoint({directory!r}) gives the newest ({latest_checkpoint(directory)!r})."
    )
