"""What ``fit``/``evaluate``/``predict`` accept, turned into global batches for the strategy.

- tensors or NumPy arrays (or tuples/dicts of them, for several inputs or outputs) with
  ``batch_size``: cut into global batches, reshuffled every epoch when ``shuffle``;
- a ``torch.utils.data.DataLoader`` or any iterable of batches ``(x, y)`` /
  ``(x, y, sample_weight)`` / ``x``: its batches are the global batches;
- a distributed dataset (``strategy.experimental_distribute_dataset(...)``): used as it is;
- a ``td.keras.utils.experimental.DatasetCreator`` (with ``steps_per_epoch``): made into one
  with ``strategy.distribute_datasets_from_function``.

``batch_size`` is the *global* batch (Keras' meaning under a strategy): the strategy cuts
every global batch over its replicas and workers. Every worker reads the same global
batches and keeps its own rows (``AutoShardPolicy.DATA``), so a shuffling ``DataLoader``
must shuffle the same way on every worker (give it a seeded ``generator``). A dataset that
carries its own policy (``td.data.with_options``) is sharded by it instead.

With ``steps_per_epoch`` the data is one stream (as in Keras): each epoch takes the next
``steps_per_epoch`` batches, a new (reshuffled) pass starts when a pass has been used up at
an epoch's start, and data that runs out in the middle of an epoch ends training with a
warning.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torch_distribute import nest
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.input import (
    AutoShardPolicy,
    DatasetFromFunction,
    DistributedDataset,
    InputOptions,
    data,
    step_rows,
)
from torch_distribute.keras.dataset_creator import DatasetCreator
from torch_distribute.values import PerReplica

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy

__all__ = ["ArrayBatches", "DataHandler", "IterableBatches", "make_handler", "unpack"]

# One global batch read per step, never ahead: _Epoch records the rows of the step's batch.
DATA_SHARDING = InputOptions(auto_shard_policy=AutoShardPolicy.DATA, experimental_per_replica_buffer_size=0)


def unpack(batch: Any) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` of a batch (Keras' ``unpack_x_y_sample_weight``)."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if type(batch) is not tuple:
        return batch, None, None
    if len(batch) == 1:
        return batch[0], None, None
    if len(batch) == 2:
        return batch[0], batch[1], None
    if len(batch) == 3:
        return batch
    raise InvalidArgumentError(
        f"A batch is a tuple of {len(batch)} elements; batches are x, (x,), (x, y) or "
        "(x, y, sample_weight). Put several inputs in a tuple or dict: ((x1, x2), y)."
    )


def _pack(x: Any, y: Any, sample_weight: Any) -> tuple[Any, ...]:
    return tuple(v for v in (x, y, sample_weight) if v is not None)


def _to_tensor(value: Any, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    array = np.asarray(value)
    if array.dtype == object:
        raise InvalidArgumentError(f"{what} holds Python objects ({type(value).__name__}); pass numbers in a tensor or array.")
    if array.dtype == np.float64:  # Keras' floatx: float64 NumPy data trains in float32
        array = array.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(array))


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _arrays(value: Any, what: str) -> Any:
    """A nest of tensors from tensors / arrays / lists of numbers / tuples and dicts of arrays."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _arrays(v, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (tuple, list)) and value and all(_is_array(v) or isinstance(v, (tuple, list, dict)) for v in value) \
            and any(_is_array(v) for v in value):
        return tuple(_arrays(v, f"{what}[{i}]") for i, v in enumerate(value))
    return _to_tensor(value, what)


def _rows(structure: Any) -> int:
    leaves = nest.leaves(structure)
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 0


class ArrayBatches:
    """Global batches of in-memory tensors; pass ``p`` is shuffled by ``(seed, p)``."""

    def __init__(self, x: Any, y: Any, sample_weight: Any, batch_size: int, shuffle: bool, seed: int = 0):
        self.data = _pack(x, y, sample_weight)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rows = _rows(self.data)
        self.num_batches: int | None = -(-self.rows // batch_size)
        self.reiterable = True

    def passes(self, pass_index: int) -> Iterator[Any]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + pass_index)
            order = torch.randperm(self.rows, generator=generator)
            for start in range(0, self.rows, self.batch_size):
                index = order[start:start + self.batch_size]
                yield nest.map_structure(operator.itemgetter(index), self.data)
        else:
            for start in range(0, self.rows, self.batch_size):
                yield nest.map_structure(operator.itemgetter(slice(start, start + self.batch_size)), self.data)


