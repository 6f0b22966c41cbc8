"""One dispatcher thread per worker: takes closures off the queue and runs them there.

A worker failure (its RPC breaks, or it stops answering heartbeats) puts the closure back
at the head of the queue for another worker, and the dispatcher waits for the worker's next
incarnation (a restarted process joins under a new RPC name). A parameter server that does
not answer is fatal: ``ParameterServerUnavailableError``.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from typing import Any

from torch_distribute.coordinator.closure_queue import Closure, ClosureQueue
from torch_distribute.errors import DistributeError, ParameterServerUnavailableError
from torch_distribute.ps import transport, worker
from torch_distribute.ps.transport import Membership

HEARTBEAT_S = 2.0
HEARTBEAT_TIMEOUT_S = 10.0
MISSED_HEARTBEATS = 2


class RemoteError(DistributeError, RuntimeError):
    """A scheduled function failed on a worker with an error that could not be sent back."""


class WorkerDispatcher:
    def __init__(self, index: int, queue: ClosureQueue, membership: Membership,
                 on_closure_done: Any, ps_unavailable: Any):
        self.index = index
        self.key = transport.task_key("worker", index)
        self._queue = queue
        self._membership = membership
        self._on_closure_done = on_closure_done
        self._ps_unavailable = ps_unavailable
        self._stop = threading.Event()
        self._dead: set[str] = set()
        self.name: str | None = None
        self.available_since: float | None = None
        self.unavailable_since = time.monotonic()
        self.completed = 0
        self._thread = threading.Thread(target=self._loop, name=f"td-dispatch-{self.key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def available(self) -> bool:
        return self.name is not None

    def _find_worker(self) -> bool:
        name = self._membership.current_name(self.key)
        if name is None or name in self._dead:
            return False
        if name != self.name:
            self.name = name
            self.available_since = time.monotonic()
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._find_worker():
                self.name = None
                self._stop.wait(0.25)
                continue
            closure = self._queue.get(timeout=0.5)
            if closure is None:
                continue
            self._run(closure)

    def _run(self, closure: Closure) -> None:
        name = self.name
        assert name is not None
        try:
            reply = self._call(name, closure)
        except _WorkerLost as lost:
            if self._stop.is_set():
                self._queue.put_back(closure)
                return
            self._dead.add(name)
            self.name = None
            self.unavailable_since = time.monotonic()
            print(f"td.coordinator: worker {name} failed ({lost}); {closure.name} goes back to the "
                  "queue for another worker", file=sys.stderr, flush=True)
            self._queue.put_back(closure)
            return
        kind = reply[0]
        if kind == "ok":
            closure.remote_value.set_value(pickle.loads(reply[1]))
            self.completed += 1
            self._queue.mark_finished()
        elif kind == "ps_error":
            error = self._ps_unavailable(reply[1], reply[2])
            if error is None:  # the server answers again: a transient failure, run it again
                self._queue.put_back(closure)
            else:
                closure.remote_value.set_error(error)
                self._queue.mark_fatal(error)
        else:
            error = _rebuild_error(reply, name)
            closure.remote_value.set_error(error)
            self._queue.mark_failed(error)
        self._on_closure_done()

    def _call(self, name: str, closure: Closure) -> tuple[Any, ...]:
        done = threading.Event()
        try:
            future = transport.call_async(name, worker.run_closure, (closure.payload,), timeout=0)
        except Exception as error:
            raise _WorkerLost(str(error).splitlines()[0] if str(error) else repr(error)) from error
        future.add_done_callback(lambda _f: done.set())
        missed = 0
        while not done.wait(HEARTBEAT_S):
            if self._stop.is_set():
                raise _WorkerLost("the coordinator is shutting down")
            if transport.ping(name, HEARTBEAT_TIMEOUT_S):
                missed = 0
            else:
                missed += 1
                if missed >= MISSED_HEARTBEATS:
                    raise _WorkerLost(f"no heartbeat for {missed} × {HEARTBEAT_TIMEOUT_S:g} s")
        try:
            return future.wait()
        except Exception as error:
            raise _WorkerLost(str(error).splitlines()[0] if str(error) else repr(error)) from error


class _WorkerLost(Exception):
    pass


def _rebuild_error(reply: tuple[Any, ...], name: str) -> BaseException:
    _, data, summary, text = reply
    error: BaseException | None = None
    if data is not None:
        try:
            error = pickle.loads(data)
        except Exception:
            error = None
    if error is None:
        error = RemoteError(f"{summary} (in a scheduled function on {name})")
    if text and hasattr(error, "add_note"):
        error.add_note(f"Raised in a scheduled function on {name}:\n{text.rstrip()}")
    return error


def ps_unavailable_error(ps_index: int, detail: str) -> ParameterServerUnavailableError | None:
    """``None`` when ``ps:ps_index`` answers a ping again (transient), else the fatal error."""
    for _ in range(2):
        if transport.ping(f"ps:{ps_index}", HEARTBEAT_TIMEOUT_S / 2):
            return None
    return ParameterServerUnavailableError(
        f"Parameter server ps:{ps_index} is unavailable ({detail}). The variables it held are "
        "lost: restart every task (chief, workers, ps) and restore the coordinator's last "
        "checkpoint (td.Checkpoint(...).restore(td.latest_checkpoint(dir)))."
    )
