"""Distributed datasets: every step, one batch per replica, as ``PerReplica``.

``DistributedDataset`` takes an iterable of *global* batches (a ``DataLoader``, a list, a
generator; tensors, NumPy arrays, tuples, dicts) and cuts each into per-replica batches as
TensorFlow 2.21 does (``rebatch.py``: ``ceil(rows / replicas)`` rows each, in order, the last
replicas smaller or empty), each moved to its replica's device. ``DatasetFromFunction`` feeds
each replica its own consecutive elements of the worker's dataset, or with
``InputReplicationMode.PER_REPLICA`` the elements of its own dataset (the dataset function is
then called once per replica).

``InputOptions.experimental_per_replica_buffer_size`` steps are read ahead of the step handed
out (``prefetch.py``); ``get_next_as_optional()`` ends with an empty ``Optional`` and
``get_next()`` with ``td.OutOfRangeError`` (``next()`` with ``StopIteration``);
``element_spec`` describes one replica's batch.

Across workers (``InputOptions.auto_shard_policy``, else the dataset's own from
``td.data.with_options``, else AUTO), the dataset is batched by the global batch size under
every policy, as in TensorFlow: DATA — every worker reads the same global batches and keeps its
pieces of each; FILE — a dataset with ``shard(num_shards, index)`` gives each worker its own
files; OFF — each worker reads its whole dataset; AUTO — FILE when the dataset can shard
itself, else DATA. Under FILE and OFF a worker's global batch makes ``num_workers`` steps of
``global batch / num_replicas_in_sync`` rows per replica (``rebatch.py``).

Workers with different amounts of data stop together, under every policy (TensorFlow's
partial-batch handling, which multi-worker strategies always use): at every step the
workers exchange a small report (``step_agreement.py``: whether each still has data, its rows,
and under DATA in the first steps a digest of the global batch it read) through the
strategy's ``extended.gather_input_reports``: one small collective. While any has data, every
worker runs the step, those without data on an *empty* batch (first dimension 0, the
structure and dtypes of their earlier batches), which adds nothing to a summed loss or
gradient; when none has, ``StopIteration`` ends the epoch on every worker at the same step.
The same reports turn two silent mistakes into errors on every worker: a worker without any
data at the first step (a FILE shard without files), and DATA workers whose loaders shuffle
differently. The agreement is never skipped across workers: even DATA sharding of a sized
dataset cannot prove that every worker's dataset has the same length (each worker builds its
own), and a worker that stopped alone would leave the others waiting in their next collective.
With one worker the report is the local one and costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeGuard

import torch

from torch_distribute import context
from torch_distribute.errors import (
    ContextError,
    DatasetError,
    InvalidArgumentError,
    OutOfRangeError,
)
from torch_distribute.input import rebatch, step_agreement, step_rows
from torch_distribute.input.batching import (
    batch_dim,
    empty_like_batch,
    to_device,
    to_tensors,
)
from torch_distribute.input.dataset_options import options_of, resolve_shard_policy, unwrapped
from torch_distribute.input.element_spec import PeekableSource, batch_spec
from torch_distribute.input.input_context import (
    AutoShardPolicy,
    InputContext,
    InputOptions,
    InputReplicationMode,
)
from torch_distribute.input.optional import Optional
from torch_distribute.input.prefetch import DeviceFeeder, LocalStep, StepBuffer, default_buffer_size
from torch_distribute.input.sharding_sampler import refuse_sharding_sampler
from torch_distribute.input.step_agreement import StepReport
from torch_distribute.values import regroup

_NO_DATA_AT_ALL = (
    "This worker's dataset ran out before its first batch while other workers still have data, "
    "so it cannot make an empty batch of the right structure to take part in their steps. Give "
    "every worker at least one batch."
)

#: What ``DistributedDataset`` and ``DatasetFromFunction`` call at every step: every worker's
#: report of the step, in worker order (``extended.gather_input_reports`` across workers).
SyncStep = Callable[[StepReport], Sequence[StepReport]]


def _alone(report: StepReport) -> list[StepReport]:
    return [report]


def _rows(pieces: list[Any]) -> int:
    return sum(batch_dim(piece) for piece in pieces)


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
        sync_step: SyncStep,
    ):
        self._devices = list(devices)
        self._options = options or InputOptions()
        self._sync_step = sync_step
        size = self._options.experimental_per_replica_buffer_size
        fetch = self._options.experimental_fetch_to_device
        self.buffer_size = default_buffer_size(self._devices, fetch) if size is None else size

    @property
    def num_local_replicas(self) -> int:
        return len(self._devices)

    def _iterator(self, read_step: Callable[[], LocalStep | None], description: str,
                  policy: AutoShardPolicy | None = None) -> DistributedIterator:
        """Steps from ``read_step`` (one step's ``LocalStep``, ``None`` at this worker's end).

        ``buffer_size`` steps are read ahead; the workers exchange their reports at every step
        and those without data get empty batches (see the module's docstring).
        """
        feeder = DeviceFeeder(self._devices, self._options.experimental_fetch_to_device,
                              side_streams=self.buffer_size > 0)
        buffer = StepBuffer(read_step, feeder, self.buffer_size)
        empties: list[Any] = []
        steps = [0]
        iteration = step_rows.new_iteration()

        def next_step() -> Any:
            local = buffer.take()
            report = (StepReport(False, 0, 0) if local is None
                      else StepReport(True, _rows(local.pieces), local.digest))
            step = steps[0]
            global_rows = step_agreement.conclude(self._sync_step(report), step, policy)
            steps[0] += 1
            if global_rows is None:
                raise StopIteration
            if local is None:
                if not empties:
                    raise DatasetError(_NO_DATA_AT_ALL)
                pieces = empties
            else:
                pieces = local.pieces
                if not empties:
                    empties.extend(empty_like_batch(p) for p in pieces)
            batch = regroup(pieces, always_wrap=True)
            step_rows.record(batch, step_rows.StepRows(tuple(batch_dim(p) for p in pieces), global_rows,
                                                       iteration, step))
            return batch

        def element_spec() -> Any:
            pieces = buffer.peek() or empties
            if not pieces:
                raise DatasetError(f"The dataset given to {description} has no element to describe.")
            return batch_spec(pieces[0])

        return DistributedIterator(next_step, description, element_spec)


class DistributedIterator:
    """Iterator over a distributed dataset; ``next()`` gives the per-replica batches of one step."""

    def __init__(self, next_step: Callable[[], Any], description: str,
                 element_spec: Callable[[], Any] | None = None):
        self._next_step = next_step
        self._description = description
        self._element_spec = element_spec
        self._steps = 0

    @property
    def element_spec(self) -> Any:
        """The ``TensorSpec`` nest of one replica's batch (batch dimension ``None``).

        Read from the next step's batches, which are then fetched but not skipped.
        """
        if self._element_spec is None:
            raise DatasetError(f"This iterator of {self._description} does not know its element_spec.")
        return self._element_spec()

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
        """The next step's batches; ``td.OutOfRangeError`` at the end of the data (TensorFlow's
        ``get_next``; ``next(iterator)`` raises ``StopIteration``, as in TensorFlow)."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError(
                f"End of sequence: the iterator of {self._description} has no more data "
                "(use get_next_as_optional() to test for the end without an exception)."
            ) from None

    def get_next_as_optional(self) -> Optional:
        """The next step's batches as an ``Optional``, empty at the end of the data (no ``StopIteration``).

        Across workers, ``has_value()`` is the same on every worker: it is the agreement the
        iterator makes at every step anyway, so it costs no extra collective.

        >>> import torch, torch_distribute as td
        >>> it = iter(td.get_strategy().experimental_distribute_dataset([torch.ones(2, 1)]))
        >>> it.get_next_as_optional().has_value(), it.get_next_as_optional().has_value()
        (True, False)
        """
        _refuse_in_replica_context()
        try:
            value = self._next_step()
        except StopIteration:
            return Optional.empty()
        self._steps += 1
        return Optional.from_value(value)


