"""``ClusterCoordinator``: schedule functions on the workers of a ``ParameterServerStrategy``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch_distribute import nest
from torch_distribute.coordinator.closure_queue import Closure, ClosureQueue
from torch_distribute.coordinator.dispatcher import WorkerDispatcher, ps_unavailable_error
from torch_distribute.coordinator.per_worker import PerWorkerDataset
from torch_distribute.coordinator.remote_value import RemoteValue
from torch_distribute.errors import InvalidArgumentError, WorkerUnavailableError
from torch_distribute.ps import pickling
from torch_distribute.strategies.parameter_server import ParameterServerStrategy


class ClusterCoordinator:
    """Schedules functions on the workers; one per strategy (a second call returns it).

    >>> import torch_distribute as td
    >>> td.coordinator.ClusterCoordinator(td.OneDeviceStrategy("cpu"))
    Traceback (most recent call last):
    ...
    torch_distribute.errors.InvalidArgumentError: ClusterCoordinator only works with a ParameterServerStrategy, got OneDeviceStrategy.

    Typical use (on the chief)::

        coordinator = td.coordinator.ClusterCoordinator(strategy)
        per_worker_iterator = iter(coordinator.create_per_worker_dataset(make_dataset))
        for _ in range(steps):
            loss = coordinator.schedule(train_step, args=(model, optimizer, per_worker_iterator))
        coordinator.join()
        print(loss.fetch())

    Args:
        strategy: the ``ParameterServerStrategy``.
        worker_wait_timeout: seconds ``join`` waits while work is pending and no worker at
            all is available, before raising ``WorkerUnavailableError`` (default: the
            strategy's ``startup_timeout``).
    """

    def __new__(cls, strategy: object, worker_wait_timeout: float | None = None) -> ClusterCoordinator:
        existing = strategy.extended.cluster_coordinator if isinstance(strategy, ParameterServerStrategy) else None
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: object, worker_wait_timeout: float | None = None):
        if getattr(self, "_strategy", None) is not None:
            return
        if not isinstance(strategy, ParameterServerStrategy):
            raise InvalidArgumentError(
                "ClusterCoordinator only works with a ParameterServerStrategy, got "
                f"{type(strategy).__name__}."
            )
        self._strategy = strategy
        extended = strategy.extended
        self._registry = extended.registry
        self._worker_wait_timeout = extended.startup_timeout if worker_wait_timeout is None else worker_wait_timeout
        self._queue = ClosureQueue()
        self._dispatchers = [
            WorkerDispatcher(i, self._queue, extended.membership, self._registry.mark_stale, ps_unavailable_error)
            for i in range(extended.num_workers)
        ]
        for dispatcher in self._dispatchers:
            dispatcher.start()
        extended.add_shutdown_callback(self._stop)
        extended.cluster_coordinator = self

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self, fn: Callable[..., Any], args: tuple | list | None = None,
                 kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Run ``fn(*args, **kwargs)`` on some free worker, at least once; returns at once.

        ``fn`` may be any function: a lambda, a closure, one defined in the script (also
        under ``if __name__ == "__main__":``) or a notebook travels by value (cloudpickle),
        one of an importable module by name. ``PerWorkerValues`` (per-worker iterators)
        become the running worker's component; modules, optimizers and parameters made in
        scope become the worker's copies — as arguments and equally when ``fn`` captures
        them. Raises ``InvalidArgumentError`` at once, naming it, when something ``fn`` or its
        arguments hold cannot travel (an open file, a lock, a GPU tensor); the first error of
        an earlier function (and cancels the queued ones); or
        ``ParameterServerUnavailableError``.
        """
        self._queue.raise_if_error()
        if not callable(fn):
            raise InvalidArgumentError(f"schedule() needs a function, got {type(fn).__name__}.")
        if args is not None and not isinstance(args, (tuple, list)):
            raise InvalidArgumentError(
                f"schedule(fn, args=...) takes a tuple, got {type(args).__name__}: write args=(x,)."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidArgumentError(f"schedule kwargs must be a dict, got {type(kwargs).__name__}.")
        self._registry.push_local_changes()
        self._registry.sync_hyperparameters()
        payload = pickling.dumps_call(fn, tuple(args or ()), dict(kwargs or {}), self._registry.payload_reference)
        remote_value = RemoteValue()
        self._queue.put(Closure(payload, remote_value, getattr(fn, "__qualname__", repr(fn))))
        return remote_value

    def join(self) -> None:
        """Block until every scheduled function has run; raise the first error, if any."""
        self._queue.wait(self._check_workers)

    def done(self) -> bool:
        """Whether every scheduled function has run (raises the first error, if any)."""
        return self._queue.done()

    def fetch(self, val: Any) -> Any:
        """``val`` with every ``RemoteValue`` in it replaced by its fetched value."""
        return nest.map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, val)

    def create_per_worker_dataset(self, dataset_fn: object) -> PerWorkerDataset:
        """A dataset built on each worker by ``dataset_fn()`` (or ``dataset_fn(input_context)``).

        ``dataset_fn`` (any function, a closure included, sent as ``schedule`` sends
        functions) or a picklable dataset object (a ``DataLoader``, a ``Dataset``, any
        iterable that pickles) is sent to each worker by value; ``iter()`` of the result
        gives the per-worker iterators. Raises ``InvalidArgumentError`` when it holds
        something that cannot travel (an open file, a lock), or is a generator or another
        iterator (pass a function that makes it).
        """
        return PerWorkerDataset(dataset_fn, len(self._dispatchers))

    # -- health ------------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        if any(d.available for d in self._dispatchers):
            return
        since = min(d.unavailable_since for d in self._dispatchers)
        if time.monotonic() - since > self._worker_wait_timeout:
            names = ", ".join(d.key for d in self._dispatchers)
            raise WorkerUnavailableError(
                f"No worker has been available for {self._worker_wait_timeout:g} s ({names}) while "
                f"{self._queue.pending} scheduled functions wait. Start or restart the worker tasks."
            )

    @property
    def worker_stats(self) -> dict[str, int]:
        """Scheduled functions completed by each worker (for monitoring)."""
        return {d.key: d.completed for d in self._dispatchers}

    def _stop(self) -> None:
        for dispatcher in self._dispatchers:
            dispatcher.stop()
        self._queue.stop()

    def shutdown(self) -> None:
        """Stop the workers and parameter servers now (also done at exit of the program)."""
        self._strategy.extended.shutdown()
