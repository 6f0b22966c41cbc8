"""Checkpoints in the ``tf.train.Checkpoint`` model, stored as plain PyTorch state dicts.

A ``Checkpoint`` groups named objects (modules, optimizers, LR schedulers, metrics, nested
checkpoints, tensors) and saves their ``state_dict()`` in one file. Files hold one logical
copy of every object, all tensors on the CPU, so a checkpoint written by any number of
replicas or workers loads into any other number, or with no strategy at all. Files are
written atomically (temporary file, ``fsync``, rename) and loaded with
``torch.load(weights_only=True)``, which never runs pickled code.

>>> import tempfile, os, torch, torch_distribute as td
>>> model = torch.nn.Linear(2, 1)
>>> step = torch.zeros((), dtype=torch.int64)
>>> ckpt = td.Checkpoint(model=model, step=step)
>>> directory = tempfile.mkdtemp()
>>> path = ckpt.save(os.path.join(directory, "ckpt"))
>>> os.path.basename(path), td.latest_checkpoint(directory) == path
('ckpt-1', True)
>>> ckpt.restore(path).assert_consumed()  # doctest: +ELLIPSIS
<torch_distribute.checkpoint.CheckpointLoadStatus object at ...>
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from typing import IO, Any

import torch

from torch_distribute import context
from torch_distribute.errors import CheckpointError, ContextError, InvalidArgumentError
from torch_distribute.strategies import owner_of

__all__ = ["Checkpoint", "CheckpointLoadStatus", "CheckpointManager", "latest_checkpoint"]

FORMAT = "torch-distribute-checkpoint"
VERSION = 1
INDEX_FILENAME = "checkpoint"
_NUMBERED = re.compile(r"^(?P<name>.+)-(?P<number>\d+)$")
_RESERVED = frozenset({"save_counter"})

# Permissions for new files: mkstemp creates 0600, torch.save would honour the umask.
_UMASK = os.umask(0)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK


# -- file helpers ------------------------------------------------------------------------
def _directory_of(path: str) -> str:
    return os.path.dirname(path) or "."


def _atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temporary file in the same directory, then rename it."""
    directory = _directory_of(path)
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


def _read_index(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, INDEX_FILENAME), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get("all", []), list):
        return None
    return index


def _write_index(directory: str, latest: str | None, all_names: list[str]) -> None:
    data = json.dumps({"latest": latest, "all": all_names}, indent=2).encode("utf-8")
    _atomic_write(os.path.join(directory, INDEX_FILENAME), lambda f: f.write(data))


