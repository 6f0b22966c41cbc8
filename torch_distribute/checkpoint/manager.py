"""``CheckpointManager``: numbered checkpoints in one directory, the newest ``max_to_keep`` kept.

The manager records its files in the directory's ``checkpoint`` index (see ``index``), which
``latest_checkpoint`` (re-exported here) reads. Under several workers every worker calls
``save`` (a collective: see ``collective``); a non-chief pointed at a directory of its own
writes its own copy there and keeps its own index and ``max_to_keep`` there.

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
import warnings

from torch_distribute.checkpoint.collective import num_workers
from torch_distribute.checkpoint.file_io import (
    CorruptCheckpointError,
    checkpoint_exists,
    remove_checkpoint,
    remove_stale_temporaries,
)
from torch_distribute.checkpoint.index import (
    NUMBERED,
    check_checkpoint,
    latest_checkpoint,
    newest_intact,
    read_index,
    scan_numbered,
    write_index,
)
from torch_distribute.checkpoint.object_graph import (
    Checkpoint,
    owning_strategy,
    write_checkpoint_file,
)
from torch_distribute.errors import CheckpointError, InvalidArgumentError

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
        remove_stale_temporaries(self._directory)  # left by a save that crashed (see file_io)
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
        """Path of the newest intact checkpoint, or ``None``.

        Cheap checks only (as ``td.latest_checkpoint``): a truncated newest checkpoint is
        passed over with a warning naming it; ``restore_or_initialize`` also compares the
        checksums.
        """
        return newest_intact(list(reversed(self.checkpoints)), repr(self._directory))

    def save(self, checkpoint_number: int | None = None) -> str:
        """Save ``directory/<checkpoint_name>-<n>`` and delete the oldest beyond ``max_to_keep``.

        ``n`` is ``checkpoint_number`` (e.g. the global step) or else the checkpoint's
        incremented ``save_counter``. Returns the path written. Every worker calls it and
        returns once the file exists: see ``Checkpoint.save``.
        """
        counter = self._checkpoint.save_counter + 1
        number = counter if checkpoint_number is None else int(checkpoint_number)
        basename = f"{self._name}-{number}"
        path = os.path.join(self._directory, basename)
        names = [n for n in self._names if n != basename] + [basename]
        stale: list[str] = []
        if self._max_to_keep is not None and len(names) > self._max_to_keep:
            stale, names = names[: -self._max_to_keep], names[-self._max_to_keep:]

        def record() -> None:
            # Index first: a crash before the deletes leaves extra files, never a dangling index.
            write_index(self._directory, basename, names)
            for old in stale:
                remove_checkpoint(os.path.join(self._directory, old))

        write_checkpoint_file(self._checkpoint, path, counter, "save", after_write=record)
        self._checkpoint.save_counter = counter
        self._names = names
        return path

    def restore_or_initialize(self) -> str | None:
        """Restore the newest intact checkpoint and return its path; ``None`` if there is none.

        A checkpoint that is truncated or fails its checksum is passed over with a
        ``warnings.warn`` naming it, and the next newest is restored (a damaged file is
        detected before anything is restored from it). Raises ``CheckpointError`` if every
        checkpoint is damaged. Under several workers every worker calls it: they compare what
        they restored (one ``all_gather_objects``) and, if a checkpoint was damaged for some
        of them, all fall back to the same older one, so no worker trains on other weights.
        """
        extended = owning_strategy([self._checkpoint]).extended
        agreed: set[str] = set()  # damaged somewhere, as every worker knows (the same on all)
        mine: set[str] = set()  # damaged here
        damaged: list[CorruptCheckpointError] = []
        while True:
            restored = None
            for path in reversed(self.checkpoints):
                name = os.path.basename(path)
                if name in agreed or name in mine or not checkpoint_exists(path):
                    continue
                try:
                    check_checkpoint(path, full=False)
                    self._checkpoint.restore(path)
                except CorruptCheckpointError as exc:
                    damaged.append(exc)
                    mine.add(name)
                    continue
                restored = path
                break
            if num_workers(extended) <= 1:
                agreed = mine
                break
            outcomes = extended.all_gather_objects(
                {"restored": restored and os.path.basename(restored), "damaged": sorted(mine)},
                what="CheckpointManager.restore_or_initialize")
            chosen = {entry["restored"] for entry in outcomes}
            everywhere = set().union(*(entry["damaged"] for entry in outcomes))
            if len(chosen) == 1 and not (chosen & everywhere):
                agreed |= everywhere
                break
            if everywhere <= agreed:  # no damage explains it: the workers see other files
                raise CheckpointError(
                    f"Workers restored different checkpoints from {self._directory!r}: "
                    + ", ".join(f"worker {i}: {entry['restored']}" for i, entry in enumerate(outcomes))
                    + ". Give every worker the same checkpoints (the same directory on a shared disk), "
                    "or restore the chief's on every worker: "
                    "checkpoint.restore(td.latest_checkpoint(chief_directory))."
                )
            for name in sorted(everywhere - agreed - mine):
                workers = [i for i, entry in enumerate(outcomes) if name in entry["damaged"]]
                warnings.warn(f"Checkpoint {os.path.join(self._directory, name)!r} is damaged on worker(s) "
                              f"{workers}; every worker falls back to an older one.", stacklevel=2)
            agreed |= everywhere  # damaged for some worker: every worker skips it
        for error in damaged:
            if restored is not None:
                warnings.warn(f"{error} Restored {restored!r} instead, the newest intact checkpoint.", stacklevel=2)
        if restored is None and agreed:  # on every worker, also where only others saw the damage
            raise CorruptCheckpointError(
                f"Every checkpoint in {self._directory!r} is damaged ({', '.join(sorted(agreed))}): "
                + " ".join(str(e) for e in damaged)
                + " Delete them to start from scratch, or restore a copy from elsewhere."
            )
        return restored
