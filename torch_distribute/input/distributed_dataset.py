"""Distributed datasets: every step, one batch per replica, as ``PerReplica``.

``DistributedDataset`` takes an iterable of *global* batches (a ``DataLoader``, a list, a
generator; tensors, NumPy arrays, tuples, dicts) and cuts each along dim 0 into per-replica
batches whose sizes differ by at most one, each moved to its replica's device. When a last
batch has fewer rows than replicas, the replicas without rows get an *empty* batch (first
dimension 0) so the step still runs on every replica and the summed loss equals one
device's. ``DatasetFromFunction`` feeds each replica its own consecutive elements.

Across workers (``InputOptions.auto_shard_policy``): DATA — every worker reads the same
global batches and keeps its rows; FILE — a dataset with ``shard(num_shards, index)`` gives
each worker its own files, whose batches are that worker's share; OFF — each worker's
dataset is already its share (sharded by the user); AUTO — FILE when the dataset can shard
itself, else DATA.

Workers with different amounts of data stop together, under every policy (TensorFlow's
partial-batch handling, which multi-worker strategies always use): at every step the
workers agree whether any of them still has data (``sync_has_data``, the strategy's
``extended.any_worker_has_data``: one small collective). While any has, every
worker runs the step, those without data on an *empty* batch (first dimension 0, the
structure and dtypes of their earlier batches), which adds nothing to a summed loss or
gradient; when none has, ``StopIteration`` ends the epoch on every worker at the same
step. The agreement is never skipped across workers: even DATA sharding of a sized dataset
cannot prove that every worker's dataset has the same length (each worker builds its own),
and a worker that stopped alone would leave the others waiting in their next collective.
With one worker ``any_worker_has_data`` is the local answer and costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from torch_distribute import context
from torch_distribute.errors import ContextError, DatasetError
from torch_distribute.input.batching import (
    batch_dim,
    batch_sizes_for_worker,
    empty_like_batch,
    split_batch,
    to_device,
    to_tensors,
)
from torch_distribute.input.input_context import AutoShardPolicy, InputOptions
from torch_distribute.values import regroup

_NO_DATA_AT_ALL = (
    "This worker's dataset produced no batch at all while other workers still have data, so "
    "it cannot make an empty batch of the right structure to take part in their steps. Give "
    "every worker at least one batch."
)


def _refuse_in_replica_context() -> None:
    if context.has_strategy() and not context.in_cross_replica_context():
        raise ContextError(
            "next(iterator) was called inside a replica function. Iterate the distributed "
            "dataset outside strategy.run() and pass the batch in: strategy.run(step, args=(batch,))."
        )


class _DistributedIterable:
    """What both distributed datasets share: devices, options, epochs."""

    def __init__(
        self,
        devices: list[torch.device],
        options: InputOptions | None,
        sync_has_data: Callable[[bool], bool],
    ):
        self._devices = list(devices)
        self._options = options or InputOptions()
        self._sync_has_data = sync_has_data

    @property
    def num_local_replicas(self) -> int:
        return len(self._devices)

    def _place(self, pieces: list[Any]) -> Any:
        if self._options.experimental_fetch_to_device:
            pieces = [to_device(p, d) for p, d in zip(pieces, self._devices, strict=True)]
        return regroup(pieces, always_wrap=True)


class DistributedIterator:
    """Iterator over a distributed dataset; ``next()`` gives the per-replica batches of one step."""

    def __init__(self, next_step: Callable[[], Any], description: str):
        self._next_step = next_step
        self._description = description
        self._steps = 0

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        _refuse_in_replica_context()
        try:
            value = self._next_step()
        except StopIteration:
            if self._steps == 0:
                raise DatasetError(
                    f"The dataset given to {self._description} produced no batches. Check that "
                    "it is not empty (a generator can be iterated only once: pass a list, a "
                    "DataLoader or a function that makes a new generator)."
                ) from None
            raise
        self._steps += 1
        return value

    def get_next(self) -> Any:
        return next(self)


class DistributedDataset(_DistributedIterable):
    """An iterable of global batches, split across replicas (and workers) at every step."""

    def __init__(
        self,
        dataset: Iterable[Any],
        devices: list[torch.device],
        num_workers: int = 1,
        worker_index: int = 0,
        options: InputOptions | None = None,
        sync_has_data: Callable[[bool], bool] = lambda has: has,
    ):
        if isinstance(dataset, torch.utils.data.Dataset) and not isinstance(
            dataset, torch.utils.data.IterableDataset
        ):
            raise DatasetError(
                f"{type(dataset).__name__} is a map-style dataset of single examples; "
                "distributed datasets take global batches. Wrap it: "
                "torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE)."
            )
        if not hasattr(dataset, "__iter__"):
            raise DatasetError(
                f"experimental_distribute_dataset needs an iterable of global batches, got "
                f"{type(dataset).__name__}."
            )
        super().__init__(devices, options, sync_has_data)
        self._num_workers = num_workers
        self._worker_index = worker_index
        self._policy = self._resolve_policy(dataset)
        if self._policy is AutoShardPolicy.FILE:
            dataset = dataset.shard(num_workers, worker_index)  # type: ignore[attr-defined]
        # Every step the workers agree whether any still has data (see the module's
        # docstring): even with DATA sharding of a sized dataset the lengths may differ, as
        # each worker builds its own dataset.
        self._dataset = dataset

    def _resolve_policy(self, dataset: Any) -> AutoShardPolicy:
        policy = self._options.auto_shard_policy
        if self._num_workers == 1:
            return AutoShardPolicy.OFF
        can_shard = callable(getattr(dataset, "shard", None))
        if policy is AutoShardPolicy.AUTO:
            return AutoShardPolicy.FILE if can_shard else AutoShardPolicy.DATA
        if policy is AutoShardPolicy.FILE and not can_shard:
            raise DatasetError(
                f"AutoShardPolicy.FILE needs a dataset that can shard its files, with a method "
                f"shard(num_shards, index); {type(dataset).__name__} has none. Use "
                "AutoShardPolicy.DATA (every worker reads everything and keeps its rows) or "
                "shard it yourself and use AutoShardPolicy.OFF."
            )
        return policy

    @property
    def source(self) -> Iterable[Any]:
        """The iterable of global batches this dataset splits (after file sharding)."""
        return self._dataset

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]

    def __iter__(self) -> DistributedIterator:
        source = iter(self._dataset)
        template: list[Any] = []

        def next_step() -> Any:
            try:
                local, sizes = self._local_rows(to_tensors(next(source)))
                has_data = True
            except StopIteration:
                has_data = False
            if not self._sync_has_data(has_data):
                raise StopIteration
            if not has_data:
                if not template:
                    raise DatasetError(_NO_DATA_AT_ALL)
                local, sizes = empty_like_batch(template[0]), [0] * self.num_local_replicas
            if not template:
                template.append(empty_like_batch(local))
            return self._place(split_batch(local, sizes))

        return DistributedIterator(next_step, "experimental_distribute_dataset")

    def _local_rows(self, batch: Any) -> tuple[Any, list[int]]:
        """This worker's rows of a batch and how they split over its replicas.

        DATA: the batch is global; this worker keeps its rows (TF's batch_sizes_for_worker).
        OFF / FILE: the batch is already this worker's share; it is split over the replicas.
        """
        replicas = self.num_local_replicas
        rows = batch_dim(batch)
        if self._policy is not AutoShardPolicy.DATA:
            return batch, batch_sizes_for_worker(rows, 1, replicas, 0)
        sizes = batch_sizes_for_worker(rows, self._num_workers, replicas, 0)
        start = sum(sizes[: self._worker_index * replicas])
        mine = sizes[self._worker_index * replicas:(self._worker_index + 1) * replicas]
        rest = rows - start - sum(mine)
        return split_batch(batch, [start, sum(mine), rest])[1], mine


class DatasetFromFunction(_DistributedIterable):
    """One input pipeline per worker; each local replica takes its own consecutive element."""

    def __init__(
        self,
        dataset: Iterable[Any],
        devices: list[torch.device],
        options: InputOptions | None = None,
        sync_has_data: Callable[[bool], bool] = lambda has: has,
    ):
        if not hasattr(dataset, "__iter__"):
            raise DatasetError(
                f"dataset_fn must return an iterable of per-replica batches, got {type(dataset).__name__}."
            )
        super().__init__(devices, options, sync_has_data)
        self._dataset = dataset

    def __len__(self) -> int:
        return -(-len(self._dataset) // self.num_local_replicas)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        source = iter(self._dataset)
        template: list[Any] = []

        def next_step() -> Any:
            elements = []
            for _ in range(self.num_local_replicas):
                try:
                    element = to_tensors(next(source))
                except StopIteration:
                    break
                batch_dim(element)
                elements.append(element)
            if not self._sync_has_data(bool(elements)):
                raise StopIteration
            if elements and not template:
                template.append(empty_like_batch(elements[0]))
            if not template:
                raise DatasetError(_NO_DATA_AT_ALL)
            while len(elements) < self.num_local_replicas:
                elements.append(template[0])
            return self._place(elements)

        return DistributedIterator(next_step, "distribute_datasets_from_function")