class IterableBatches:
    """Global batches from a ``DataLoader``, a list or any iterable (a one-shot iterator is a stream)."""

    def __init__(self, iterable: Iterable[Any]):
        self.iterable = iterable
        self.reiterable = iter(iterable) is not iterable
        try:
            self.num_batches: int | None = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            self.num_batches = None

    def passes(self, pass_index: int) -> Iterator[Any]:
        for batch in self.iterable:
            x, y, sample_weight = unpack(batch)
            yield _pack(x, y, sample_weight)

    def generators(self) -> list[torch.Generator]:
        """Generators that decide the order (a DataLoader's), for bitwise resumption."""
        found: list[torch.Generator] = []
        holders = [self.iterable, getattr(self.iterable, "sampler", None),
                   getattr(getattr(self.iterable, "batch_sampler", None), "sampler", None)]
        for holder in holders:
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
                found.append(generator)
        return found


class _Epoch:
    """One epoch's global batches; records the row count of the latest one for the training loop.

    A distributed dataset takes exactly one global batch per step, so the latest one is the
    batch of the step just taken (also after batches were skipped to resume a run).
    """

    def __init__(self, record_rows: Callable[[int], None], batches: Iterator[Any], length: int | None):
        self._record_rows = record_rows
        self._batches = batches
        self._length = length

    def __iter__(self) -> Iterator[Any]:
        for batch in self._batches:
            self._record_rows(_rows(batch))
            yield batch


class _SizedEpoch(_Epoch):
    def __len__(self) -> int:
        assert self._length is not None
        return self._length


