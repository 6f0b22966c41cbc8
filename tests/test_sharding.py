"""Auto-sharding of distributed datasets across workers (the dataset side, no processes)."""

from __future__ import annotations

import pytest
import torch

import torch_distribute as td
from torch_distribute.input import DistributedDataset

CPU2 = [torch.device("cpu")] * 2


class FileDataset:
    """A dataset that exposes files and can shard them (as TF's FILE policy needs)."""

    def __init__(self, files: list[torch.Tensor]):
        self.files = files

    def shard(self, num_shards: int, index: int) -> FileDataset:
        return FileDataset(self.files[index::num_shards])

    def __iter__(self):
        return iter(self.files)


def _rows(dataset: DistributedDataset) -> list[list[list[int]]]:
    return [[v.tolist() for v in step.values] for step in dataset]


@pytest.mark.parametrize("worker,expected", [(0, [[0, 1], [2, 3]]), (1, [[4, 5], [6]])])
def test_data_policy_keeps_this_workers_rows_of_each_global_batch(worker, expected):
    global_batches = [torch.arange(7)]
    dataset = DistributedDataset(global_batches, CPU2, num_workers=2, worker_index=worker)
    assert _rows(dataset) == [expected]  # TF's batch_sizes_for_worker(7, 2, 2, w)


def test_auto_picks_file_sharding_when_the_dataset_can_shard():
    files = [torch.arange(4) + 10 * i for i in range(4)]
    worker1 = DistributedDataset(FileDataset(files), CPU2, num_workers=2, worker_index=1)
    # Worker 1 reads files 1 and 3; each of its batches is split over its two replicas.
    assert _rows(worker1) == [[[10, 11], [12, 13]], [[30, 31], [32, 33]]]


def test_file_policy_without_files_is_a_clear_error():
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.FILE)
    with pytest.raises(td.DatasetError, match="shard"):
        DistributedDataset([torch.arange(4)], CPU2, num_workers=2, worker_index=0, options=options)


def test_off_policy_takes_each_workers_batches_as_its_share():
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
    dataset = DistributedDataset([torch.arange(5)], CPU2, num_workers=2, worker_index=1, options=options)
    assert _rows(dataset) == [[[0, 1, 2], [3, 4]]]


def test_workers_agree_to_stop_and_pad_with_empty_batches():
    # This worker has one batch; the others still have data for a second step.
    agreed = iter([True, True, False])
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
    dataset = DistributedDataset(iter([torch.arange(4.0)]), CPU2, num_workers=2, worker_index=0,
                                 options=options, sync_has_data=lambda has: next(agreed))
    steps = list(dataset)
    assert len(steps) == 2
    assert [v.shape[0] for v in steps[1].values] == [0, 0]
    assert steps[1].values[0].dtype == torch.float32