class DistributedDataset(_DistributedIterable):
    """An iterable of global batches, split across replicas (and workers) at every step."""

    def __init__(
        self,
        dataset: Iterable[Any],
        devices: list[torch.device],
        num_workers: int = 1,
        worker_index: int = 0,
        options: InputOptions | None = None,
        sync_step: SyncStep = _alone,
    ):
        inner = unwrapped(dataset)
        if isinstance(inner, torch.utils.data.Dataset) and not isinstance(
            inner, torch.utils.data.IterableDataset
        ):
            raise DatasetError(
                f"{type(inner).__name__} is a map-style dataset of single examples; "
                "distributed datasets take global batches. Wrap it: "
                "torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE)."
            )
        if not hasattr(dataset, "__iter__"):
            raise DatasetError(
                f"experimental_distribute_dataset needs an iterable of global batches, got "
                f"{type(dataset).__name__}."
            )
        super().__init__(devices, options, sync_step)
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise InvalidArgumentError(
                "InputReplicationMode.PER_REPLICA is only supported by "
                "distribute_datasets_from_function (a dataset function called once per replica); "
                "experimental_distribute_dataset splits one dataset's batches. Leave the default."
            )
        self._num_workers = num_workers
        self._worker_index = worker_index
        requested = self._options.auto_shard_policy or options_of(dataset).experimental_distribute.auto_shard_policy
        refuse_sharding_sampler(inner, requested, num_workers, worker_index)
        # The call's policy first, then the dataset's own (td.data.with_options), then AUTO.
        self._policy = resolve_shard_policy(dataset, self._options.auto_shard_policy, num_workers)
        self._global_batch_size = rebatch.loader_batch_size(inner)
        if self._policy is AutoShardPolicy.FILE:
            dataset = dataset.shard(num_workers, worker_index)  # type: ignore[attr-defined]
        # Every step the workers exchange their reports (see the module's docstring): even
        # with DATA sharding of a sized dataset the lengths may differ, as each worker builds
        # its own dataset.
        self._dataset = dataset
        self._peekable = PeekableSource(dataset)

    @property
    def shard_policy(self) -> AutoShardPolicy:
        """The sharding policy in effect (OFF with one worker)."""
        return self._policy

    @property
    def element_spec(self) -> Any:
        """The ``TensorSpec`` nest of one replica's batch (batch dimension ``None``).

        The first batch is read to find it; the next iteration still starts with it.
        """
        try:
            return batch_spec(to_tensors(self._peekable.first()))
        except StopIteration:
            raise DatasetError("The dataset given to experimental_distribute_dataset is empty: "
                               "it has no element_spec.") from None

    @property
    def source(self) -> Iterable[Any]:
        """The iterable of global batches this dataset splits (after file sharding)."""
        return self._dataset

    def _reads_own_batches(self) -> bool:
        """Whether each worker cuts its own batches into steps (OFF and FILE across workers)."""
        return self._num_workers > 1 and self._policy is not AutoShardPolicy.DATA

    def __len__(self) -> int:
        """Steps per epoch on this worker: the dataset's batches, or under OFF and FILE across
        workers the steps its batches make (from a list's batches or a ``DataLoader``'s
        sampler; other datasets are assumed to give full global batches: ``num_workers``
        steps each)."""
        batches = len(self._dataset)  # type: ignore[arg-type]
        if not self._reads_own_batches():
            return batches
        rows = self._own_batch_rows()
        if rows is None:
            return batches * self._num_workers
        size = self._global_batch_size or (rows[0] if rows else 1)
        return rebatch.steps_for_own_rows(rows, size, self._num_workers, self.num_local_replicas,
                                          self._worker_index)

    def _own_batch_rows(self) -> list[int] | None:
        """The rows of each of this worker's batches, where known without reading data."""
        inner = unwrapped(self._dataset)
        if isinstance(inner, (list, tuple)):
            return [batch_dim(to_tensors(batch)) for batch in inner]
        size = self._global_batch_size
        sampler = getattr(inner, "sampler", None)
        if size and isinstance(inner, torch.utils.data.DataLoader) and hasattr(sampler, "__len__"):
            examples = len(sampler)  # type: ignore[arg-type]
            full, left = divmod(examples, size)
            return [size] * full + ([left] if left and not inner.drop_last else [])
        return None

    def __iter__(self) -> DistributedIterator:
        source = (to_tensors(batch) for batch in self._peekable)
        replicas = self.num_local_replicas
        if self._reads_own_batches():
            steps = rebatch.own_batches_by_step(source, self._global_batch_size, self._num_workers,
                                                replicas, self._worker_index)

            def read_own_step() -> LocalStep | None:
                pieces = next(steps, None)
                if pieces is None:
                    return None
                empty = empty_like_batch(pieces[0])
                return LocalStep(pieces + [empty] * (replicas - len(pieces)))

            return self._iterator(read_own_step, "experimental_distribute_dataset", self._policy)

        compare = self._num_workers > 1  # DATA: the workers must read the same global batches
        read = [0]

        def read_global_step() -> LocalStep | None:
            batch = next(source, None)
            if batch is None:
                return None
            read[0] += 1
            digest = step_agreement.batch_digest(batch) if compare and read[0] <= step_agreement.DIGESTED_STEPS else 0
            return LocalStep(rebatch.data_shard(batch, self._num_workers, replicas, self._worker_index), digest)

        return self._iterator(read_global_step, "experimental_distribute_dataset", self._policy)


