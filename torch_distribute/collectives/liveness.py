"""``Liveness``: who in a ``WorkerGroup`` is still there.

Each worker writes a heartbeat into the chief's store, and at exit whether it left: its program
finished, it raised (with the error), or it lost a partner. ``missing_workers`` reads them all,
so a failed collective names the worker that stopped answering instead of saying "timeout".
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
import traceback
from typing import NamedTuple

import torch.distributed as dist

from torch_distribute.collectives import job_auth
from torch_distribute.collectives.membership import Membership
from torch_distribute.collectives.store_connect import connect_store
from torch_distribute.collectives.store_threads import StoreThreads
from torch_distribute.errors import ReplicaMismatchError, WorkerUnavailableError

_HEARTBEAT_PREFIX = "td/heartbeat/"
_LEFT_PREFIX = "td/left/"
_FINISHED = "finished"  # the value under _LEFT_PREFIX of a worker whose program ended normally
_RAISED = "raised: "  # ... of one whose program raised (not a lost partner), then its error


class MissingWorkers(NamedTuple):
    """Who is gone: ranks that exited (``finished`` those whose program ended without an
    error, ``raised`` those whose program raised, with their error) and ranks whose heartbeat
    stopped."""

    exited: list[int]
    silent: list[int]
    finished: list[int]
    raised: dict[int, str] = {}

    @property
    def anyone(self) -> bool:
        return bool(self.exited or self.silent)


class Liveness:
    """This worker's heartbeat, its farewell, and the reading of everyone's.

    Public surface: ``start()`` the heartbeat (once the store is up), ``stop(wait)`` it,
    ``missing_workers()``, ``store_reachable()``, ``announce_departure(failed, error)`` at
    exit, ``keep_store_until_others_left(store)`` (a failed chief) and ``forget_client()``.

    >>> # liveness = Liveness(membership, StoreThreads()); liveness.start()
    >>> # liveness.missing_workers()  # MissingWorkers(exited=[1], silent=[], finished=[], raised={})
    """

    def __init__(self, membership: Membership, threads: StoreThreads) -> None:
        self._member = membership
        self._threads = threads
        self._stop = threading.Event()
        self._client: dist.Store | None = None
        self._heartbeat = threading.Thread(target=self._beat, name="td-heartbeat", daemon=True)

    # -- this worker ----------------------------------------------------------------------
    def start(self) -> None:
        """Start beating: from here on, a worker that dies is named."""
        self._heartbeat.start()

    def stop(self, wait: bool = True) -> None:
        """Stop beating; with ``wait``, join the heartbeat thread (bounded)."""
        self._stop.set()
        if wait and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=2 * self._member.heartbeat_interval + 2.0)

    def _beat(self) -> None:
        member = self._member
        try:
            # Retried like the main connection (a lost connection attempt must not silence it),
            # within the time stop() waits for this thread.
            client = job_auth.namespaced(connect_store(
                member.host, member.port, member.world_size, member.heartbeat_interval * 2 + 1))
        except Exception:  # noqa: BLE001 - no heartbeat is reported as "not answering"
            return
        self._client = client
        while not self._stop.is_set():
            try:
                client.set(f"{_HEARTBEAT_PREFIX}{member.rank}", repr(time.time()))
            except Exception:  # noqa: BLE001 - the store (the chief) is gone
                return
            self._stop.wait(member.heartbeat_interval)

    def announce_departure(self, failed: bool, error: BaseException | None) -> None:
        """Tell the others this worker left: its program finished, or (``failed``) raised
        ``error`` or lost a partner. In a store thread: a stopped chief never answers, and the
        announcement must not hold this exit."""
        client = self._client
        if client is None:
            return
        how = _how_it_left(error) if failed else _FINISHED
        key = f"{_LEFT_PREFIX}{self._member.rank}"

        def announce() -> None:
            try:
                client.set(key, how)
            except Exception:  # noqa: BLE001 - best effort: the store may be gone
                pass

        self._threads.run(announce)

    def forget_client(self) -> None:
        """Drop the heartbeat's store client, so that its C++ object is destroyed now."""
        self._client = None

    # -- the others -----------------------------------------------------------------------
    def store_reachable(self) -> bool:
        """Whether the chief's store accepts a connection at all (a dead chief refuses it)."""
        try:
            socket.create_connection((self._member.host, self._member.port),
                                     timeout=self._member.store_deadline).close()
            return True
        except OSError:
            return False

    def missing_workers(self) -> MissingWorkers | None:
        """Who exited and whose heartbeat stopped; None if the store (the chief) does not answer.

        A worker killed a moment ago still has a fresh heartbeat, so this waits up to three
        heartbeat intervals for one to go stale before concluding that nobody is missing. The
        store must answer within ``store_deadline`` seconds: a stopped (SIGSTOP) or cut-off
        chief accepts the connection and never replies, and a dead one refuses it.
        """
        if not self.store_reachable():
            return None
        member = self._member
        interval = member.heartbeat_interval
        answered = threading.Event()
        answer: list[MissingWorkers] = []

        def probe_store() -> None:
            try:
                probe = job_auth.namespaced(dist.TCPStore(
                    member.host, member.port, member.world_size, is_master=False,
                    timeout=datetime.timedelta(seconds=member.store_deadline)))
                deadline = time.time() + 3 * interval
                while True:
                    left = {r: probe.get(f"{_LEFT_PREFIX}{r}").decode()
                            for r in range(member.world_size) if probe.check([f"{_LEFT_PREFIX}{r}"])}
                    answered.set()
                    now = time.time()
                    silent = []
                    for rank in range(member.world_size):
                        key = f"{_HEARTBEAT_PREFIX}{rank}"
                        if rank not in left and (
                            not probe.check([key]) or now - float(probe.get(key)) > 2 * interval
                        ):
                            silent.append(rank)
                    if left or silent or time.time() > deadline:
                        finished = [r for r, how in left.items() if how == _FINISHED]
                        raised = {r: how[len(_RAISED):] for r, how in left.items() if how.startswith(_RAISED)}
                        answer.append(MissingWorkers(sorted(left), silent, finished, raised))
                        return
                    time.sleep(interval / 2)
            except Exception:  # noqa: BLE001 - no answer: the chief is unreachable
                return

        thread = self._threads.run(probe_store)
        if not answered.wait(member.store_deadline):
            return None
        thread.join(3 * interval + member.store_deadline)
        return answer[0] if answer else None

    def keep_store_until_others_left(self, store: dist.Store) -> None:
        """The chief failed, and its store (who left, and why) would end with it: the others
        would then only learn that the chief is gone, and name it instead of the worker that
        failed first. Keep serving until every other worker has left or stopped beating (a
        few heartbeat intervals at most); its process groups are closed already, so the others'
        collectives fail at once."""
        member = self._member
        deadline = time.monotonic() + 3 * member.heartbeat_interval + 2 * member.store_deadline
        while time.monotonic() < deadline:
            try:
                now = time.time()
                waiting = [
                    rank for rank in range(1, member.world_size)
                    if not store.check([f"{_LEFT_PREFIX}{rank}"]) and store.check([f"{_HEARTBEAT_PREFIX}{rank}"])
                    and now - float(store.get(f"{_HEARTBEAT_PREFIX}{rank}")) <= 2 * member.heartbeat_interval
                ]
            except Exception:  # noqa: BLE001 - the store is gone: nothing to keep
                return
            if not waiting:
                return
            time.sleep(0.1)


def _how_it_left(error: BaseException | None) -> str:
    """What a failed worker announces under ``_LEFT_PREFIX``: its program's own error, where
    it was raised (``_RAISED``), or ``failed`` (it lost a partner, or a collective failed)."""
    if error is None or isinstance(error, (WorkerUnavailableError, ReplicaMismatchError)):
        return "failed"
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = f"{type(error).__name__}: {error}"
    return _RAISED + (text if len(text) <= 400 else text[:397] + "...") + where
