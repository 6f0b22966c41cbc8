"""The global batches of a distributed dataset, cut at every step by that step's live workers.

Under per-step fault tolerance the workers of a step are known only once its quorum is made,
so a fault-tolerant strategy hands ``DistributedDataset`` this source instead of the user's
dataset (with ``num_workers=1``: the rows it yields are already this worker's). Every
``next()`` reads the next *global* batch, makes sure the step's quorum exists
(``begin_step``; the end of a pass makes none) and keeps the rows of this worker's rank
among the step's ``world_size`` workers (``batch_sizes_for_worker``, as the DATA policy cuts them): every row of
a committed step's global batch is trained once, whoever is live; a dropped step's batch is
not read again.

The source also knows where it is: how many passes over the dataset it started, how many
global batches of the last one it handed out, and whether its next read starts a new pass. A
worker that joins a running job gets that from a peer (``position``/``resume_at``), with the
random state the pass started from, and its next ``next()`` makes that pass again from the
same random state and reads past the batches already trained on (or starts the new pass
from the peer's state), then goes on in step with the others.

>>> import torch
>>> source = LiveSplitSource([torch.arange(6).view(6, 1)], begin_step=lambda: (2, 1))
>>> next(iter(source)).view(-1).tolist(), source.position()["batch"]
([3, 4, 5], 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch_distribute.input.batching import (
    batch_dim,
    batch_sizes_for_worker,
    split_batch,
    to_tensors,
)
from torch_distribute.strategies.random_state import capture_rng, find_generators, restore_rng

__all__ = ["LiveSplitSource"]


class LiveSplitSource:
    """``dataset``'s global batches, each cut for this worker by the step's membership.

    ``begin_step()`` makes (or reuses) the step's quorum and returns ``(world_size, rank)``;
    ``on_read(passes, batch)``, when given, is told every global batch handed out (for the
    committed-step log).
    """

    def __init__(self, dataset: Iterable[Any], begin_step: Callable[[], tuple[int, int]],
                 on_read: Callable[[int, int], None] | None = None) -> None:
        self.source = dataset
        self._begin_step = begin_step
        self._on_read = on_read
        self._passes = 0  # passes started (the current one is passes - 1)
        self._batch = 0  # global batches handed out in the current pass
        self._pass_start_rng: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None  # a peer's position, for the next read
        self._iterator: Iterator[Any] | None = None

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self._iterator = None  # a new pass starts at the next read
        return _Reads(self)

    def generators(self) -> list[Any]:
        """The torch generators that decide the dataset's order (a loader's)."""
        return find_generators(self.source)

    # -- where it is ---------------------------------------------------------------------
    def position(self) -> dict[str, Any]:
        """Passes started, global batches handed out in the last one, whether the next read
        starts a new pass (``iter()`` was called since), the random state the last pass
        started from, and the dataset's generators' states now."""
        return {"passes": self._passes, "batch": self._batch, "new_pass": self._iterator is None,
                "rng": self._pass_start_rng, "generators": [g.get_state() for g in self.generators()]}

    def resume_at(self, position: dict[str, Any], current_rng: dict[str, Any]) -> None:
        """Go on from a peer's ``position`` at the next read (``current_rng``: the peer's
        global random state now, put back once the pass is re-read to where the peer is)."""
        self._resume = {**position, "current": current_rng}

    # -- reading -------------------------------------------------------------------------
    def _start_pass(self) -> None:
        resume, self._resume = self._resume, None
        generators = self.generators()
        if resume is not None:
            self._passes = resume["passes"]
            if not resume["new_pass"] and self._passes > 0:
                # In the middle of a pass: make it again from the random state it started
                # from, read past the batches handed out, then take the peer's state now.
                if resume["rng"] is not None:
                    restore_rng(resume["rng"], generators)
                self._pass_start_rng = resume["rng"]
                self._iterator = iter(self.source)
                for _ in range(resume["batch"]):
                    next(self._iterator)
                restore_rng(resume["current"], [])  # what the peer's program drew since
                self._batch = resume["batch"]
                return
            # The peer's next read starts a new pass, from the state it is in now.
            _set_states(generators, resume["generators"])
        self._pass_start_rng = capture_rng(generators)
        self._iterator = iter(self.source)
        self._passes += 1
        self._batch = 0

    def read(self) -> Any:
        """This worker's rows of the next global batch, cut by the workers of its step.

        The global batch is read before the step's quorum, so the end of a pass makes none
        (every worker finds it at the same read). A worker healed in that quorum reads
        again, from where the job is.
        """
        batch = None
        if self._resume is None:
            if self._iterator is None:
                self._start_pass()
            assert self._iterator is not None
            batch = next(self._iterator)
        world_size, rank = self._begin_step()
        if self._resume is not None:
            self._start_pass()
            assert self._iterator is not None
            batch = next(self._iterator)
        batch = to_tensors(batch)
        index = self._batch
        self._batch += 1
        if self._on_read is not None:
            self._on_read(self._passes - 1, index)
        rows = batch_dim(batch)
        sizes = batch_sizes_for_worker(rows, world_size, 1, 0)
        start = sum(sizes[:rank])
        return split_batch(batch, [start, sizes[rank], rows - start - sizes[rank]])[1]


def _set_states(generators: list[Any], states: list[Any]) -> None:
    for generator, state in zip(generators, states, strict=False):
        generator.set_state(state)


class _Reads:
    """One pass, as ``DistributedDataset`` iterates it."""

    def __init__(self, source: LiveSplitSource) -> None:
        self._source = source

    def __iter__(self) -> _Reads:
        return self

    def __next__(self) -> Any:
        return self._source.read()
