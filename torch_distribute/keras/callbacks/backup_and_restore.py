"""``BackupAndRestore``: a ``fit`` that crashes resumes at the epoch and batch where it stopped."""

from __future__ import annotations

import os

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras.callbacks.base import Callback


class BackupAndRestore(Callback):
    """Back up the whole training state under ``backup_dir``; a new ``fit`` resumes from it.

    The backup holds the model, the optimizer, the metrics' running totals, the history so
    far, the state of the other callbacks (``EarlyStopping`` patience, best checkpoint), the
    position in the data and every RNG. Run the same program again after a crash and ``fit``
    continues at the same epoch and batch: the final weights are bitwise those of a run
    that never stopped. ``save_freq``: ``"epoch"`` or every N batches. The chief writes it
    (atomically); with several workers every worker restores it. ``delete_checkpoint``:
    remove it once training finishes. SIGTERM makes every worker save and exit (143).

    This is ``td.BackupAndRestore`` driving ``fit``'s loops.

    >>> import torch_distribute as td
    >>> backup = td.keras.callbacks.BackupAndRestore(backup_dir="/tmp/backup", save_freq=50)
    """

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True):
        super().__init__()
        if not backup_dir:
            raise InvalidArgumentError("BackupAndRestore needs a backup_dir (a folder every worker can reach).")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise InvalidArgumentError(f"BackupAndRestore save_freq must be 'epoch' or a positive int, got {save_freq!r}.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