def _scan_numbered(directory: str, name: str | None = None) -> list[str]:
    """Basenames of ``<name>-<n>`` files in ``directory``, oldest (smallest n) first."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = _NUMBERED.match(entry.name)
        if entry.name.startswith(".") or match is None or not entry.is_file():
            continue
        if name is None or match["name"] == name:
            found.append((int(match["number"]), entry.stat().st_mtime, entry.name))
    return [basename for _, _, basename in sorted(found)]


def _available(directory: str) -> list[str]:
    """Every checkpoint file the index or a directory scan knows of, oldest first."""
    index = _read_index(directory) or {}
    names = [n for n in index.get("all", []) if isinstance(n, str)]
    names += [n for n in _scan_numbered(directory) if n not in names]
    return [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest checkpoint in ``directory``, or ``None`` if it holds none.

    Reads the ``checkpoint`` index file that ``Checkpoint.save`` and ``CheckpointManager``
    keep; without a usable index, the ``<prefix>-<n>`` file with the largest ``n``.

    >>> import tempfile, torch_distribute as td
    >>> td.latest_checkpoint(tempfile.mkdtemp()) is None
    True
    """
    directory = os.fspath(directory)
    index = _read_index(directory)
    if index is not None:
        candidates = [index.get("latest")] + list(reversed(index.get("all", [])))
        for name in candidates:
            if isinstance(name, str) and os.path.isfile(os.path.join(directory, name)):
                return os.path.join(directory, name)
    scanned = _scan_numbered(directory)
    return os.path.join(directory, scanned[-1]) if scanned else None


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor detached and on the CPU (dicts, lists, tuples recursed)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            out[key] = _to_cpu(item)
        metadata = getattr(value, "_metadata", None)  # nn.Module state-dict versions
        if metadata is not None and isinstance(out, OrderedDict):
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    if isinstance(value, tuple):
        items = [_to_cpu(item) for item in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def owning_strategy(objects: Any) -> Any:
    """The strategy in scope, else the one the objects (or nested checkpoints) belong to."""
    if context.has_strategy():
        return context.get_strategy()
    pending = list(objects)
    while pending:
        obj = pending.pop()
        if isinstance(obj, Checkpoint):
            pending.extend(obj._objects.values())
            continue
        owner = owner_of(obj)
        if owner is not None:
            return owner
    return context.get_strategy()


def _should_write(objects: Any) -> bool:
    """Only the chief touches the files; other workers compute the same state and skip it."""
    return bool(getattr(owning_strategy(objects).extended, "should_checkpoint", True))


def _check_not_in_replica(method: str) -> None:
    if context.has_strategy() and not context.in_cross_replica_context():
        raise ContextError(
            f"Checkpoint.{method}() was called inside strategy.run(); call it from the "
            "training loop outside run() (cross-replica context), once per step."
        )


# -- load status -------------------------------------------------------------------------
class CheckpointLoadStatus:
    """What a ``read``/``restore`` matched: returned so callers can check it.

    ``missing`` lists objects of the checkpoint that the file had no value for (left
    unchanged), ``unexpected`` the values in the file that no object took.
    """

    def __init__(self, path: str | None, missing: list[str], unexpected: list[str]):
        self.path = path
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Raise ``CheckpointError`` unless every object and every saved value matched."""
        if self.missing or self.unexpected:
            problems = []
            if self.missing:
                problems.append(f"objects with nothing saved for them: {list(self.missing)}")
            if self.unexpected:
                problems.append(f"saved values with no object to restore into: {list(self.unexpected)}")
            raise CheckpointError(
                f"Checkpoint {self.path!r} did not match the objects restored: "
                + "; ".join(problems)
                + ". Give the Checkpoint the same object names as when it was saved, or call "
                "expect_partial() if a partial restore is intended."
            )
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Declare that a partial restore is intended (no-op, for TF compatibility)."""
        return self


# -- Checkpoint --------------------------------------------------------------------------
class Checkpoint:
    """Groups named objects so they are saved and restored together.

    Each object has ``state_dict()``/``load_state_dict()`` (``nn.Module``, optimizers, LR
    schedulers, metrics, another ``Checkpoint``) or is a ``torch.Tensor`` (saved by value,
    restored in place). Counters must be tensors so they can be restored in place.

    >>> import tempfile, os, torch, torch_distribute as td
    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> ckpt = td.Checkpoint(model=model, optimizer=optimizer)
    >>> path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> ckpt.save_counter
    1
    >>> fresh = torch.nn.Linear(2, 1)
    >>> _ = td.Checkpoint(model=fresh).read(path)  # model only: optimizer left unread
    >>> torch.equal(fresh.weight, model.weight)
    True
    """

    def __init__(self, **objects: Any):
        for name, obj in objects.items():
            if name in _RESERVED or hasattr(Checkpoint, name):
                raise InvalidArgumentError(
                    f"'{name}' is reserved by Checkpoint (an attribute or method name); give "
                    "the object another name."
                )
            if isinstance(obj, torch.Tensor):
                continue
            if isinstance(obj, type):
                raise InvalidArgumentError(
                    f"Checkpoint object '{name}' is the class {obj.__name__}, not an instance; "
                    f"pass the object itself, e.g. {name}={obj.__name__}(...)."
                )
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise InvalidArgumentError(
                    f"Checkpoint object '{name}' of type {type(obj).__name__} cannot be saved: "
                    "pass objects with state_dict()/load_state_dict() (modules, optimizers, "
                    "schedulers, metrics, Checkpoints) or tensors. Wrap a counter in a tensor, "
                    "e.g. step = torch.zeros((), dtype=torch.int64), and update it in place "
                    "(step += 1)."
                )
        self._objects: dict[str, Any] = dict(objects)
        self.save_counter: int = 0

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or object {name!r}")

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)}; save_counter={self.save_counter})"

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"save_counter": n, "objects": {name: state}}``, tensors on the CPU."""
        objects = {}
        for name, obj in self._objects.items():
            state = obj.detach() if isinstance(obj, torch.Tensor) else obj.state_dict()
            objects[name] = _to_cpu(state)
        return {"save_counter": self.save_counter, "objects": objects}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output (objects absent from it are left as they are)."""
        self._load(state_dict, restore_counter=True, prefix="")

    def _load(self, state: Any, restore_counter: bool, prefix: str) -> tuple[list[str], list[str]]:
        """Restore every object found in ``state``; return (missing, unexpected) names."""
        if not isinstance(state, dict) or not isinstance(state.get("objects"), dict):
            raise CheckpointError(
                f"The saved value for Checkpoint '{prefix.rstrip('.') or '<root>'}' is not a "
                "torch-distribute checkpoint state ({'save_counter', 'objects'})."
            )
        saved = state["objects"]
        missing = [prefix + name for name in self._objects if name not in saved]
        unexpected = [prefix + name for name in saved if name not in self._objects]
        for name, obj in self._objects.items():
            if name not in saved:
                continue
            if isinstance(obj, Checkpoint):
                sub_missing, sub_unexpected = obj._load(saved[name], restore_counter, f"{prefix}{name}.")
                missing += sub_missing
                unexpected += sub_unexpected
            else:
                _load_object(prefix + name, obj, saved[name])
        if restore_counter and isinstance(state.get("save_counter"), int):
            self.save_counter = state["save_counter"]
        return missing, unexpected

    # -- writing ---------------------------------------------------------------------
    def _write_file(self, path: str, save_counter: int, method: str) -> None:
        """Serialize with ``save_counter`` into ``path`` (chief only); counters unchanged."""
        _check_not_in_replica(method)
        state = self.state_dict()  # every worker computes it: metrics may reduce collectively
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "save_counter": save_counter,
            "objects": state["objects"],
        }
        if not _should_write(self._objects.values()):
            return
        try:
            _atomic_write(path, lambda f: torch.save(payload, f))
        except Exception as exc:
            raise CheckpointError(
                f"Could not write checkpoint {path!r}: {exc}. Any previous checkpoint there is "
                "unchanged; check the disk space and that every state_dict() holds only "
                "tensors and plain Python values."
            ) from exc

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write exactly ``path``: no numbering, no index, ``save_counter`` unchanged.

        >>> import tempfile, os, torch, torch_distribute as td
        >>> ckpt = td.Checkpoint(w=torch.ones(2))
        >>> path = ckpt.write(os.path.join(tempfile.mkdtemp(), "weights.pt"))
        >>> _ = ckpt.read(path)
        """
        path = os.fspath(path)
        self._write_file(path, self.save_counter, "write")
        return path

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Write ``f"{file_prefix}-{n}"`` (``n`` = the incremented ``save_counter``).

        Also records the file as the latest in the directory's ``checkpoint`` index, which
        ``td.latest_checkpoint`` reads. Returns the path written.

        >>> import tempfile, os, torch, torch_distribute as td
        >>> ckpt = td.Checkpoint(step=torch.zeros((), dtype=torch.int64))
        >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> [os.path.basename(ckpt.save(prefix)) for _ in range(2)]
        ['ckpt-1', 'ckpt-2']
        """
        file_prefix = os.fspath(file_prefix)
        if not os.path.basename(file_prefix):
            raise InvalidArgumentError(
                f"file_prefix {file_prefix!r} names a directory; give a file name prefix too, "
                "e.g. os.path.join(directory, 'ckpt')."
            )
        number = self.save_counter + 1
        path = f"{file_prefix}-{number}"
        self._write_file(path, number, "save")
        self.save_counter = number
        if _should_write(self._objects.values()):
            directory, basename = _directory_of(path), os.path.basename(path)
            index = _read_index(directory) or {}
            names = [
                n for n in index.get("all", [])
                if isinstance(n, str) and n != basename and os.path.isfile(os.path.join(directory, n))
            ]
            _write_index(directory, basename, names + [basename])
        return path

    # -- reading ---------------------------------------------------------------------
    def read(self, path: str | os.PathLike[str]) -> CheckpointLoadStatus:
        """Restore the objects from exactly ``path``; ``save_counter`` is left unchanged.

        Objects that have no value in the file are left as they are (see
        ``CheckpointLoadStatus.assert_consumed``).
        """
        return self._restore_from(os.fspath(path), restore_counter=False)

    def restore(self, save_path: str | os.PathLike[str] | None) -> CheckpointLoadStatus:
        """Like ``read``, and also restores ``save_counter``: the inverse of ``save``.

        ``None`` (what ``td.latest_checkpoint`` returns for an empty directory) restores
        nothing, so ``ckpt.restore(td.latest_checkpoint(directory))`` starts fresh or resumes.
        """
        if save_path is None:
            return CheckpointLoadStatus(None, list(self._objects), [])
        return self._restore_from(os.fspath(save_path), restore_counter=True)

    def _restore_from(self, path: str, restore_counter: bool) -> CheckpointLoadStatus:
        _check_not_in_replica("restore")
        payload = _load_file(path)
        missing, unexpected = self._load(payload, restore_counter, prefix="")
        return CheckpointLoadStatus(path, missing, unexpected)


