"""``ModelCheckpoint``: save the weights every epoch (or every N batches), or only the best."""

from __future__ import annotations

import os
from typing import Any

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras.callbacks.base import Callback, Logs
from torch_distribute.keras.callbacks.monitor import Monitor


class ModelCheckpoint(Callback):
    """Save the model (and optimizer) as a ``td.Checkpoint`` file at ``filepath``.

    ``filepath`` may hold ``{epoch:02d}``, ``{batch}`` and any logged value
    (``"ckpt-{epoch:02d}-{val_loss:.2f}.pt"``). ``save_best_only``: save only when
    ``monitor`` improves (``mode``: ``"auto"``, ``"min"``, ``"max"``).
    By default the whole model is saved (``model.save``: the architecture, the weights, the
    optimizer and its state; ``td.keras.models.load_model(path)`` rebuilds it);
    ``save_weights_only=True`` writes the weights only (``model.save_weights``).
    ``save_freq``: ``"epoch"`` or a number of batches. Every worker calls it, and the save is
    collective: every worker returns once the chief's file is complete, so a
    ``model.load_weights(path)`` on every worker right after ``fit`` reads the same weights.
    With ``save_best_only`` the workers take the chief's value of ``monitor``, so they agree
    on whether to save. The file loads with ``model.load_weights(path)`` or, with no Keras
    wrapper, ``td.Checkpoint(model=module).read(path)``.

    >>> import torch_distribute as td
    >>> cb = td.keras.callbacks.ModelCheckpoint("ckpt/best.pt", monitor="val_loss", save_best_only=True)
    """

    def __init__(self, filepath: str | os.PathLike[str], monitor: str = "val_loss", verbose: int = 0,
                 save_best_only: bool = False, save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", initial_value_threshold: float | None = None):
        super().__init__()
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise InvalidArgumentError(f"ModelCheckpoint save_freq must be 'epoch' or a positive int, got {save_freq!r}.")
        self.filepath = os.fspath(filepath)
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.save_freq = save_freq
        self.wants_batch_logs = save_freq != "epoch"
        self._monitor = Monitor(monitor, mode, baseline=initial_value_threshold, owner="ModelCheckpoint")
        self._epoch = 0
        self._batches_seen = 0
        self.saved: list[str] = []

    @property
    def best(self) -> float:
        return self._monitor.best

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        save_freq = self.save_freq
        if not isinstance(save_freq, int):  # "epoch", the only string __init__ accepts
            return
        self._batches_seen += 1
        if self._batches_seen % save_freq == 0:
            self._save(self._epoch, batch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, None, logs)

    def _save(self, epoch: int, batch: int | None, logs: Logs | None) -> None:
        path = self._format(epoch, batch, logs or {})
        if self.save_best_only:
            previous = self._monitor.best
            current = self._chiefs(self._monitor.value(logs))
            if current is None:
                return
            if not self._monitor.improved(current):
                self._log(f"Epoch {epoch + 1}: {self._monitor.monitor} did not improve from {previous:.5f}")
                return
            self._log(f"Epoch {epoch + 1}: {self._monitor.monitor} improved from {previous:.5f} to "
                      f"{current:.5f}, saving model to {path}")
        else:
            self._log(f"Epoch {epoch + 1}: saving model to {path}")
        if self.save_weights_only:
            self.model.save_weights(path)
        else:  # the whole model, as Keras: load_model(path) rebuilds it, load_weights(path) reads it too
            self.model.save(path)
        self.saved.append(path)

    def _chiefs(self, value: float | None) -> float | None:
        """The chief's ``value`` on every worker (one ``all_gather_objects`` under several
        workers): the decision to save is a collective write, so every worker must make it."""
        strategy = getattr(self.model, "distribute_strategy", None)
        extended = getattr(strategy, "extended", None)
        if extended is None or extended.num_workers_in_sync <= 1:
            return value
        gathered = extended.all_gather_objects((bool(extended.should_checkpoint), value),
                                               what="ModelCheckpoint's monitored value")
        return next((v for writes, v in gathered if writes), gathered[0][1])

    def _format(self, epoch: int, batch: int | None, logs: Logs) -> str:
        try:
            return self.filepath.format(epoch=epoch + 1, batch=None if batch is None else batch + 1, **logs)
        except (KeyError, IndexError, ValueError) as error:
            raise InvalidArgumentError(
                f"ModelCheckpoint filepath {self.filepath!r} could not be filled in ({error!r}). "
                f"Available fields: epoch, batch, {', '.join(sorted(logs))}."
            ) from error

    def _log(self, message: str) -> None:
        if self.verbose and self.is_chief:
            print(message, flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self._monitor.best, "batches_seen": self._batches_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._monitor.best = float(state["best"])
        self._batches_seen = int(state["batches_seen"])
