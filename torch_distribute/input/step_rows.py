"""How many rows the batches of one step of a distributed dataset hold, found again in ``run``.

A distributed iterator records, for the per-replica batches it hands out, each local replica's
rows and the rows over every replica of every worker (which the workers' per-step agreement
gives). ``strategy.run`` finds the record of the batch it is given and makes it current while
the replicas run, so ``compute_average_loss`` can tell a ``global_batch_size`` smaller than
the step's real global batch (every example would weigh more than one device gives it), and
whether its own guess without ``global_batch_size`` is exact.

>>> import torch
>>> from torch_distribute.values import PerReplica
>>> batch = PerReplica((torch.ones(3), torch.ones(2)))
>>> record(batch, StepRows((3, 2), 5, iteration=1, step=0))
>>> find(((batch,), {}))
StepRows(replica_rows=(3, 2), global_rows=5, iteration=1, step=0)
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torch_distribute import nest
from torch_distribute.values import DistributedValues


@dataclass(frozen=True)
class StepRows:
    """Rows of each local replica's batch at one step, and over all replicas and workers;
    which iteration of a distributed dataset (a number unique in the process) and which of
    its steps (0 the first)."""

    replica_rows: tuple[int, ...]
    global_rows: int
    iteration: int
    step: int


# Keyed by id(): tensors compare element-wise, so they cannot be weak dictionary keys.
_records: dict[int, tuple[weakref.ref[Any], StepRows]] = {}
_lock = threading.Lock()
_current: contextvars.ContextVar[StepRows | None] = contextvars.ContextVar("td_step_rows", default=None)
_iterations = itertools.count(1)


def new_iteration() -> int:
    """A number for a new iteration of a distributed dataset, unique in this process."""
    return next(_iterations)


def _forget(key: int, reference: weakref.ref[Any]) -> None:
    with _lock:
        entry = _records.get(key)
        if entry is not None and entry[0] is reference:
            del _records[key]


def record(batch: Any, rows: StepRows) -> None:
    """Remember ``rows`` for every per-replica value (or tensor) of ``batch``."""
    for leaf in nest.leaves(batch):
        if isinstance(leaf, (DistributedValues, torch.Tensor)):
            key = id(leaf)
            reference = weakref.ref(leaf, functools.partial(_forget, key))
            with _lock:
                _records[key] = (reference, rows)


def find(inputs: Any) -> StepRows | None:
    """The record of the first leaf of ``inputs`` handed out by a distributed iterator."""
    for leaf in nest.leaves(inputs):
        entry = _records.get(id(leaf))
        if entry is not None and entry[0]() is leaf:
            return entry[1]
    return None


def with_step_rows(fn: Callable[..., Any], rows: StepRows | None) -> Callable[..., Any]:
    """``fn`` with ``rows`` current while it runs (on whichever replica thread runs it)."""
    if rows is None:
        return fn

    @functools.wraps(fn)
    def running(*args: Any, **kwargs: Any) -> Any:
        token = _current.set(rows)
        try:
            return fn(*args, **kwargs)
        finally:
            _current.reset(token)

    return running


def current() -> StepRows | None:
    """The record of the step this replica function runs on, if its batch came from a
    distributed iterator."""
    return _current.get()