def _is_iterable(candidate: object) -> TypeGuard[Iterable[object]]:
    """What a dataset function must return: something with ``__iter__`` (a dataset, a loader)."""
    return hasattr(candidate, "__iter__")


class DatasetFromFunction(_DistributedIterable):
    """Datasets made by a dataset function: one per worker (each local replica takes its own
    consecutive element) or, with ``InputReplicationMode.PER_REPLICA``, one per replica."""

    def __init__(
        self,
        dataset: Iterable[Any] | None,
        devices: list[torch.device],
        options: InputOptions | None = None,
        sync_step: SyncStep = _alone,
        *,
        replica_datasets: Sequence[Iterable[Any]] | None = None,
    ):
        super().__init__(devices, options, sync_step)
        self._per_replica = self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
        if self._per_replica:
            if replica_datasets is None or dataset is not None:
                raise InvalidArgumentError(
                    "InputReplicationMode.PER_REPLICA calls the dataset function once per replica: "
                    "build this with DatasetFromFunction.from_function(dataset_fn, ...) (as "
                    "strategy.distribute_datasets_from_function does), not with one dataset."
                )
            candidates: list[object] = list(replica_datasets)
            if len(candidates) != self.num_local_replicas:
                raise InvalidArgumentError(
                    f"replica_datasets has {len(candidates)} datasets for {self.num_local_replicas} local replicas; "
                    "give one per replica."
                )
        else:
            if replica_datasets is not None:
                raise InvalidArgumentError(
                    "replica_datasets is for InputReplicationMode.PER_REPLICA; pass "
                    "InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA) or one dataset."
                )
            candidates = [dataset]
        datasets: list[Iterable[object]] = []
        for each in candidates:
            if not _is_iterable(each):
                raise DatasetError(
                    f"dataset_fn must return an iterable of per-replica batches, got {type(each).__name__}."
                )
            datasets.append(each)
        self._datasets = datasets
        self._sources = [PeekableSource(each) for each in datasets]

    @classmethod
    def from_function(
        cls,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        devices: list[torch.device],
        *,
        num_workers: int = 1,
        worker_index: int = 0,
        replica_id_offset: int = 0,
        num_replicas_in_sync: int | None = None,
        options: InputOptions | None = None,
        sync_step: SyncStep = _alone,
    ) -> DatasetFromFunction:
        """Call ``dataset_fn`` once per worker, or once per replica with PER_REPLICA.

        PER_REPLICA (TensorFlow's rule): replica ``r`` (its global id) gets
        ``InputContext(num_input_pipelines=num_replicas_in_sync, input_pipeline_id=r)``.

        >>> import torch, torch_distribute as td
        >>> options = td.InputOptions(experimental_replication_mode=td.InputReplicationMode.PER_REPLICA)
        >>> ds = DatasetFromFunction.from_function(
        ...     lambda ctx: [torch.full((1,), ctx.input_pipeline_id)], [torch.device("cpu")] * 2, options=options)
        >>> [t.item() for t in next(iter(ds)).values]
        [0, 1]
        """
        options = options or InputOptions()
        replicas = len(devices)
        total = num_replicas_in_sync if num_replicas_in_sync is not None else replicas * num_workers
        if options.experimental_replication_mode is InputReplicationMode.PER_WORKER:
            dataset = dataset_fn(InputContext(num_workers, worker_index, total))
            return cls(dataset, devices, options, sync_step)
        datasets = []
        for k, device in enumerate(devices):
            with _dataset_device(options, device):
                datasets.append(dataset_fn(InputContext(total, replica_id_offset + k, total)))
        return cls(None, devices, options, sync_step, replica_datasets=datasets)

    def __len__(self) -> int:
        if self._per_replica:
            return max(len(each) for each in self._datasets)  # type: ignore[arg-type]
        return -(-len(self._datasets[0]) // self.num_local_replicas)  # type: ignore[arg-type]

    @property
    def element_spec(self) -> Any:
        """The ``TensorSpec`` nest of one replica's batch (batch dimension ``None``).

        The first element is read to find it; the next iteration still starts with it.
        """
        try:
            with _dataset_device(self._options, self._devices[0]):
                return batch_spec(to_tensors(self._sources[0].first()))
        except StopIteration:
            raise DatasetError("The dataset made by dataset_fn is empty: it has no element_spec.") from None

    def __iter__(self) -> DistributedIterator:
        read_step = self._read_per_replica() if self._per_replica else self._read_per_worker()
        return self._iterator(read_step, "distribute_datasets_from_function")

    def _read_per_worker(self) -> Callable[[], LocalStep | None]:
        source = iter(self._sources[0])

        def read_step() -> LocalStep | None:
            elements = []
            for _ in range(self.num_local_replicas):
                try:
                    element = to_tensors(next(source))
                except StopIteration:
                    break
                batch_dim(element)
                elements.append(element)
            if not elements:
                return None
            empty = empty_like_batch(elements[0])
            return LocalStep(elements + [empty] * (self.num_local_replicas - len(elements)))

        return read_step

    def _read_per_replica(self) -> Callable[[], LocalStep | None]:
        sources = [iter(source) for source in self._sources]
        ended = [False] * len(sources)
        template: list[Any] = []

        def read_step() -> LocalStep | None:
            elements: list[Any] = [None] * len(sources)
            for k, (source, device) in enumerate(zip(sources, self._devices, strict=True)):
                if ended[k]:
                    continue
                with _dataset_device(self._options, device):
                    try:
                        element = to_tensors(next(source))
                    except StopIteration:
                        ended[k] = True
                        continue
                batch_dim(element)
                elements[k] = element
                if not template:
                    template.append(empty_like_batch(element))
            if all(element is None for element in elements):
                return None
            place = self._options.experimental_place_dataset_on_device
            return LocalStep([element if element is not None else (to_device(template[0], device) if place else template[0])
                              for element, device in zip(elements, self._devices, strict=True)])

        return read_step


def _dataset_device(options: InputOptions, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """With ``experimental_place_dataset_on_device``, the replica's device as torch's default device."""
    return device if options.experimental_place_dataset_on_device else contextlib.nullcontext()
