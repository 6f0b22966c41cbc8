"""Checkpoint files on disk: atomic writes, checksums, safe loading, the corruption errors.

Files are written atomically (temporary file in the same directory, ``fsync``, rename), so
a crash leaves the previous file intact, and loaded with ``torch.load(weights_only=True)``,
which never runs pickled code. A file is a ``torch.save`` zip archive of
``{"format": FORMAT, "version": VERSION, "save_counter": n, "objects": {...}}``.

**Checksum.** The archive's comment (the last bytes of a zip file, which ``torch.load`` and
every zip reader skip) holds ``torch-distribute:sha256:<hex>``: the SHA-256 of every byte of
the file before it. It is computed while ``torch.save`` writes, so writing reads nothing
back. Loading hashes the file first and raises ``CorruptCheckpointError`` ("checksum
mismatch: the file is damaged", "truncated", ...) naming the file; files from earlier
versions, with no comment, load unchecked as before. ``check_file(path, full=False)`` is the
cheap check (the size, the end-of-archive record, the zip directory) that
``latest_checkpoint`` runs.

**Temporary files.** A temporary file is named ``.<target>.td-<host>-<pid>-<random>.tmp``
(``<host>``: 8 hex digits of the host name's hash); a sharded checkpoint is written into a
directory ``.<target>.td-<host>-<pid>.partial``. A crash can leave either behind.
``remove_stale_temporaries(directory)`` (run before every save and when a
``CheckpointManager`` opens a directory) removes those, and only those, that are stale:
last modified before this process started, and written by a process that is gone (same
host, pid no longer running) or by another host (whose pids cannot be checked). A save in
flight keeps modifying its file, and a live process on this host is never robbed; the file
names of users never match.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "data")
>>> atomic_write(path, lambda f: f.write(b"payload"))  # returns what write returned
7
>>> open(path, "rb").read()
b'payload'
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import struct
import tempfile
import time
import zipfile
from collections.abc import Callable
from typing import IO, Any

import torch

from torch_distribute.errors import CheckpointError

__all__ = [
    "DCP_METADATA",
    "FORMAT",
    "LAYOUT_FILENAME",
    "VERSION",
    "CorruptCheckpointError",
    "atomic_write",
    "check_file",
    "check_payload",
    "checkpoint_exists",
    "directory_of",
    "file_fingerprint",
    "is_sharded_checkpoint",
    "looks_sharded",
    "load_payload",
    "load_weights_only",
    "read_checksum",
    "remove_checkpoint",
    "remove_stale_temporaries",
    "save_file",
    "temporary_directory_name",
    "write_failure",
]

#: In a sharded checkpoint directory: the payload with tensors replaced by their keys, and
#: torch.distributed.checkpoint's index of the shards.
LAYOUT_FILENAME = "layout.pt"
DCP_METADATA = ".metadata"

FORMAT = "torch-distribute-checkpoint"
VERSION = 1

_CHECKSUM_MAGIC = b"torch-distribute:sha256:"
_CHECKSUM_LEN = len(_CHECKSUM_MAGIC) + 64  # the archive comment: magic + 64 hex digits
_EOCD = b"PK\x05\x06"  # zip end-of-central-directory record: 22 bytes + the comment
_EOCD_LEN = 22
_CHUNK = 8 << 20

_PROCESS_START = time.time()  # when this process first imported the checkpoint package
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TEMPORARY = re.compile(
    r"^\.(?P<target>.+)\.td-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)(?:-[a-z0-9_]+\.tmp|\.partial)$")
_LEGACY_PARTIAL = re.compile(r"^\.(?P<target>.+)\.partial$")  # sharded, before pids were named


def _file_mode() -> int:
    """Permissions for a new file: mkstemp creates 0600, torch.save would honour the umask.

    The umask is read from ``/proc`` where there is one; elsewhere it can only be read by
    setting it, which is done here, at a write, and undone at once (never at import:
    ``strategies/torch_patches.py``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return 0o666 & ~umask


class CorruptCheckpointError(CheckpointError):
    """A checkpoint that is truncated or damaged (its checksum does not match): restore an
    earlier one. ``CheckpointManager.restore_or_initialize`` falls back past these.

    ``foreign`` is true when the file is no torch.save archive at all (perhaps not a
    checkpoint: ``latest_checkpoint`` skips such files found by a directory scan quietly).
    """

    def __init__(self, message: str, foreign: bool = False):
        super().__init__(message)
        self.foreign = foreign


def directory_of(path: str) -> str:
    """The directory part of ``path``; ``"."`` for a bare file name."""
    return os.path.dirname(path) or "."


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory."""
    return os.path.isfile(os.path.join(path, LAYOUT_FILENAME)) and os.path.isfile(os.path.join(path, DCP_METADATA))


def looks_sharded(path: str) -> bool:
    """Whether ``path`` is a directory holding any part of a sharded checkpoint (complete or not)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return LAYOUT_FILENAME in names or DCP_METADATA in names or any(n.endswith(".distcp") for n in names)


def checkpoint_exists(path: str) -> bool:
    """Whether ``path`` is a checkpoint: a file, or a sharded checkpoint directory (an
    incomplete one too: it is damaged, and a manager falls back past it with a warning)."""
    return os.path.isfile(path) or looks_sharded(path)


def remove_checkpoint(path: str) -> None:
    """Delete the checkpoint ``path`` (a file or a sharded directory); gone already is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


# -- temporary files -------------------------------------------------------------------------
def _temporary_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.td-{_HOST}-{os.getpid()}"


def temporary_directory_name(path: str) -> str:
    """Where a sharded checkpoint ``path`` is written before it is renamed to ``path``."""
    return os.path.join(directory_of(path), _temporary_prefix(path) + ".partial")


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process: alive
    return True


def _last_modified(path: str) -> float:
    """The newest modification time of ``path`` and (a directory) its entries."""
    newest = os.lstat(path).st_mtime
    if os.path.isdir(path) and not os.path.islink(path):
        with os.scandir(path) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def _looks_like_partial_checkpoint(path: str) -> bool:
    """A directory holding only what a sharded checkpoint write puts there."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    names = os.listdir(path)
    return all(n.endswith(".distcp") or n in (DCP_METADATA, LAYOUT_FILENAME) or _TEMPORARY.match(n) for n in names)


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary files and directories a crashed save left in ``directory``.

    Only names of this module's pattern (see the module docstring) are considered, and only
    those last modified before this process started, by a process that is gone (same host)
    or by another host. Returns the paths removed; errors are ignored (best effort).
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        try:
            if match is not None:
                if match["host"] == _HOST and _pid_running(int(match["pid"])):
                    continue
            elif not (_LEGACY_PARTIAL.match(entry.name) and _looks_like_partial_checkpoint(entry.path)):
                continue
            if _last_modified(entry.path) >= _PROCESS_START:
                continue
            remove_checkpoint(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
    return removed


def atomic_write(path: str, write: Callable[[IO[bytes]], Any]) -> Any:
    """Write ``path`` through a temporary file in the same directory, then rename it.

    Returns what ``write`` returned.
    """
    directory = directory_of(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=_temporary_prefix(path) + "-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(error, OSError) and not isinstance(error, CheckpointError):
            raise write_failure(path, error) from error
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (not on Windows)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return result


def write_failure(path: str, error: OSError) -> CheckpointError:
    """The ``CheckpointError`` for an ``OSError`` while writing ``path``: what the system said
    (``No space left on device``, ``File too large``...) and the free space where it failed."""
    directory = directory_of(path)
    try:
        free = f"; {shutil.disk_usage(directory).free:,} bytes free in {directory}"
    except OSError:
        free = ""
    reason = f"{os.strerror(error.errno)} (errno {error.errno})" if error.errno else str(error)
    return CheckpointError(
        f"Could not write checkpoint {path!r}: {reason}{free}. "
        "Nothing was replaced: the previous checkpoint, if any, is intact. Free space (or raise the "
        "quota or file-size limit) there, or save to another directory."
    )


# -- checksums ---------------------------------------------------------------------------------
class _ChecksumWriter:
    """A file ``torch.save`` writes to: hashes what passes and holds back the last 22 bytes
    (the end-of-archive record), so ``finish`` can declare the comment and append it."""

    def __init__(self, f: IO[bytes]):
        self._file = f
        self._hash = hashlib.sha256()
        self._held = b""
        # The file's own error (a full disk): torch.save reports it as "unexpected pos".
        self.error: OSError | None = None

    def _emit(self, data: Any) -> None:
        if len(data):
            self._hash.update(data)
            try:
                self._file.write(data)
            except OSError as error:
                self.error = self.error or error
                raise

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _EOCD_LEN:
            self._emit(self._held)
            self._emit(view[:-_EOCD_LEN])
            self._held = bytes(view[-_EOCD_LEN:])
        else:
            joined = self._held + bytes(view)
            self._emit(joined[:-_EOCD_LEN])
            self._held = joined[-_EOCD_LEN:]
        return len(view)

    def flush(self) -> None:
        self._file.flush()

    def finish(self) -> str:
        """Write the end-of-archive record with the checksum as its comment; the digest."""
        record = self._held
        if len(record) != _EOCD_LEN or not record.startswith(_EOCD) or record[20:22] != b"\0\0":
            raise CheckpointError(
                "torch.save wrote an archive that does not end with a plain end-of-archive "
                "record, so no checksum can be added; this torch version is not supported."
            )
        self._emit(record[:20] + struct.pack("<H", _CHECKSUM_LEN))
        digest = self._hash.hexdigest()
        self._file.write(_CHECKSUM_MAGIC + digest.encode("ascii"))
        return digest


def save_file(path: str, payload: Any) -> str:
    """``torch.save`` ``payload`` atomically to ``path`` with its checksum; the SHA-256 digest."""

    def write(f: IO[bytes]) -> str:
        writer = _ChecksumWriter(f)
        try:
            torch.save(payload, writer)  # type: ignore[arg-type]
        except Exception as error:
            if writer.error is not None:  # what torch's "unexpected pos" hides
                raise writer.error from error
            raise
        return writer.finish()

    return atomic_write(path, write)


def _damaged(path: str, what: str, foreign: bool = False) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"Checkpoint file {path!r} is damaged: {what}. Restore an earlier checkpoint (e.g. from "
        "CheckpointManager.checkpoints; restore_or_initialize falls back by itself).",
        foreign=foreign,
    )


def _trailer(path: str, size: int) -> str | None:
    """The digest in ``path``'s checksum comment; ``None`` for an archive without one (older
    files). Raises ``CorruptCheckpointError`` for anything that is no complete archive."""
    if size == 0:
        raise _damaged(path, "truncated: the file is empty (0 bytes)")
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - (_EOCD_LEN + _CHECKSUM_LEN)))
        tail = f.read()
    if head != b"PK\x03\x04":
        if size < 4 and b"PK\x03\x04".startswith(head):
            raise _damaged(path, f"truncated: only {size} bytes are left")
        raise _damaged(path, "wrong format: it is not a torch.save archive (no zip header)", foreign=True)
    if tail[-_EOCD_LEN:].startswith(_EOCD) and tail[-2:] == b"\0\0":
        return None  # an archive without a comment: written before checksums
    record = tail[:_EOCD_LEN]
    comment = tail[_EOCD_LEN:]
    if len(tail) == _EOCD_LEN + _CHECKSUM_LEN and record.startswith(_EOCD) \
            and struct.unpack("<H", record[20:22])[0] == _CHECKSUM_LEN:
        digest = comment[len(_CHECKSUM_MAGIC):]
        if comment.startswith(_CHECKSUM_MAGIC) and re.fullmatch(rb"[0-9a-f]{64}", digest):
            return digest.decode("ascii")
        raise _damaged(path, "checksum mismatch: the checksum record at its end is damaged")
    if _CHECKSUM_MAGIC[:8] in tail or _EOCD not in tail:
        raise _damaged(path, f"truncated: its end is missing ({size} bytes)")
    raise _damaged(path, "truncated or damaged: its end-of-archive record is invalid")


