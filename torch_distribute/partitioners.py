"""Variable partitioners (``td.partitioners``): how many shards a parameter gets on the PS.

The same classes and the same arithmetic as ``tf.distribute.experimental.partitioners``. A
partitioner is called with a parameter's ``shape`` and ``dtype`` and returns the number of
partitions per axis; only axis 0 is ever split (``[k, 1, 1, ...]``). ``ParameterServerStrategy``
then cuts the rows TensorFlow's "div" way: the first ``dim0 % k`` shards get one extra row.

>>> import torch
>>> FixedShardsPartitioner(5)((13, 4), torch.float32)
[5, 1]
>>> shard_sizes(13, 5)
[3, 3, 3, 2, 2]
>>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), torch.float32)
[2, 1]
>>> MaxSizePartitioner(max_shard_bytes=8)((6, 1), torch.float32)
[3, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_distribute.errors import InvalidArgumentError

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "shard_offsets",
    "shard_sizes",
]


def _element_size(dtype: Any, bytes_per_string: int) -> int:
    """Bytes per element; TensorFlow's string dtype counts ``bytes_per_string``."""
    if dtype in (str, "string", "str"):
        return bytes_per_string
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def _check_axis(shape: Sequence[int], axis: int) -> None:
    if not 0 <= axis < len(shape):
        raise InvalidArgumentError(
            f"partitioner axis {axis} is out of range for a shape of rank {len(shape)} {tuple(shape)}."
        )


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"Argument `{name}` must be a positive integer. Received: {value!r}")


class Partitioner:
    """Base class: ``partitioner(shape, dtype, axis=0) -> [partitions per axis]``."""

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards, at most one per row: ``[min(num_shards, dim0), 1, ...]``.

    >>> FixedShardsPartitioner(4)((2, 3), "float32")
    [2, 1]
    """

    def __init__(self, num_shards: int):
        _positive("num_shards", num_shards)
        self._num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        del dtype
        shape = list(shape)
        _check_axis(shape, axis)
        result = [1] * len(shape)
        result[axis] = min(self._num_shards, shape[axis])
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as possible with at least ``min_shard_bytes`` each, at most ``max_shards``.

    TensorFlow's ``min_max_variable_partitioner``: ``ceil(total_bytes / min_shard_bytes)``
    shards, capped by ``max_shards`` and by the number of rows, at least 1.

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), torch.float32)
    [6, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        _positive("min_shard_bytes", min_shard_bytes)
        _positive("max_shards", max_shards)
        _positive("bytes_per_string", bytes_per_string)
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        shape = list(shape)
        _check_axis(shape, axis)
        total_bytes = math.prod(shape) * _element_size(dtype, self._bytes_per_string)
        wanted = int(math.ceil(total_bytes / self._min_shard_bytes))
        result = [1] * len(shape)
        result[axis] = max(1, min(shape[axis], self._max_shards, wanted))
        return result

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, "
                f"max_shards={self._max_shards}, bytes_per_string={self._bytes_per_string})")


class MaxSizePartitioner(Partitioner):
    """The fewest shards with at most ``max_shard_bytes`` each (a row is never split).

    TensorFlow's ``variable_axis_size_partitioner``: as many whole rows per shard as fit in
    ``max_shard_bytes`` (at least one), ``ceil(rows / rows_per_shard)`` shards, capped by
    ``max_shards`` when given.

    >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), torch.float32)
    [2, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        _positive("max_shard_bytes", max_shard_bytes)
        if max_shards is not None:
            _positive("max_shards", max_shards)
        _positive("bytes_per_string", bytes_per_string)
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        shape = list(shape)
        _check_axis(shape, axis)
        result = [1] * len(shape)
        if shape[axis] == 0:
            return result
        element_size = _element_size(dtype, self._bytes_per_string)
        bytes_per_slice = 1.0 * (math.prod(shape) / shape[axis]) * element_size
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice)) if bytes_per_slice else shape[axis]
        axis_shards = int(math.ceil(1.0 * shape[axis] / slices_per_shard))
        if self._max_shards:
            axis_shards = min(self._max_shards, axis_shards)
        result[axis] = axis_shards
        return result

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, "
                f"max_shards={self._max_shards}, bytes_per_string={self._bytes_per_string})")


def shard_sizes(dim0: int, num_shards: int) -> list[int]:
    """Rows per shard, TensorFlow's "div" way: the first ``dim0 % num_shards`` get one more.

    >>> shard_sizes(10, 4)
    [3, 3, 2, 2]
    """
    num_shards = max(1, min(num_shards, dim0)) if dim0 else 1
    base, extra = divmod(dim0, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def shard_offsets(dim0: int, num_shards: int) -> list[int]:
    """Start row of every shard plus the end: ``[0, 3, 6, 8, 10]`` for 10 rows in 4 shards."""
    offsets = [0]
    for size in shard_sizes(dim0, num_shards):
        offsets.append(offsets[-1] + size)
    return offsets
