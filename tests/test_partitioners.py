"""td.partitioners: TensorFlow's shard counts and the "div" row split."""

from __future__ import annotations

import pytest
import torch

import torch_distribute as td
from torch_distribute.partitioners import shard_offsets, shard_sizes

P = td.partitioners


def test_shard_sizes_first_shards_get_the_remainder():
    assert shard_sizes(13, 5) == [3, 3, 3, 2, 2]
    assert shard_offsets(13, 5) == [0, 3, 6, 9, 11, 13]
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(3, 5) == [1, 1, 1]  # never more shards than rows
    assert shard_sizes(6, 1) == [6]


def test_fixed_shards():
    assert P.FixedShardsPartitioner(5)((13, 4), torch.float32) == [5, 1]
    assert P.FixedShardsPartitioner(4)((2, 3), torch.float32) == [2, 1]
    assert P.FixedShardsPartitioner(2)((7,), torch.int64) == [2]


@pytest.mark.parametrize(("min_bytes", "max_shards", "expected"), [
    (4, 2, [2, 1]),       # TF's docstring examples on a [6, 1] float32
    (4, 10, [6, 1]),
    (12, 10, [2, 1]),     # 24 bytes / 12 = 2 shards
    (256 << 10, 4, [1, 1]),  # too small to split
    (7, 10, [4, 1]),      # ceil(24 / 7) = 4
])
def test_min_size_partitioner(min_bytes, max_shards, expected):
    assert P.MinSizePartitioner(min_shard_bytes=min_bytes, max_shards=max_shards)((6, 1), torch.float32) == expected


def test_min_size_partitioner_counts_dtype_and_strings():
    # [100, 10] float64 = 8000 bytes; 1000-byte minimum: 8 shards; capped by max_shards.
    assert P.MinSizePartitioner(1000, 16)((100, 10), torch.float64) == [8, 1]
    assert P.MinSizePartitioner(1000, 4)((100, 10), torch.float64) == [4, 1]
    # strings count bytes_per_string each: 100 * 16 = 1600 bytes over 400 -> 4.
    assert P.MinSizePartitioner(400, 10, bytes_per_string=16)((100,), "string") == [4]


@pytest.mark.parametrize(("max_bytes", "max_shards", "expected"), [
    (8, None, [3, 1]),    # 2 rows (8 bytes) per shard
    (4, 2, [2, 1]),       # capped
    (3, None, [6, 1]),    # a row never splits: at least one row per shard
    (1000, None, [1, 1]),
])
def test_max_size_partitioner(max_bytes, max_shards, expected):
    assert P.MaxSizePartitioner(max_bytes, max_shards)((6, 1), torch.float32) == expected


def test_max_size_partitioner_wide_rows():
    # rows of 10 float32 = 40 bytes; 100-byte shards hold 2 rows: ceil(13 / 2) = 7.
    assert P.MaxSizePartitioner(100)((13, 10), torch.float32) == [7, 1]


@pytest.mark.parametrize("make", [
    lambda: P.FixedShardsPartitioner(0),
    lambda: P.MinSizePartitioner(min_shard_bytes=0),
    lambda: P.MinSizePartitioner(max_shards=0),
    lambda: P.MinSizePartitioner(bytes_per_string=0),
    lambda: P.MaxSizePartitioner(0),
    lambda: P.MaxSizePartitioner(10, max_shards=0),
])
def test_invalid_arguments(make):
    with pytest.raises(td.InvalidArgumentError, match="must be a positive integer"):
        make()


def test_axis_out_of_range():
    with pytest.raises(td.InvalidArgumentError, match="out of range"):
        P.FixedShardsPartitioner(2)((), torch.float32)