def _load_object(name: str, obj: Any, state: Any) -> None:
    try:
        if isinstance(obj, torch.Tensor):
            if not isinstance(state, torch.Tensor):
                raise TypeError(f"saved value is a {type(state).__name__}, not a tensor")
            if state.shape != obj.shape:
                raise ValueError(
                    f"saved shape {tuple(state.shape)} != target shape {tuple(obj.shape)}"
                )
            with torch.no_grad():
                obj.copy_(state)
        else:
            obj.load_state_dict(state)
    except Exception as exc:
        raise CheckpointError(
            f"Could not restore checkpoint object '{name}' ({type(obj).__name__}): {exc}. "
            "Build it exactly as when it was saved (same layer sizes, same parameters in the "
            "optimizer), or leave it out of the Checkpoint."
        ) from exc


def _missing_path_error(path: str) -> CheckpointError:
    directory = _directory_of(path)
    if os.path.isdir(path):
        return CheckpointError(
            f"Checkpoint path {path!r} is a directory; pass a checkpoint file, e.g. "
            f"td.latest_checkpoint({path!r})."
        )
    if not os.path.isdir(directory):
        return CheckpointError(f"Checkpoint path {path!r} does not exist (no directory {directory!r}).")
    available = _available(directory)
    if not available:
        return CheckpointError(
            f"Checkpoint path {path!r} does not exist, and {directory!r} holds no checkpoints."
        )
    return CheckpointError(
        f"Checkpoint path {path!r} does not exist. Checkpoints in {directory!r}: "
        f"{', '.join(os.path.basename(p) for p in available)}; "
        f"td.latest_checkpoint({directory!r}) gives the newest ({latest_checkpoint(directory)!r})."
    )


