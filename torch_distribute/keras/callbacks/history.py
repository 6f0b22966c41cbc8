"""``History``: what ``fit`` returns; one list per logged quantity, one entry per epoch.

>>> from torch_distribute.keras.callbacks.history import History
>>> history = History()
>>> history.on_epoch_end(0, {"loss": 0.5, "val_loss": 0.6})
>>> history.history, history.epoch
({'loss': [0.5], 'val_loss': [0.6]}, [0])
"""

from __future__ import annotations

from typing import Any

from torch_distribute.keras.callbacks.base import Callback


class History(Callback):
    """Records every epoch's logs: ``history.history["val_loss"][epoch]``.

    Its state is part of a ``BackupAndRestore`` backup, so a run resumed after a crash
    returns the whole history, as an uninterrupted one does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.history, self.epoch = {}, []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(value)

    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "epoch": list(self.epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.epoch = list(state["epoch"])

    def __repr__(self) -> str:
        return f"History(epochs={len(self.epoch)}, keys={sorted(self.history)})"
