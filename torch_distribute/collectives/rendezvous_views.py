"""What each worker believes about the job, compared as soon as it reaches the store.

At the rendezvous every worker publishes its *view* (the world size, its index, the chief's
address as it knows it, the torch-distribute and torch versions, the strategy class, its
host and process id) and reads everyone else's. A disagreement (different world sizes,
two workers with the same index, different versions or strategies) raises
``ClusterConfigError`` on every worker within a poll interval, naming each worker's view,
instead of workers waiting out the timeout for partners that will never come. The chief's
address is shown but not compared: workers may reach one store by different names.

While workers are missing, one line is logged (WARNING, ``torch_distribute.collectives``)
every ``PROGRESS_INTERVAL_S`` seconds: ``waiting for workers: 1 of 2 joined (missing:
worker 1)``.

>>> a = own_view(2, 0, "h:1", "MultiWorkerMirroredStrategy")
>>> b = dict(a, rank=1, world_size=3)
>>> conflicts([a, b])
['world size: 2 (worker 0), 3 (worker 1)']
>>> conflicts([a, dict(a)])
['index: 2 workers say they are worker 0']
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_distribute.errors import ClusterConfigError

__all__ = ["PROGRESS_INTERVAL_S", "ViewExchange", "conflicts", "describe", "own_view"]

logger = logging.getLogger("torch_distribute.collectives")

#: Seconds between two "waiting for workers" lines.
PROGRESS_INTERVAL_S = 15.0
_POLL_S = 0.1
_VIEW_PREFIX = "td/views/"
#: What every worker must agree on, with the words the error uses.
_COMPARED = (("world_size", "world size"), ("torch_distribute", "torch-distribute version"),
             ("torch", "torch version"), ("strategy", "strategy"))


def _library_version() -> str:
    try:
        return importlib.metadata.version("torch-distribute")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def own_view(world_size: int, rank: int, chief: str, strategy: str) -> dict[str, Any]:
    """This worker's view of the job, as published at the rendezvous."""
    return {"world_size": world_size, "rank": rank, "chief": chief, "strategy": strategy,
            "torch_distribute": _library_version(), "torch": torch.__version__,
            "host": socket.gethostname(), "pid": os.getpid()}


def describe(view: dict[str, Any]) -> str:
    """One worker's view in words, for the error."""
    return (f"worker {view.get('rank')} of {view.get('world_size')} (pid {view.get('pid')} on "
            f"{view.get('host')}; chief at {view.get('chief')}; torch-distribute "
            f"{view.get('torch_distribute')}, torch {view.get('torch')}; "
            f"{view.get('strategy') or 'no strategy named'})")


def _by_worker(view: dict[str, Any]) -> tuple[bool, int]:
    """Sort key: workers in index order, whatever order their views reached the store."""
    rank = view.get("rank")
    return (not isinstance(rank, int), rank if isinstance(rank, int) else 0)


def conflicts(views: Sequence[dict[str, Any]]) -> list[str]:
    """What the views disagree on, in words, naming workers in index order; empty when they
    agree."""
    views = sorted(views, key=_by_worker)
    found = []
    for key, words in _COMPARED:
        values = {json.dumps(view.get(key)) for view in views}
        if len(values) > 1:
            found.append(f"{words}: " + ", ".join(
                f"{view.get(key)} (worker {view.get('rank')})" for view in views))
    ranks = [view.get("rank") for view in views]
    for rank in sorted({r for r in ranks if isinstance(r, int) and ranks.count(r) > 1}):
        found.append(f"index: {ranks.count(rank)} workers say they are worker {rank}")
    return found


class ViewExchange:
    """This worker's part in the exchange of views over ``store`` (a c10d store).

    ``publish()`` once, then ``poll()`` until it returns every rank; it raises
    ``ClusterConfigError`` as soon as a published view disagrees with another.
    ``peer_name(rank)`` words a missing worker for the progress line; ``namespace`` keeps
    the views of one start-up attempt apart from an earlier one's in a store that outlives
    it (torchrun's agent store).
    """

    def __init__(self, store: Any, view: dict[str, Any], hosts_store: bool,
                 peer_name: Callable[[int], str] | None = None, namespace: str = "0") -> None:
        self._store = store
        prefix = f"{_VIEW_PREFIX}{namespace}/"
        self._count_key, self._view_prefix, self._saw_prefix = prefix + "count", prefix, prefix + "saw-conflict/"
        self._view = view
        self._hosts_store = hosts_store
        self._peer_name = peer_name or (lambda rank: f"worker {rank}")
        self._views: list[dict[str, Any]] = []
        self._last_progress = time.monotonic()

    def publish(self) -> None:
        number = self._store.add(self._count_key, 1)
        self._store.set(f"{self._view_prefix}{number}", json.dumps(self._view))

    def _read_new(self) -> None:
        count = self._store.add(self._count_key, 0)
        for number in range(len(self._views) + 1, count + 1):
            key = f"{self._view_prefix}{number}"
            if not self._store.check([key]):
                return  # published its number, not yet its view: read it at the next poll
            self._views.append(json.loads(self._store.get(key)))

    def poll(self) -> set[int]:
        """The ranks whose views arrived and agree; raises on a disagreement."""
        self._read_new()
        found = conflicts(self._views)
        if found:
            self._raise(found)
        return {view["rank"] for view in self._views}

    def wait_all(self, deadline: float) -> set[int]:
        """Poll until every rank of the job has joined or ``deadline`` (``time.monotonic``)
        passes; the ranks joined. Logs the progress line while waiting."""
        world_size = self._view["world_size"]
        while True:
            joined = self.poll()
            if len(joined) >= world_size or time.monotonic() >= deadline:
                return joined
            now = time.monotonic()
            if now - self._last_progress >= PROGRESS_INTERVAL_S:
                self._last_progress = now
                missing = [r for r in range(world_size) if r not in joined]
                logger.warning("waiting for workers: %d of %d joined (missing: %s)", len(joined),
                               world_size, ", ".join(self._peer_name(r) for r in missing))
            time.sleep(_POLL_S)

    def _raise(self, found: list[str]) -> None:
        """Raise the disagreement; the store's host first waits (briefly) until the other
        workers have read the views too, so that they fail with the same error."""
        self._store.set(f"{self._saw_prefix}{self._view['pid']}@{self._view['host']}", "1")
        if self._hosts_store:
            keys = [f"{self._saw_prefix}{v['pid']}@{v['host']}" for v in self._views]
            until = time.monotonic() + 2.0
            while time.monotonic() < until and not self._store.check(keys):
                time.sleep(_POLL_S)
        listing = "; ".join(describe(view) for view in sorted(self._views, key=_by_worker))
        raise ClusterConfigError(
            f"The workers were started with different views of the job ({'; '.join(found)}). "
            f"Each worker's view: {listing}. Start every worker with the same cluster "
            "configuration (the same world size, a different index each: WORLD_SIZE/RANK, "
            "TF_CONFIG, the launcher's options) and the same torch, torch-distribute and strategy"
        )
