"""Keras' callbacks on several workers: files written by the chief, and saves that every
worker waits for.

Every worker of a ``MultiWorkerMirroredStrategy`` job runs the same ``fit`` with the same
callbacks, and the logs they see are the global ones (``forward.py``), so ``EarlyStopping``,
``LearningRateScheduler``, ``ReduceLROnPlateau`` and ``History`` decide alike on every
worker. What writes files must not write them once per worker into the same path, so, as
TensorFlow does:

- ``ModelCheckpoint`` and ``BackupAndRestore`` write on the chief only
  (``strategy.extended.should_checkpoint``; TensorFlow lets the other workers write into a
  temporary directory it deletes: the same files, none), and every worker restores from the
  chief's ``BackupAndRestore`` files when ``fit`` starts. Each of their saves is a
  synchronisation point: after the hook that may save (the end of an epoch, or of a batch
  with an integer ``save_freq``), every worker waits until the chief has written, so a worker
  that reads the file next (``load_weights`` after ``fit``, every worker after a restart)
  reads it whole, and a worker that dies right after cannot cut the chief's write short.
- ``CSVLogger``, ``TensorBoard`` and an explicit ``ProgbarLogger`` run on the chief only, and
  ``fit``'s own progress bar is the chief's (``verbose=0`` elsewhere).

Any other callback runs on every worker, as in TensorFlow.

>>> CHIEF_ONLY, CHIEF_WRITES
(('CSVLogger', 'TensorBoard', 'ProgbarLogger'), ('ModelCheckpoint', 'BackupAndRestore'))
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy

#: Keras callbacks that only the chief runs.
CHIEF_ONLY = ("CSVLogger", "TensorBoard", "ProgbarLogger")
#: Keras callbacks whose files the chief writes and every worker waits for.
CHIEF_WRITES = ("ModelCheckpoint", "BackupAndRestore")


def for_this_worker(callbacks: Any, strategy: Strategy, keras: ModuleType) -> Any:
    """``callbacks`` as this worker runs them (unchanged in one process)."""
    extended = strategy.extended
    if callbacks is None or extended.num_workers_in_sync == 1:
        return callbacks
    if isinstance(callbacks, keras.callbacks.CallbackList):  # fit's own, handed to evaluate
        return callbacks
    chief_only = tuple(getattr(keras.callbacks, name) for name in CHIEF_ONLY if hasattr(keras.callbacks, name))
    chief_writes = tuple(getattr(keras.callbacks, name) for name in CHIEF_WRITES)
    silenced, synchronised = _wrappers(keras)
    adapted = []
    for callback in callbacks:
        if isinstance(callback, chief_writes):
            adapted.append(synchronised(callback, strategy))
        elif isinstance(callback, chief_only) and not extended.should_checkpoint:
            adapted.append(silenced(callback))
        else:
            adapted.append(callback)
    return adapted


@functools.cache
def _wrappers(keras: ModuleType) -> tuple[type, type]:
    """The wrapper classes, made once Keras is imported (they subclass its ``Callback``)."""
    base: Any = keras.callbacks.Callback

    class ChiefOnly(base):
        """A callback the chief runs: on this worker it does nothing."""

        def __init__(self, callback: Any):
            super().__init__()
            self.callback = callback

    class ChiefWrites(base):
        """A callback that saves files: the chief runs it; every worker restores with it
        (``on_train_begin``) and waits for each of its saves."""

        def __init__(self, callback: Any, strategy: Strategy):
            super().__init__()
            self.callback = callback
            self._strategy = strategy
            self._writes = strategy.extended.should_checkpoint
            self._per_batch = getattr(callback, "save_freq", "epoch") not in ("epoch", False, None)

        def _wait_for_chief(self, what: str) -> None:
            self._strategy.extended.all_gather_objects(what, f"the chief's {type(self.callback).__name__} {what}")

        def set_model(self, model: Any) -> None:
            super().set_model(model)
            self.callback.set_model(model)

        def set_params(self, params: Any) -> None:
            super().set_params(params)
            self.callback.set_params(params)

        def on_train_begin(self, logs: Any = None) -> None:
            if self._writes or isinstance(self.callback, keras.callbacks.BackupAndRestore):
                self.callback.on_train_begin(logs)  # every worker restores the chief's backup

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if self._writes:
                self.callback.on_epoch_begin(epoch, logs)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if self._writes:
                self.callback.on_train_batch_begin(batch, logs)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self._writes:
                self.callback.on_train_batch_end(batch, logs)
            if self._per_batch:
                self._wait_for_chief("save after a batch")

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if self._writes:
                self.callback.on_epoch_end(epoch, logs)
            self._wait_for_chief("save after an epoch")

        def on_train_end(self, logs: Any = None) -> None:
            if self._writes:
                self.callback.on_train_end(logs)
            self._wait_for_chief("end of training")

    return ChiefOnly, ChiefWrites
