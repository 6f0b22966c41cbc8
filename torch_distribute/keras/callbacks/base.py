"""``Callback`` (Keras' hook names) and ``CallbackList``, which calls them in order.

``fit``/``evaluate``/``predict`` call the hooks on every worker with the same, global logs
(metrics are sync-on-read: their ``result()`` is the value over every replica and worker),
so callbacks decide the same thing everywhere (``EarlyStopping`` stops every worker at the
same epoch). Callbacks that write files or print do it on the chief only: they check
``self.is_chief``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Logs = dict[str, Any]


class Callback:
    """Base class: override the hooks you need (every one does nothing by default).

    ``self.model`` is the ``td.keras.Model``; ``self.params`` holds ``epochs``, ``steps``
    and ``verbose``. A callback with state to resume after a crash (``BackupAndRestore``)
    defines ``state_dict()``/``load_state_dict()``.

    >>> import torch_distribute as td
    >>> class PrintEpoch(td.keras.callbacks.Callback):
    ...     def on_epoch_end(self, epoch, logs=None):
    ...         print(epoch, sorted(logs))
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    @property
    def is_chief(self) -> bool:
        """Whether this process writes files and prints (the chief; every single process)."""
        strategy = getattr(self.model, "distribute_strategy", None)
        return strategy is None or bool(strategy.extended.should_checkpoint)

    # -- the hooks ------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...

    # Keras' older names for the training batch hooks.
    def on_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...


def overrides(callback: Callback, hook: str) -> bool:
    """Whether ``callback`` does something in ``hook`` (its class or instance overrides it)."""
    if hook in vars(callback):
        return True
    return getattr(type(callback), hook, None) is not getattr(Callback, hook)


class CallbackList:
    """Calls each hook of every callback, in order."""

    def __init__(self, callbacks: Iterable[Callback], model: Any, params: dict[str, Any]):
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            callback.set_model(model)
            callback.set_params(params)

    def wants_batch_logs(self, mode: str) -> bool:
        """Whether some callback uses per-batch logs in ``mode`` (``train``, ``test``, ``predict``).

        Batch logs cost a reduction of every metric across replicas and workers; the
        answer depends on the callbacks only, never on which worker asks, so every worker
        makes the same collectives.
        """
        hooks = [f"on_{mode}_batch_end"] + (["on_batch_end"] if mode == "train" else [])
        return any(getattr(cb, "wants_batch_logs", None) is not False and any(overrides(cb, h) for h in hooks)
                   for cb in self.callbacks)

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._call("on_train_begin", logs)

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._call("on_train_end", logs)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._call("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self._call("on_epoch_end", epoch, logs)

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self._call("on_train_batch_begin", batch, logs)
        self._call("on_batch_begin", batch, logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._call("on_train_batch_end", batch, logs)
        self._call("on_batch_end", batch, logs)

    def on_test_begin(self, logs: Logs | None = None) -> None:
        self._call("on_test_begin", logs)

    def on_test_end(self, logs: Logs | None = None) -> None:
        self._call("on_test_end", logs)

    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self._call("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._call("on_test_batch_end", batch, logs)

    def on_predict_begin(self, logs: Logs | None = None) -> None:
        self._call("on_predict_begin", logs)

    def on_predict_end(self, logs: Logs | None = None) -> None:
        self._call("on_predict_end", logs)

    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self._call("on_predict_batch_begin", batch, logs)

    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._call("on_predict_batch_end", batch, logs)
