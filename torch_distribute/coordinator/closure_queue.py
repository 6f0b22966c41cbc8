"""The queue of scheduled functions ("closures") and the coordinator's error state.

TensorFlow's rules: the first error of a closure is raised by the next ``schedule``,
``join`` or ``done`` (then cleared); the queued closures are cancelled and, when it is
raised, no closure is still running. A lost parameter server is fatal and stays raised.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch_distribute.coordinator.remote_value import RemoteValue


@dataclass
class Closure:
    payload: bytes
    remote_value: RemoteValue
    name: str
    attempts: int = 0


class ClosureQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._stopped = False

    # -- producer side (the user's thread) -----------------------------------------------
    def put(self, closure: Closure) -> None:
        with self._cond:
            self._raise_if_error()
            self._queue.append(closure)
            self._cond.notify_all()

    def raise_if_error(self) -> None:
        with self._cond:
            self._raise_if_error()

    def _raise_if_error(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._error is not None:
            self._cancel_queued()
            self._cond.wait_for(lambda: self._inflight == 0)
            error, self._error = self._error, None
            raise error

    def done(self) -> bool:
        with self._cond:
            self._raise_if_error()
            return not self._queue and self._inflight == 0

    def wait(self, check: Callable[[], None], poll_s: float = 1.0) -> None:
        """Until everything ran (or failed); ``check()`` runs every ``poll_s`` and may raise."""
        with self._cond:
            while not (self._error or self._fatal) and (self._queue or self._inflight):
                self._cond.wait(poll_s)
                if not (self._error or self._fatal) and (self._queue or self._inflight):
                    check()
            self._raise_if_error()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._inflight

    # -- consumer side (the dispatchers) ---------------------------------------------------
    def get(self, timeout: float) -> Closure | None:
        end = time.monotonic() + timeout
        with self._cond:
            while not self._queue and not self._stopped:
                left = end - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return None
            if self._stopped:
                return None
            closure = self._queue.popleft()
            self._inflight += 1
            return closure

    def put_back(self, closure: Closure) -> None:
        """A closure whose worker failed: first in line again (at-least-once)."""
        with self._cond:
            self._inflight -= 1
            closure.attempts += 1
            closure.remote_value.set_aborted()
            if self._error is not None or self._fatal is not None:
                closure.remote_value.cancel()
            else:
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def mark_finished(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def mark_failed(self, error: BaseException) -> None:
        with self._cond:
            self._inflight -= 1
            if self._error is None:
                self._error = error
            self._cancel_queued()
            self._cond.notify_all()

    def mark_fatal(self, error: BaseException) -> None:
        with self._cond:
            self._inflight -= 1
            if self._fatal is None:
                self._fatal = error
            self._cancel_queued()
            self._cond.notify_all()

    def _cancel_queued(self) -> None:
        while self._queue:
            self._queue.popleft().remote_value.cancel()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cancel_queued()
            self._cond.notify_all()
