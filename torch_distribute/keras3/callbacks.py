"""Keras' callbacks on several workers: files written by the chief, backups read by all.

Every worker of a ``MultiWorkerMirroredStrategy`` job runs the same ``fit`` with the same
callbacks, and the logs they see are the global ones (``forward.py``), so ``EarlyStopping``,
``LearningRateScheduler``, ``ReduceLROnPlateau`` and ``History`` decide alike on every
worker. What writes files must not write them once per worker into the same path, so, as
TensorFlow does, on workers other than the chief (``strategy.extended.should_checkpoint``):

- ``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard`` and an explicit ``ProgbarLogger`` are
  silenced (TensorFlow lets them write to a temporary directory it then deletes: the same
  files, none); ``fit``'s own progress bar is turned off (``verbose=0``).
- ``BackupAndRestore`` restores (every worker loads the chief's backup when ``fit`` starts)
  but neither writes nor deletes it: the chief does.

Any other callback runs on every worker, as in TensorFlow.

>>> CHIEF_ONLY, RESTORE_ONLY
(('ModelCheckpoint', 'CSVLogger', 'TensorBoard', 'ProgbarLogger'), ('BackupAndRestore',))
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from torch_distribute import context

#: Keras callbacks that only the chief runs.
CHIEF_ONLY = ("ModelCheckpoint", "CSVLogger", "TensorBoard", "ProgbarLogger")
#: Keras callbacks that workers other than the chief run only to restore.
RESTORE_ONLY = ("BackupAndRestore",)


def for_this_worker(callbacks: Any, strategy: context.StrategyLike, keras: ModuleType) -> Any:
    """``callbacks`` as this worker runs them (unchanged on the chief, or in one process)."""
    extended = strategy.extended
    if callbacks is None or extended.should_checkpoint or extended.num_workers_in_sync == 1:
        return callbacks
    if isinstance(callbacks, keras.callbacks.CallbackList):  # fit's own, handed to evaluate
        return callbacks
    chief_only = tuple(getattr(keras.callbacks, name) for name in CHIEF_ONLY if hasattr(keras.callbacks, name))
    restore_only = tuple(getattr(keras.callbacks, name) for name in RESTORE_ONLY)
    adapted = []
    for callback in callbacks:
        if isinstance(callback, chief_only):
            adapted.append(_wrappers(keras)[0](callback))
        elif isinstance(callback, restore_only):
            adapted.append(_wrappers(keras)[1](callback))
        else:
            adapted.append(callback)
    return adapted


@functools.cache
def _wrappers(keras: ModuleType) -> tuple[type, type]:
    """The two wrapper classes, made once Keras is imported (they subclass its ``Callback``)."""

    class ChiefOnly(keras.callbacks.Callback):
        """A callback that runs on the chief only: here it does nothing."""

        def __init__(self, callback: Any):
            super().__init__()
            self.callback = callback

    class RestoreOnly(keras.callbacks.Callback):
        """A ``BackupAndRestore`` that restores the chief's backup but never writes one."""

        def __init__(self, callback: Any):
            super().__init__()
            self.callback = callback

        def set_model(self, model: Any) -> None:
            super().set_model(model)
            self.callback.set_model(model)

        def set_params(self, params: Any) -> None:
            super().set_params(params)
            self.callback.set_params(params)

        def on_train_begin(self, logs: Any = None) -> None:
            self.callback.on_train_begin(logs)

    return ChiefOnly, RestoreOnly