def read_checksum(path: str) -> str | None:
    """The SHA-256 recorded in the checkpoint file ``path`` (no hashing); ``None`` for a file
    without one or one that is missing or damaged."""
    try:
        return _trailer(path, os.path.getsize(path))
    except (OSError, CheckpointError):
        return None


def _hash_file(path: str, length: int | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = length
        while remaining is None or remaining > 0:
            chunk = f.read(_CHUNK if remaining is None else min(_CHUNK, remaining))
            if not chunk:
                break
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return digest.hexdigest()


def file_fingerprint(path: str) -> tuple[int, str]:
    """``(size, sha256)`` of the file ``path``."""
    return os.path.getsize(path), _hash_file(path)


def check_file(path: str, full: bool = True) -> None:
    """Raise ``CorruptCheckpointError`` if the checkpoint file ``path`` is truncated or damaged.

    ``full=False`` checks what costs no more than a few reads: the size, the end-of-archive
    record with the checksum, and that the zip directory parses. ``full=True`` also hashes the
    file and compares the checksum (files without one get the cheap check only).
    """
    size = os.path.getsize(path)
    digest = _trailer(path, size)
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except Exception as exc:  # noqa: BLE001 - zipfile raises many kinds on damaged bytes
        raise _damaged(path, f"its zip directory is unreadable ({type(exc).__name__}: {exc})") from exc
    if not any(name.endswith("/data.pkl") or name == "data.pkl" for name in names):
        raise _damaged(path, "wrong format: the archive has no data.pkl record", foreign=True)
    if full and digest is not None and _hash_file(path, size - _CHECKSUM_LEN) != digest:
        raise _damaged(path, "checksum mismatch: the file is damaged")


def load_payload(path: str) -> dict[str, Any]:
    """Check and load the checkpoint file ``path`` (which exists) on the CPU.

    Raises ``CorruptCheckpointError`` if the file is truncated or its checksum does not
    match, ``CheckpointError`` if it holds values that ``weights_only`` loading refuses, is
    not a torch-distribute checkpoint, or has a newer format version.
    """
    check_file(path, full=True)
    payload = load_weights_only(path, "The file is corrupt, or holds values other than tensors and plain "
                                      "Python values (a state_dict() with functions or custom classes).")
    return check_payload(path, payload)


def load_weights_only(path: str, why_refused: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; a refusal is a ``CheckpointError``
    naming the file and torch's reason, followed by ``why_refused``."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).strip().splitlines()
        detail = next((line for line in reason if "WeightsUnpickler error" in line), reason[0] if reason else "")
        raise CheckpointError(
            f"Checkpoint file {path!r} could not be loaded safely (weights_only=True): "
            f"{type(exc).__name__}: {detail}. {why_refused}"
        ) from exc


def check_payload(path: str, payload: Any) -> dict[str, Any]:
    """``payload`` if it is a torch-distribute checkpoint this version reads, else ``CheckpointError``."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        # Damage as far as a checkpoint directory goes: a manager falls back past it.
        raise CorruptCheckpointError(
            f"File {path!r} is not a torch-distribute checkpoint (no format tag "
            f"{FORMAT!r}); write it with td.Checkpoint(...).save() or .write()."
        )
    if not isinstance(payload.get("version"), int) or payload["version"] > VERSION:
        raise CheckpointError(
            f"Checkpoint {path!r} has format version {payload.get('version')!r}; this "
            f"torch-distribute reads version {VERSION} and earlier. Upgrade torch-distribute."
        )
    if not isinstance(payload.get("objects"), dict):
        raise CorruptCheckpointError(f"Checkpoint {path!r} is corrupt: it has no 'objects' dict.")
    return payload