class DataHandler:
    """Epochs of distributed batches and the global row count of each step.

    >>> import torch, torch_distribute as td
    >>> handler = make_handler(td.get_strategy(), torch.ones(5, 2), torch.zeros(5), batch_size=2, shuffle=False)
    >>> [handler.global_rows(b) for b in handler.epoch(0)]
    [2, 2, 1]
    """

    def __init__(self, strategy: Strategy, source: ArrayBatches | IterableBatches | None,
                 distributed: Any = None, steps_per_epoch: int | None = None,
                 input_options: InputOptions = DATA_SHARDING):
        self.strategy = strategy
        self.source = source
        self.distributed = distributed
        self.steps_per_epoch = steps_per_epoch
        self.input_options = input_options
        workers = strategy.extended.num_input_pipelines  # the workers, or the replicas of a mesh
        # Without DATA sharding each worker reads batches of its own: the global rows are summed.
        self._rows_are_global = input_options.auto_shard_policy is AutoShardPolicy.DATA or workers == 1
        # ... and each of its (global) batches makes one step per worker (TensorFlow's rule).
        self._steps_per_batch = 1 if self._rows_are_global else workers
        if source is not None and steps_per_epoch is not None and steps_per_epoch % self._steps_per_batch:
            raise InvalidArgumentError(
                f"steps_per_epoch={steps_per_epoch} with a dataset each of the {workers} workers reads "
                f"itself ({input_options.auto_shard_policy.name}): each of its global batches makes "
                f"{workers} steps, so steps_per_epoch must be a multiple of {workers}."
            )
        self.exhausted = False
        self._last_rows: int | None = None
        self._stream: Iterator[Any] | None = None
        self._pass = -1
        self._taken_in_pass = 0
        self._pass_start_rng: dict[str, Any] | None = None
        self._epoch_start: dict[str, Any] = self._position()
        self._rebuild = False
        self._loaded: dict[str, Any] | None = None

    @property
    def steps(self) -> int | None:
        """Steps per epoch when known (the progress bar's target)."""
        if self.steps_per_epoch is not None:
            return self.steps_per_epoch
        if self.source is not None:
            batches = self.source.num_batches
            return None if batches is None else batches * self._steps_per_batch
        try:
            return len(self.distributed)
        except TypeError:
            return None

    def generators(self) -> list[torch.Generator]:
        return self.source.generators() if isinstance(self.source, IterableBatches) else []

    # -- the stream's position, for BackupAndRestore ----------------------------------------
    def _position(self) -> dict[str, Any]:
        return {"pass": self._pass, "taken_in_pass": self._taken_in_pass, "pass_start_rng": self._pass_start_rng}

    def state_dict(self) -> dict[str, Any]:
        """Where the stream (``steps_per_epoch``) stood when the current epoch started, and now."""
        return {"epoch_start": self._epoch_start, "current": self._position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = state

    def restore_position(self, mid_epoch: bool) -> None:
        """Go back to the loaded position: the epoch's start when resuming inside it (its batches
        done are then skipped by the backup), else where the stream stood at the save."""
        state = self._loaded
        if state is None:
            return
        position = state["epoch_start" if mid_epoch else "current"]
        self._pass = int(position["pass"])
        self._taken_in_pass = int(position["taken_in_pass"])
        self._pass_start_rng = position["pass_start_rng"]
        self._stream = None
        self._rebuild = self._pass >= 0 if self.source is not None else self._taken_in_pass > 0

    def _rebuild_stream(self) -> None:
        """Pass ``self._pass`` as it was, ``taken_in_pass`` batches into it: made again from the
        RNG state it started from, then the RNG given back (the backup restores its own)."""
        self._rebuild = False
        saved_torch = torch.get_rng_state()
        if self._pass_start_rng is not None:
            torch.set_rng_state(self._pass_start_rng["torch"])
            for generator, state in zip(self.generators(), self._pass_start_rng["generators"], strict=False):
                generator.set_state(state)
        self._stream = iter(self.source.passes(self._pass) if self.source is not None else self.distributed)
        for _ in range(self._taken_in_pass):
            next(self._stream)
        torch.set_rng_state(saved_torch)

    def _rng_state(self) -> dict[str, Any] | None:
        if not isinstance(self.source, IterableBatches):
            return None  # array passes are shuffled from (seed, pass) alone
        return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in self.generators()]}

    def epoch(self, epoch: int) -> Iterable[Any]:
        """The distributed batches of ``epoch`` (each a ``PerReplica`` nest)."""
        self._last_rows = None
        self._epoch_start = self._position()
        if self.source is None:
            batches: Iterable[Any] = self.distributed
            return batches if self.steps_per_epoch is None else self._take(self.distributed, self.steps_per_epoch)
        if self.steps_per_epoch is None and self.source.reiterable:
            global_batches: Iterator[Any] = self.source.passes(epoch)
        else:
            global_batches = self._stream_batches()
        length = None if self.steps is None else self.steps // self._steps_per_batch  # batches, not steps
        epoch_batches = (_SizedEpoch(self._record_rows, global_batches, length) if length is not None
                         else _Epoch(self._record_rows, global_batches, None))
        return self.strategy.experimental_distribute_dataset(epoch_batches, options=self.input_options)

    def _take(self, iterable: Iterable[Any], count: int) -> Iterator[Any]:
        """The next ``count`` batches of a distributed dataset, one stream across epochs."""
        if self._rebuild:
            self._rebuild_stream()
        if self._stream is None:
            self._stream = iter(iterable)
            self._taken_in_pass = 0
        iterator = self._stream
        for _ in range(count):
            try:
                batch = next(iterator)
            except StopIteration:
                self.exhausted = True
                self._stream = None
                return
            self._taken_in_pass += 1
            yield batch

    def _new_pass(self) -> None:
        self._pass += 1
        self._taken_in_pass = 0
        self._pass_start_rng = self._rng_state()
        self._stream = iter(self.source.passes(self._pass)) if self.source.reiterable or self._stream is None else self._stream

    def _record_rows(self, rows: int) -> None:
        if self._rows_are_global:
            self._last_rows = rows

    def _stream_batches(self) -> Iterator[Any]:
        """The next ``steps_per_epoch`` batches of the stream (or what is left of a one-shot one)."""
        num_batches = self.source.num_batches
        if self._rebuild:
            self._rebuild_stream()
        if self._stream is None or (self.source.reiterable and num_batches is not None and self._taken_in_pass >= num_batches):
            self._new_pass()
        limit = None if self.steps_per_epoch is None else self.steps_per_epoch // self._steps_per_batch
        taken = 0
        while limit is None or taken < limit:
            stream = self._stream
            assert stream is not None  # made above, by _rebuild_stream or _new_pass
            try:
                batch = next(stream)
            except StopIteration:
                if limit is not None or taken == 0:
                    self.exhausted = True
                return
            taken += 1
            self._taken_in_pass += 1
            yield batch

    def global_rows(self, distributed_batch: Any) -> int:
        """Rows of the global batch this step trains on (every replica of every worker)."""
        if self._last_rows is not None:
            return self._last_rows
        recorded = step_rows.find(distributed_batch)  # the workers' per-step exchange counted them
        if recorded is not None:
            return recorded.global_rows
        first = nest.leaves(distributed_batch)[0]
        local = [int(part.shape[0]) for part in self.strategy.experimental_local_results(first)]
        if self.strategy.num_replicas_in_sync == len(local):
            return sum(local)
        total = self.strategy.reduce("sum", _per_replica(local), axis=None)
        return int(total)


def _per_replica(values: list[int]) -> Any:
    return PerReplica([torch.tensor(v, dtype=torch.int64) for v in values])


