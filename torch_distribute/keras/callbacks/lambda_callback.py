"""``LambdaCallback`` and ``TerminateOnNaN``: small callbacks built from functions."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch_distribute.keras.callbacks.base import Callback, Logs


class LambdaCallback(Callback):
    """A callback from plain functions, one per hook (Keras' argument names).

    >>> import torch_distribute as td
    >>> seen = []
    >>> cb = td.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(epoch))
    """

    def __init__(self, on_epoch_begin: Callable[..., Any] | None = None, on_epoch_end: Callable[..., Any] | None = None,
                 on_train_begin: Callable[..., Any] | None = None, on_train_end: Callable[..., Any] | None = None,
                 on_train_batch_begin: Callable[..., Any] | None = None,
                 on_train_batch_end: Callable[..., Any] | None = None, **kwargs: Callable[..., Any]):
        super().__init__()
        hooks = dict(on_epoch_begin=on_epoch_begin, on_epoch_end=on_epoch_end, on_train_begin=on_train_begin,
                     on_train_end=on_train_end, on_train_batch_begin=on_train_batch_begin,
                     on_train_batch_end=on_train_batch_end, **kwargs)
        for name, fn in hooks.items():
            if fn is None:
                continue
            if not hasattr(Callback, name) or not name.startswith("on_"):
                raise TypeError(f"LambdaCallback got an unknown hook {name!r}.")
            setattr(self, name, fn)


class TerminateOnNaN(Callback):
    """Stop training as soon as the loss is NaN or infinite."""

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            if self.is_chief:
                print(f"Batch {batch}: invalid loss, terminating training", flush=True)
            self.model.stop_training = True
