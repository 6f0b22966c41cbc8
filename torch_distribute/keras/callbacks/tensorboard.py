"""``TensorBoard``: scalars of every epoch (and every N batches) as TensorBoard event files."""

from __future__ import annotations

import os
from typing import Any

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras.callbacks.base import Callback, Logs


class TensorBoard(Callback):
    """Write the logs to ``log_dir/train`` and ``log_dir/validation``, as Keras does.

    Tags are ``epoch_<name>`` (``epoch_loss``, ``epoch_accuracy``; validation values go to
    the ``validation`` run without their ``val_`` prefix) and, with ``update_freq=N``
    batches, ``batch_<name>`` every N batches. Only the chief writes (``should_save_summary``).
    Needs the ``tensorboard`` package (``pip install tensorboard``).

    >>> import torch_distribute as td
    >>> tb = td.keras.callbacks.TensorBoard(log_dir="logs/run1")
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", update_freq: str | int = "epoch"):
        super().__init__()
        if update_freq != "epoch" and (isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1):
            raise InvalidArgumentError(f"TensorBoard update_freq must be 'epoch' or a positive int, got {update_freq!r}.")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self.wants_batch_logs = update_freq != "epoch"
        self._writers: dict[str, Any] = {}
        self._step = 0

    def _writer(self, run: str) -> Any:
        if run not in self._writers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:  # pragma: no cover - depends on the environment
                raise ImportError("td.keras.callbacks.TensorBoard needs tensorboard: `pip install tensorboard`.") from error
            self._writers[run] = SummaryWriter(os.path.join(self.log_dir, run))
        return self._writers[run]

    def _should_write(self) -> bool:
        strategy = getattr(self.model, "distribute_strategy", None)
        return strategy is None or bool(strategy.extended.should_save_summary)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._step = 0

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._step += 1
        update_freq = self.update_freq
        # "epoch" is the only string __init__ accepts
        if not isinstance(update_freq, int) or self._step % update_freq or not self._should_write():
            return
        for name, value in (logs or {}).items():
            self._writer("train").add_scalar(f"batch_{name}", float(value), self._step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self._should_write():
            return
        for name, value in (logs or {}).items():
            run, tag = ("validation", name[4:]) if name.startswith("val_") else ("train", name)
            self._writer(run).add_scalar(f"epoch_{tag}", float(value), epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
