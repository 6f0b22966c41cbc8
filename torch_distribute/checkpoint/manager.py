"""``CheckpointManager``: numbered checkpoints in one directory, the newest ``max_to_keep`` kept.

The manager records its files in the directory's ``checkpoint`` index (see ``index``), which
``latest_checkpoint`` (re-exported here) reads.

>>> import tempfile, torch, torch_distribute as td
>>> step = torch.zeros((), dtype=torch.int64)
>>> manager = td.CheckpointManager(td.Checkpoint(step=step), tempfile.mkdtemp(), max_to_keep=2)
>>> for _ in range(3):
...     step += 1
...     _ = manager.save()
>>> [p.rsplit("-", 1)[1] for p in manager.checkpoints]
['2', '3']
"""

from __future__ import annotations

import os

from torch_distribute.checkpoint.file_io import checkpoint_exists, remove_checkpoint
from torch_distribute.checkpoint.index import (
    NUMBERED,
    latest_checkpoint,
    read_index,
    scan_numbered,
    write_index,
)
from torch_distribute.checkpoint.object_graph import Checkpoint, should_write, write_checkpoint_file
from torch_distribute.errors import InvalidArgumentError

__all__ = ["CheckpointManager", "latest_checkpoint"]


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
        index = read_index(self._directory)
        names = [
            n for n in (index or {}).get("all", [])
            if isinstance(n, str) and (m := NUMBERED.match(n)) and m["name"] == self._name
        ]
        if not names:
            names = scan_numbered(self._directory, self._name)
        return [n for n in names if checkpoint_exists(os.path.join(self._directory, n))]

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
        write_checkpoint_file(self._checkpoint, path, counter, "save")
        self._checkpoint.save_counter = counter
        names = [n for n in self._names if n != basename] + [basename]
        stale: list[str] = []
        if self._max_to_keep is not None and len(names) > self._max_to_keep:
            stale, names = names[: -self._max_to_keep], names[-self._max_to_keep:]
        self._names = names
        if should_write(self._checkpoint):
            # Index first: a crash before the deletes leaves extra files, never a dangling index.
            write_index(self._directory, basename, names)
            for old in stale:
                remove_checkpoint(os.path.join(self._directory, old))
        return path

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its path; ``None`` if there is none."""
        latest = self.latest_checkpoint
        if latest is None:
            return None
        self._checkpoint.restore(latest)
        return latest