def _load_file(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise _missing_path_error(path)
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


# -- CheckpointManager -------------------------------------------------------------------
class CheckpointManager:
    """Numbered checkpoints in one directory, keeping the newest ``max_to_keep``.

    >>> import tempfile, torch, torch_distribute as td
    >>> step = torch.zeros((), dtype=torch.int64)
    >>> manager = td.CheckpointManager(td.Checkpoint(step=step), tempfile.mkdtemp(), max_to_keep=2)
    >>> manager.restore_or_initialize() is None  # nothing saved yet
    True
    >>> for _ in range(3):
    ...     step += 1
    ...     _ = manager.save()
    >>> [p.rsplit("-", 1)[1] for p in manager.checkpoints]
    ['2', '3']
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        checkpoint_name: str = "ckpt",
    ):
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentError(
                f"CheckpointManager needs a td.Checkpoint, got {type(checkpoint).__name__}: "
                "wrap the objects, e.g. td.Checkpoint(model=model, optimizer=optimizer)."
            )
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise InvalidArgumentError(
                f"max_to_keep must be a positive int or None (keep all), got {max_to_keep!r}."
            )
        if not checkpoint_name or os.sep in checkpoint_name:
            raise InvalidArgumentError(
                f"checkpoint_name must be a plain file name prefix, got {checkpoint_name!r}."
            )
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._names = self._existing()

    def _existing(self) -> list[str]:
        index = _read_index(self._directory)
        names = [
            n for n in (index or {}).get("all", [])
            if isinstance(n, str) and (m := _NUMBERED.match(n)) and m["name"] == self._name
        ]
        if not names:
            names = _scan_numbered(self._directory, self._name)
        return [n for n in names if os.path.isfile(os.path.join(self._directory, n))]

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the kept checkpoints, oldest first."""
        return [os.path.join(self._directory, n) for n in self._names]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest checkpoint, or ``None``."""
        return os.path.join(self._directory, self._names[-1]) if self._names else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Save ``directory/<checkpoint_name>-<n>`` and delete the oldest beyond ``max_to_keep``.

        ``n`` is ``checkpoint_number`` (e.g. the global step) or else the checkpoint's
        incremented ``save_counter``. Returns the path written.
        """
        counter = self._checkpoint.save_counter + 1
        number = counter if checkpoint_number is None else int(checkpoint_number)
        basename = f"{self._name}-{number}"
        path = os.path.join(self._directory, basename)
        self._checkpoint._write_file(path, counter, "save")
        self._checkpoint.save_counter = counter
        names = [n for n in self._names if n != basename] + [basename]
        stale: list[str] = []
        if self._max_to_keep is not None and len(names) > self._max_to_keep:
            stale, names = names[: -self._max_to_keep], names[-self._max_to_keep:]
        self._names = names
        if _should_write(self._checkpoint._objects.values()):
            # Index first: a crash before the deletes leaves extra files, never a dangling index.
            _write_index(self._directory, basename, names)
            for old in stale:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self._directory, old))
        return path

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its path; ``None`` if there is none."""
        latest = self.latest_checkpoint
        if latest is None:
            return None
        self._checkpoint.restore(latest)
        return latest
