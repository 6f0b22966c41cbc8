"""Learning-rate callbacks: ``LearningRateScheduler`` and ``ReduceLROnPlateau``.

Both set ``lr`` in every param group of ``model.optimizer`` (outside ``strategy.run``, the
optimizer is one object whatever the replica count) and log ``learning_rate``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras.callbacks.base import Callback, Logs
from torch_distribute.keras.callbacks.monitor import Monitor


def get_lr(model: Any) -> float:
    return float(model.optimizer.param_groups[0]["lr"])


def set_lr(model: Any, lr: float) -> None:
    for group in model.optimizer.param_groups:
        group["lr"] = float(lr)


class LearningRateScheduler(Callback):
    """At the start of every epoch, ``lr = schedule(epoch, lr)`` (or ``schedule(epoch)``).

    >>> import torch_distribute as td
    >>> halve = td.keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr if epoch < 2 else lr / 2)
    """

    def __init__(self, schedule: Callable[..., float], verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise InvalidArgumentError(f"LearningRateScheduler needs a function schedule(epoch, lr), got {schedule!r}.")
        self.schedule = schedule
        self.verbose = verbose
        try:
            self._takes_lr = len(inspect.signature(schedule).parameters) >= 2
        except (TypeError, ValueError):  # builtins without a signature
            self._takes_lr = True

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        lr = self.schedule(epoch, get_lr(self.model)) if self._takes_lr else self.schedule(epoch)
        if not isinstance(lr, (int, float)) or isinstance(lr, bool):
            raise InvalidArgumentError(f"The schedule of LearningRateScheduler must return a float, got {lr!r}.")
        set_lr(self.model, lr)
        if self.verbose and self.is_chief:
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.", flush=True)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = get_lr(self.model)


class ReduceLROnPlateau(Callback):
    """Multiply the learning rate by ``factor`` when ``monitor`` has not improved for ``patience`` epochs.

    >>> import torch_distribute as td
    >>> plateau = td.keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=2)
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10, verbose: int = 0,
                 mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0):
        super().__init__()
        if factor >= 1.0:
            raise InvalidArgumentError(f"ReduceLROnPlateau factor must be < 1 (it multiplies the rate), got {factor}.")
        self.monitor = monitor
        self.factor = factor
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.min_delta = min_delta
        self.cooldown = cooldown
        self.min_lr = min_lr
        self.on_train_begin()

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._monitor = Monitor(self.monitor, self.mode, self.min_delta, owner="ReduceLROnPlateau")
        self.wait = 0
        self.cooldown_counter = 0

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = get_lr(self.model)
        current = self._monitor.value(logs)
        if current is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._monitor.improved(current):
            self.wait = 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience:
                old = get_lr(self.model)
                if old > self.min_lr:
                    new = max(old * self.factor, self.min_lr)
                    set_lr(self.model, new)
                    if self.verbose and self.is_chief:
                        print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new}.", flush=True)
                    self.cooldown_counter = self.cooldown
                    self.wait = 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self._monitor.best, "wait": self.wait, "cooldown_counter": self.cooldown_counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._monitor.best = float(state["best"])
        self.wait = int(state["wait"])
        self.cooldown_counter = int(state["cooldown_counter"])
