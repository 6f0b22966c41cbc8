"""``RemoteValue``: the future result of a scheduled function."""

from __future__ import annotations

import enum
import threading
from typing import Any

from torch_distribute.errors import ClosureCancelledError, InvalidArgumentError


class RemoteValueStatus(enum.Enum):
    """Where a scheduled function's ``RemoteValue`` stands: not ready, aborted (to run again), ready."""

    NOT_READY = "NOT_READY"
    ABORTED = "ABORTED"  # its worker failed; it will run again on another worker
    READY = "READY"


class RemoteValue:
    """The value a scheduled function returns, once it has run on some worker.

    ``fetch()``/``get()`` block until then and return the value (tensors on the CPU); they
    raise the function's own error if it failed and ``ClosureCancelledError`` if it was
    cancelled because an earlier function failed. A ``RemoteValue`` cannot be an argument of
    another ``schedule`` (as in TensorFlow).

    >>> value = RemoteValue()
    >>> value.set_value(3)
    >>> value.fetch()
    3
    """

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._status = RemoteValueStatus.NOT_READY

    @property
    def status(self) -> RemoteValueStatus:
        return self._status

    def fetch(self) -> Any:
        """Block until the function has run; its return value."""
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def get(self) -> Any:
        """Same as ``fetch()`` (TensorFlow returns tensors here, numpy from fetch)."""
        return self.fetch()

    def set_value(self, value: Any) -> None:
        self._value = value
        self._status = RemoteValueStatus.READY
        self._ready.set()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._status = RemoteValueStatus.READY
        self._ready.set()

    def set_aborted(self) -> None:
        self._status = RemoteValueStatus.ABORTED

    def cancel(self) -> None:
        self.set_error(ClosureCancelledError(
            "This scheduled function was cancelled before it ran: an earlier scheduled function "
            "failed (its error was raised by schedule/join/done)."
        ))

    def td_reference(self) -> Any:
        raise InvalidArgumentError(
            "A RemoteValue cannot be an argument of schedule(): fetch() it first, or keep the "
            "state on the parameter servers (a module made in strategy.scope())."
        )

    def __repr__(self) -> str:
        return f"RemoteValue(status={self._status.value})"
