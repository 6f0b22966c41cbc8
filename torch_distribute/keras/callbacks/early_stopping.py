"""``EarlyStopping``: stop training when a monitored quantity stops improving."""

from __future__ import annotations

from typing import Any

import torch

from torch_distribute.keras.callbacks.base import Callback, Logs
from torch_distribute.keras.callbacks.monitor import Monitor


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    ``restore_best_weights``: at the end of training, put back the weights of the best epoch
    (Keras 3's behaviour: also when training ran to the last epoch).
    ``start_from_epoch``: epochs of warm-up before it starts watching. Every worker sees the
    same global logs, so every worker stops at the same epoch.

    >>> import torch_distribute as td
    >>> stop = td.keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0, verbose: int = 0,
                 mode: str = "auto", baseline: float | None = None, restore_best_weights: bool = False,
                 start_from_epoch: int = 0):
        super().__init__()
        self.monitor = monitor
        self.min_delta = min_delta
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self._reset()

    def _reset(self) -> None:
        self._monitor = Monitor(self.monitor, self.mode, self.min_delta, owner="EarlyStopping")
        self.wait = 0
        self.stopped_epoch = 0
        self.best_epoch = 0
        self.best_weights: dict[str, torch.Tensor] | None = None

    @property
    def best(self) -> float:
        return self._monitor.best

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._reset()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        current = self._monitor.value(logs)
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = _snapshot(self.model)  # the first epoch watched is the best so far
        self.wait += 1
        if self._monitor.improved(current):
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = _snapshot(self.model)
            # With a baseline, only an improvement on the baseline resets the patience.
            if self.baseline is None or self._monitor.is_better(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.stopped_epoch > 0 and self.verbose and self.is_chief:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping", flush=True)
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose and self.is_chief:
                print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.", flush=True)
            self.model.load_state_dict(self.best_weights)

    def state_dict(self) -> dict[str, Any]:
        return {"wait": self.wait, "best": self._monitor.best, "best_epoch": self.best_epoch,
                "best_weights": self.best_weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait = int(state["wait"])
        self._monitor.best = float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.best_weights = state["best_weights"]


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