def make_handler(
    strategy: Strategy,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    batch_size: int | None = None,
    shuffle: bool = False,
    steps_per_epoch: int | None = None,
    seed: int = 0,
    default_batch_size: int = 32,
    what: str = "x",
) -> DataHandler:
    """A ``DataHandler`` for any accepted input, with clear errors for what is not accepted."""
    if x is None:
        raise InvalidArgumentError(f"{what} is None: pass the input data (tensors, a DataLoader or an iterable of batches).")
    if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                        or steps_per_epoch < 1):
        raise InvalidArgumentError(f"steps must be a positive int or None, got {steps_per_epoch!r}.")
    if isinstance(x, DatasetCreator):
        _no_batching_args(x, y, sample_weight, batch_size, "a DatasetCreator")
        if steps_per_epoch is None:
            raise InvalidArgumentError(
                "A DatasetCreator's dataset may not end: pass steps_per_epoch= to fit (steps= to evaluate, "
                "validation_steps= for validation data), as TensorFlow requires.")
        x = strategy.distribute_datasets_from_function(x.dataset_fn, x.input_options)
    if isinstance(x, (DistributedDataset, DatasetFromFunction)):
        _no_batching_args(x, y, sample_weight, batch_size, "a distributed dataset")
        return DataHandler(strategy, None, distributed=x, steps_per_epoch=steps_per_epoch)
    if isinstance(data.unwrapped(x), torch.utils.data.Dataset) and not isinstance(
            data.unwrapped(x), torch.utils.data.IterableDataset):
        raise InvalidArgumentError(
            f"{what} is a map-style {type(data.unwrapped(x)).__name__} of single examples; wrap it in "
            "torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE, shuffle=...) or pass "
            "tensors with batch_size=."
        )
    arrays = _is_array(x) or isinstance(x, dict) or (
        isinstance(x, (tuple, list)) and (y is not None or all(_is_array(v) for v in x)) and x and _is_array(nest.leaves(x)[0]))
    if not arrays:
        if not hasattr(x, "__iter__") or isinstance(x, (str, bytes)):
            raise InvalidArgumentError(
                f"{what} of type {type(x).__name__} is not accepted: pass tensors or NumPy arrays, a "
                "DataLoader, an iterable of batches, or a distributed dataset."
            )
        kind = "a DataLoader" if isinstance(x, torch.utils.data.DataLoader) else "an iterable of batches"
        _no_batching_args(x, y, sample_weight, batch_size, kind)
        x, options = _own_sharding(strategy, x)
        return DataHandler(strategy, IterableBatches(x), steps_per_epoch=steps_per_epoch, input_options=options)
    xs, ys, ws = _arrays(x, what), _arrays(y, "y"), _arrays(sample_weight, "sample_weight")
    counts = {name: _rows(v) for name, v in (("x", xs), ("y", ys), ("sample_weight", ws)) if v is not None}
    for name, value in (("x", xs), ("y", ys), ("sample_weight", ws)):
        if value is not None and len({int(t.shape[0]) if t.dim() else -1 for t in nest.leaves(value)}) > 1:
            raise InvalidArgumentError(f"The arrays of {name} have different numbers of rows; every input needs one row per sample.")
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{name} has {n} rows" for name, n in counts.items())
        raise InvalidArgumentError(f"Data cardinality is ambiguous: {detail}. Pass arrays with the same number of samples.")
    if next(iter(counts.values())) == 0:
        raise InvalidArgumentError(f"{what} has no rows: there is nothing to train or evaluate on.")
    if batch_size is None:
        batch_size = default_batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int (the global batch), got {batch_size!r}.")
    return DataHandler(strategy, ArrayBatches(xs, ys, ws, batch_size, shuffle, seed), steps_per_epoch=steps_per_epoch)


def _own_sharding(strategy: Strategy, x: Any) -> tuple[Any, InputOptions]:
    """The dataset's own sharding policy (``td.data.with_options``) if it has one, else DATA.

    FILE shards the dataset here, once (its ``shard(num_shards, index)``); each worker then
    reads its own global batches, as under OFF (each makes one step per worker).
    """
    if data.options_of(x).experimental_distribute.auto_shard_policy is None:
        return x, DATA_SHARDING
    workers, index = strategy.extended.num_input_pipelines, strategy.extended.input_pipeline_id
    policy = data.resolve_shard_policy(x, None, workers)
    if policy is AutoShardPolicy.FILE:
        x, policy = x.shard(workers, index), AutoShardPolicy.OFF
    return x, InputOptions(auto_shard_policy=policy, experimental_per_replica_buffer_size=0)


def _no_batching_args(x: Any, y: Any, sample_weight: Any, batch_size: Any, kind: str) -> None:
    if batch_size is not None:
        raise InvalidArgumentError(
            f"batch_size={batch_size} was given with {kind}, which is already batched. Set the global "
            "batch size where the batches are made (DataLoader(..., batch_size=GLOBAL_BATCH)) and leave "
            "batch_size=None."
        )
    if y is not None:
        raise InvalidArgumentError(
            f"y was given with {kind}: its batches must carry the targets, as (x, y) tuples. Leave y=None."
        )
    if sample_weight is not None:
        raise InvalidArgumentError(
            f"sample_weight was given with {kind}: yield (x, y, sample_weight) batches instead."
        )
