"""``CSVLogger``: one CSV row of logs per epoch (chief only)."""

from __future__ import annotations

import csv
import os
from typing import IO, Any

from torch_distribute.keras.callbacks.base import Callback, Logs


class CSVLogger(Callback):
    """Write ``epoch`` and every logged value to ``filename``, one row per epoch.

    The columns are ``epoch`` then the logged names in sorted order (Keras' layout); a value
    missing from an epoch (validation every N epochs) is written ``NA``. ``append=True``
    adds to an existing file without repeating the header.

    >>> import torch_distribute as td
    >>> logger = td.keras.callbacks.CSVLogger("training.csv", append=True)
    """

    def __init__(self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False):
        super().__init__()
        self.filename = os.fspath(filename)
        self.separator = separator
        self.append = append
        self.keys: list[str] | None = None
        self._file: IO[str] | None = None
        self._writer: Any = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.keys = None
        if not self.is_chief:
            return
        directory = os.path.dirname(self.filename)
        if directory:
            os.makedirs(directory, exist_ok=True)
        has_header = self.append and os.path.exists(self.filename) and os.path.getsize(self.filename) > 0
        if has_header:
            with open(self.filename, newline="") as f:
                self.keys = next(csv.reader(f, delimiter=self.separator))[1:]
        self._file = open(self.filename, "a" if self.append else "w", newline="")  # noqa: SIM115 - closed at train end

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._file is None:
            return
        logs = logs or {}
        if self.keys is None:
            self.keys = sorted(logs)
        if self._writer is None:
            self._writer = csv.writer(self._file, delimiter=self.separator)
            if self._file.tell() == 0:
                self._writer.writerow(["epoch", *self.keys])
        self._writer.writerow([epoch, *(logs.get(k, "NA") for k in self.keys)])
        self._file.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._writer = None, None
