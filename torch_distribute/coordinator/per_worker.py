"""``PerWorkerValues`` and per-worker datasets: one value per worker, resolved on the worker.

A ``PerWorkerValues`` passed to ``schedule`` becomes, on the worker that runs the function,
that worker's own component. Per-worker datasets and iterators are built lazily on each
worker the first time a function there uses them (and again on a restarted worker).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch_distribute.errors import ContextError, InvalidArgumentError
from torch_distribute.ps import chief, pickling


def _registry() -> chief.ChiefRegistry:
    registry = chief.current_registry()
    if registry is None:
        raise InvalidArgumentError("PerWorkerValues need a ParameterServerStrategy on this (chief) task.")
    return registry


def _value_reference(obj: Any) -> pickling.Reference | None:
    return _registry().payload_reference(obj)


class PerWorkerValues:
    """One value per worker; inside a scheduled function, the running worker's value.

    Build it from a sequence with one picklable value per worker (index = worker index),
    or get one from ``iter(coordinator.create_per_worker_dataset(fn))``.

    >>> values = PerWorkerValues([10, 20])
    >>> values.values
    (10, 20)
    """

    def __init__(self, values: Sequence[Any] | None = None, *, _oid: int | None = None):
        self._values = tuple(values) if values is not None else None
        self._oid = _oid

    @property
    def values(self) -> tuple[Any, ...] | None:
        """The components when built from values (``None`` for worker-built resources)."""
        return self._values

    def td_reference(self) -> pickling.Reference:
        if self._oid is None:
            blobs = [pickling.dumps(v, _value_reference, "a PerWorkerValues component") for v in self._values or ()]
            self._oid = _registry().register_recipe(("values", blobs))
        return ("per_worker", self._oid)

    def __repr__(self) -> str:
        return f"PerWorkerValues({self._values!r})" if self._values is not None else "PerWorkerValues(<on workers>)"


class PerWorkerIterator(PerWorkerValues):
    """``iter(per_worker_dataset)``: each worker's iterator; ``next()`` only in scheduled functions."""

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise ContextError(
            "next() on a per-worker iterator works inside a scheduled function only: pass the "
            "iterator to coordinator.schedule(fn, args=(iterator,)) and call next() in fn."
        )


class PerWorkerDataset:
    """A dataset built on every worker by the dataset function (``create_per_worker_dataset``).

    ``iter(per_worker_dataset)`` is a ``PerWorkerValues`` of iterators: pass it to scheduled
    functions and call ``next()`` on it there. As in TensorFlow, use a dataset that repeats
    (or enough data) for the number of steps you schedule: a worker's iterator that runs out
    raises ``OutOfRangeError`` from the function.
    """

    def __init__(self, dataset_fn: Any, num_workers: int):
        if isinstance(dataset_fn, Iterator):
            raise InvalidArgumentError(
                f"create_per_worker_dataset cannot take a {type(dataset_fn).__name__}: an iterator (a generator) "
                "is read where it was made and cannot be sent to the workers. Pass a function that makes it "
                "(lambda: make_batches()), a DataLoader or another picklable dataset.")
        blob = pickling.dumps(dataset_fn, _value_reference, "the dataset function")
        self._oid = _registry().register_recipe(("dataset", blob, num_workers))

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(_oid=_registry().register_recipe(("iterator", self._oid)))

    def td_reference(self) -> pickling.Reference:
        return ("per_worker", self._oid)
