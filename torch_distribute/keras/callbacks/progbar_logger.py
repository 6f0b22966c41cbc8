"""``ProgbarLogger``: the progress bar ``fit`` adds when ``verbose`` is 1 or 2 (chief only)."""

from __future__ import annotations

from typing import IO, Any

from torch_distribute.keras.callbacks.base import Callback, Logs
from torch_distribute.keras.progbar import Progbar


class ProgbarLogger(Callback):
    """Prints ``Epoch 1/5`` then Keras' bar: ``5/5 [====] - 1s 10ms/step - loss: ... - accuracy: ...``.

    ``verbose=1``: the bar (redrawn on a terminal, one final line per epoch in a log);
    ``verbose=2``: one line per epoch; ``0``: nothing. Only the chief prints.
    """

    def __init__(self, verbose: int = 1, stream: IO[str] | None = None):
        super().__init__()
        self.verbose = verbose
        self.stream = stream
        self.wants_batch_logs = verbose == 1
        self._bar: Progbar | None = None
        self._seen = 0
        self._mode = "train"

    def _active(self) -> bool:
        return self.verbose > 0 and self.is_chief

    def _print(self, text: str) -> None:
        if self._active():
            print(text, file=self.stream, flush=True)

    def _new_bar(self, target: int | None) -> None:
        self._seen = 0
        self._bar = Progbar(target, verbose=self.verbose if self._active() else 0, stream=self.stream)

    def _update(self, batch: int, logs: Logs | None, finalize: bool = False) -> None:
        self._seen = batch + 1
        if self._bar is not None:
            self._bar.update(self._seen, _shown(logs), finalize=finalize)

    # -- fit -------------------------------------------------------------------------------
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._mode = "train"
        epochs = self.params.get("epochs")
        self._print(f"Epoch {epoch + 1}/{epochs}")
        self._new_bar(self.params.get("steps"))

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._update(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._bar is not None:
            self._bar.update(max(self._seen, 1), _shown(logs), finalize=True)

    # -- evaluate / validation ---------------------------------------------------------------
    def on_test_begin(self, logs: Logs | None = None) -> None:
        if self._mode == "train" and self.params.get("in_fit"):
            return  # validation inside fit: its numbers go on the epoch's line
        self._new_bar(self.params.get("steps"))

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if not self.params.get("in_fit"):
            self._update(batch, logs)

    def on_test_end(self, logs: Logs | None = None) -> None:
        if not self.params.get("in_fit") and self._bar is not None:
            self._bar.update(max(self._seen, 1), _shown(logs), finalize=True)

    # -- predict ---------------------------------------------------------------------------
    def on_predict_begin(self, logs: Logs | None = None) -> None:
        self._new_bar(self.params.get("steps"))

    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._update(batch, None)

    def on_predict_end(self, logs: Logs | None = None) -> None:
        if self._bar is not None:
            self._bar.update(max(self._seen, 1), None, finalize=True)


def _shown(logs: Any) -> dict[str, float]:
    return {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
