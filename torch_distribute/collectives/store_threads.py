"""The threads a ``WorkerGroup`` talks to the chief's store in, each with a deadline, and
their end before the interpreter's teardown.

A stopped chief accepts connections but never answers, and torch's store clients then block
in ``recv`` with no deadline of their own: every store call after start-up runs in a daemon
thread of its own (``StoreThreads``), waited for a bounded time.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from torch_distribute.collectives import store_sockets

_Result = TypeVar("_Result")


class StoreThreads:
    """One group's store threads: joined (bounded) at exit, because one that returns during
    interpreter teardown aborts the process (pybind11 + pthread_exit).

    Public surface: ``run(call)`` starts ``call`` in a thread of its own, ``within(call,
    seconds)`` also waits for its result, ``join(seconds)`` waits for them all.

    >>> threads = StoreThreads()
    >>> threads.within(lambda: 6 * 7, seconds=1.0)
    42
    """

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def run(self, call: Callable[[], object]) -> threading.Thread:
        """Run ``call`` (store traffic) in a daemon thread of its own, remembered for exit."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=call, name="td-store", daemon=True)
        thread.start()
        self._threads.append(thread)
        _STORE_THREADS[:] = [t for t in _STORE_THREADS if t.is_alive()] + [thread]
        return thread

    def within(self, call: Callable[[], _Result], seconds: float) -> _Result:
        """``call()`` in a store thread; its result or its exception, or ``TimeoutError``."""
        results: list[_Result] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                results.append(call())
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                errors.append(error)

        self.run(run).join(seconds)
        if errors:
            raise errors[0]
        if not results:
            raise TimeoutError(f"no answer within {seconds:.1f} s")
        return results[0]

    def join(self, seconds: float) -> None:
        """Wait for every thread this group started, ``seconds`` in all."""
        deadline = time.monotonic() + seconds
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def remember_store(host: str, port: int) -> None:
    """Note a store this process talks to: its connections are shut down at exit if a call
    to it is still blocked then."""
    _STORES.append((store_sockets.addresses_of(host), port))


# Every thread that calls into torch's store (C++) with a deadline of its own. One still
# blocked there when the interpreter finalizes aborts the process the moment its call returns
# (pybind11 meets pthread_exit: "terminate called without an active exception", SIGABRT),
# whatever the program's status was. _end_before_teardown, registered when the first group
# starts (before its first store thread and its own _at_exit) and so run after every atexit
# handler registered later (every WorkerGroup._at_exit among them), wakes those calls
# (store_sockets.py) or, failing that, ends the process itself. Not at import: importing the
# package leaves the interpreter's exit as it was (strategies/torch_patches.py).
_STORE_THREADS: list[threading.Thread] = []
# (the store's addresses, its port) of every group made in this process: whom the calls wait on.
_STORES: list[tuple[list[str], int]] = []


def _wake_blocked_store_calls(seconds: float) -> bool:
    """Shut down this process's connections to the stores until every store thread has ended
    (a client retrying reconnects, and is shut down again); whether they all did."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [thread for thread in _STORE_THREADS if thread.is_alive()]
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        for addresses, port in _STORES:
            store_sockets.shut_down_connections_to(addresses, port)
        for thread in alive:
            thread.join(0.05)


def _end_before_teardown() -> None:
    """If a store call is still blocked (the chief is stopped or cut off), wake it: the process
    then exits with the status its program asked for (``sys.exit(n)``, 1 after an uncaught
    exception). Where that fails (no ``/proc``), end the process now, stdout and stderr
    flushed, with 1 after an uncaught exception and otherwise 0 (a ``sys.exit(n)`` status
    cannot be seen from here)."""
    deadline = time.monotonic() + 1.0
    for thread in _STORE_THREADS:
        thread.join(max(0.0, deadline - time.monotonic()))
    if not any(thread.is_alive() for thread in _STORE_THREADS):
        return
    _note("a call to worker 0's store is still blocked (worker 0 is stopped or unreachable); "
          "closing this process's connections to it before exiting (torch may log "
          "'recvValue failed' for them)")
    if _wake_blocked_store_calls(5.0):
        return
    status = 1 if getattr(sys, "last_value", None) is not None else 0
    try:
        _note(f"the call is still blocked; ending this process now with status {status}, before "
              "the interpreter's teardown, which would abort when that call returns")
        sys.stdout.flush()
    finally:
        os._exit(status)


def _note(message: str) -> None:
    try:
        sys.stderr.write(f"torch-distribute: {message}.\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def register_end_before_teardown() -> None:
    """Register ``_end_before_teardown`` with ``atexit``, once: when the first group starts."""
    if not _END_REGISTERED:
        atexit.register(_end_before_teardown)
        _END_REGISTERED.append(True)


_END_REGISTERED: list[bool] = []
