"""Checkpoint writes under several workers: every worker calls them, and every worker returns
only once the file is complete and visible.

TensorFlow's model: every worker calls ``save``; the chief (``should_checkpoint``) writes
the checkpoint. Here ``write_collectively`` makes that call collective with two
``strategy.extended.all_gather_objects`` calls (the same number, in the same order, on every
worker):

1. Every worker says which path it asked for. A worker that asked for another path than the
   chief's (TensorFlow's tutorials give each non-chief its own temporary directory) writes
   its own copy there, at the same time as the chief writes; the weights are the same, the
   strategy keeps them in sync.
2. Every writer reports its outcome (the file's SHA-256, or its error). If one failed, every
   worker raises ``CheckpointError`` naming it, so no worker goes on alone.

After that, a worker that asked for the chief's own path checks that the file it sees there
is the chief's (same checksum). If not, each worker has its own disk and it writes its own
copy there, so the path exists on every worker. One process (``num_workers_in_sync == 1``)
pays nothing: no collective at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch_distribute.checkpoint.file_io import read_checksum
from torch_distribute.errors import CheckpointError

if TYPE_CHECKING:
    from torch_distribute.strategies.extended import StrategyExtended

__all__ = ["num_workers", "write_collectively"]


def num_workers(extended: object) -> int:
    """Workers in sync under ``extended`` (1 for a strategy that does not say)."""
    return int(getattr(extended, "num_workers_in_sync", 1))


def write_collectively(extended: StrategyExtended, path: str, write: Callable[[], str]) -> None:
    """Run ``write`` (which writes ``path`` and returns its SHA-256) where a file must be
    written, and return on every worker once the chief's file is complete.

    ``extended``: the strategy's ``StrategyExtended``. Raises ``CheckpointError`` on every
    worker when the chief (or a worker writing its own copy) failed. (The names given to
    the collectives are the same on every worker: the worker group compares them.)
    """
    if num_workers(extended) <= 1:
        if extended.should_checkpoint:
            write()
        return
    me = extended.worker_index
    requested = os.path.abspath(path)
    plans = extended.all_gather_objects(
        {"path": requested, "writes": bool(extended.should_checkpoint)}, what="checkpoint write: the paths asked for")
    chief = next((i for i, plan in enumerate(plans) if plan["writes"]), None)
    if chief is None:
        return  # no worker writes checkpoints under this strategy
    own_copy = me != chief and requested != plans[chief]["path"]
    outcome: dict[str, Any] = {"digest": None, "error": None}
    local_error: BaseException | None = None
    if me == chief or own_copy:
        try:
            outcome["digest"] = write()
        except Exception as exc:
            local_error = exc
            outcome["error"] = str(exc) or type(exc).__name__
    outcomes = extended.all_gather_objects(outcome, what="checkpoint write: the outcome")
    if local_error is not None:
        raise local_error
    failed = [(worker, entry["error"]) for worker, entry in enumerate(outcomes) if entry["error"]]
    if failed:
        worker, message = failed[0]
        role = "the chief" if worker == chief else f"writing its own copy at {plans[worker]['path']!r}"
        raise CheckpointError(
            f"Checkpoint {path!r} was not written: worker {worker} ({role}) failed, so every "
            f"worker raises this error. Its error: {message}"
        )
    if me != chief and not own_copy and read_checksum(path) != outcomes[chief]["digest"]:
        # The chief's file is not visible at this path: each worker has its own disk.
        write()
