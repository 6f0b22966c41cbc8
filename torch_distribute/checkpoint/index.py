"""The ``checkpoint`` index file of a directory, and ``latest_checkpoint``.

``Checkpoint.save`` and ``CheckpointManager`` record the files they write in a JSON index
(``{"latest": name, "all": [names, oldest first]}``) named ``checkpoint``, written
atomically. Without a usable index, the ``<prefix>-<n>`` files of the directory are scanned.
An index may only name checkpoints inside its own directory: an entry that leads elsewhere
(an absolute path outside it, ``..``) raises ``CheckpointError``.

>>> import tempfile, torch_distribute as td
>>> td.latest_checkpoint(tempfile.mkdtemp()) is None
True
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

from torch_distribute.checkpoint.file_io import (
    DCP_METADATA,
    LAYOUT_FILENAME,
    CorruptCheckpointError,
    atomic_write,
    check_file,
    checkpoint_exists,
    directory_of,
    is_sharded_checkpoint,
    looks_sharded,
)
from torch_distribute.errors import CheckpointError

__all__ = [
    "INDEX_FILENAME",
    "NUMBERED",
    "available",
    "check_checkpoint",
    "latest_checkpoint",
    "missing_path_error",
    "newest_intact",
    "read_index",
    "scan_numbered",
    "write_index",
]

INDEX_FILENAME = "checkpoint"
NUMBERED = re.compile(r"^(?P<name>.+)-(?P<number>\d+)$")  # a numbered file: <name>-<number>


def _inside(directory: str, name: str, index_path: str) -> str:
    """``name`` (an index entry) relative to ``directory``; ``CheckpointError`` if it leads out."""
    base = os.path.normpath(os.path.abspath(directory))
    target = os.path.normpath(os.path.join(base, name))
    if target == base or os.path.commonpath([base, target]) != base:
        raise CheckpointError(
            f"The checkpoint index {index_path!r} names {name!r}, which is outside its directory "
            f"{directory!r}; an index may only name checkpoints in its own directory. Delete or "
            "fix the index file (without it, the directory's <prefix>-<n> files are scanned)."
        )
    return os.path.relpath(target, base)


def read_index(directory: str) -> dict[str, Any] | None:
    """The index of ``directory``; ``None`` if it is missing or unreadable.

    Entries are names relative to ``directory``; one that leads outside it raises
    ``CheckpointError``.
    """
    path = os.path.join(directory, INDEX_FILENAME)
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get("all", []), list):
        return None
    latest = index.get("latest")
    return {
        "latest": _inside(directory, latest, path) if isinstance(latest, str) and latest else None,
        "all": [_inside(directory, n, path) for n in index.get("all", []) if isinstance(n, str) and n],
    }


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
    names = list(index.get("all", []))
    names += [n for n in scan_numbered(directory) if n not in names]
    return [os.path.join(directory, n) for n in names if checkpoint_exists(os.path.join(directory, n))]


def check_checkpoint(path: str, full: bool = False) -> None:
    """Raise ``CorruptCheckpointError`` if the checkpoint ``path`` (a file or a sharded
    directory) is truncated or damaged. ``full=False``: the cheap checks (sizes, the end of
    the file, the zip directory); ``full=True``: also every checksum."""
    if os.path.isdir(path):
        from torch_distribute.checkpoint.sharded_io import check_sharded  # imports DCP: only here

        check_sharded(path, full=full)
    else:
        check_file(path, full=full)


def newest_intact(candidates: list[str], where: str, quiet: frozenset[str] = frozenset()) -> str | None:
    """The first of ``candidates`` (paths, newest first; missing ones skipped) that passes the
    cheap check, warning about each damaged one passed over.

    Files in ``quiet`` that are no torch.save archive at all are passed over silently (files
    found by a scan, which may not be checkpoints). Raises ``CorruptCheckpointError`` if
    checkpoints exist but every one is damaged.
    """
    damaged: list[CorruptCheckpointError] = []
    seen: set[str] = set()
    for path in candidates:
        if path in seen or not checkpoint_exists(path):
            continue
        seen.add(path)
        try:
            check_checkpoint(path, full=False)
        except CorruptCheckpointError as exc:
            if not (exc.foreign and path in quiet):
                damaged.append(exc)
            continue
        for error in damaged:
            warnings.warn(f"{error} Using {path!r}, the newest intact checkpoint in {where}.", stacklevel=3)
        return path
    if damaged:
        raise CorruptCheckpointError(
            f"Every checkpoint in {where} is damaged: " + " ".join(str(e) for e in damaged)
            + " Delete them to start from scratch, or restore a copy from elsewhere."
        )
    return None


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest intact checkpoint in ``directory``, or ``None`` if it holds none.

    Reads the ``checkpoint`` index file that ``Checkpoint.save`` and ``CheckpointManager``
    keep; without a usable index, the ``<prefix>-<n>`` file with the largest ``n``.

    Verification is cheap here (it runs at every call): the file exists and is not
    truncated (its end-of-archive record with the checksum is intact) and its zip directory
    parses; for a sharded checkpoint, ``layout.pt`` and the size of every shard file. If the
    newest checkpoint fails, the next newest is returned with a ``warnings.warn`` naming the
    damaged one. The full checksum is compared when the checkpoint is restored
    (``Checkpoint.restore`` raises ``CheckpointError`` then;
    ``CheckpointManager.restore_or_initialize`` falls back by itself). Raises
    ``CheckpointError`` if every checkpoint is damaged, or if the index names a path outside
    ``directory``.

    >>> import tempfile, torch_distribute as td
    >>> td.latest_checkpoint(tempfile.mkdtemp()) is None
    True
    """
    directory = os.fspath(directory)
    index = read_index(directory)
    names: list[str] = []
    if index is not None:
        names = [n for n in [index["latest"], *reversed(index["all"])] if n]
    scanned = [n for n in reversed(scan_numbered(directory)) if n not in names]
    return newest_intact([os.path.join(directory, n) for n in names + scanned], repr(directory),
                         quiet=frozenset(os.path.join(directory, n) for n in scanned))


def missing_path_error(path: str) -> CheckpointError:
    """The error for a checkpoint ``path`` that is no file, naming the checkpoints there are."""
    directory = directory_of(path)
    if looks_sharded(path) and not is_sharded_checkpoint(path):
        return CorruptCheckpointError(
            f"Sharded checkpoint {path!r} is incomplete ({LAYOUT_FILENAME} or "
            f"{DCP_METADATA} is missing: a save that did not finish, or files lost). Restore an "
            f"earlier one, e.g. td.latest_checkpoint({directory_of(path)!r}).")
    if os.path.isdir(path) and not is_sharded_checkpoint(path):
        return CheckpointError(
            f"Checkpoint path {path!r} is a directory; pass a checkpoint file, e.g. "
            f"td.latest_checkpoint({path!r})."
        )
    if not os.path.isdir(directory):
        return CheckpointError(f"Checkpoint path {path!r} does not exist (no directory {directory!r}).")
    try:
        found = available(directory)
    except CheckpointError as exc:
        return CheckpointError(f"Checkpoint path {path!r} does not exist. {exc}")
    if not found:
        return CheckpointError(
            f"Checkpoint path {path!r} does not exist, and {directory!r} holds no checkpoints."
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            newest = repr(latest_checkpoint(directory))
        except CheckpointError:
            newest = "none: every one is damaged"
    return CheckpointError(
        f"Checkpoint path {path!r} does not exist. Checkpoints in {directory!r}: "
        f"{', '.join(os.path.basename(p) for p in found)}; "
        f"td.latest_checkpoint({directory!r}) gives the newest ({newest})."
    )
