"""Auto-sharding of distributed datasets across workers (the dataset side, no processes)."""

from __future__ import annotations

import pytest
import torch

import torch_distribute as td
from torch_distribute.input import DistributedDataset
from torch_distribute.input.step_agreement import StepReport

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
def test_data_policy_keeps_this_workers_pieces_of_each_global_batch(worker, expected):
    # TensorFlow 2.21: 7 rows over 4 replicas are 4 pieces of ceil(7/4) = 2 rows ([0, 1], [2, 3],
    # [4, 5], [6]); piece k goes to global replica k.
    global_batches = [torch.arange(7)]
    dataset = DistributedDataset(global_batches, CPU2, num_workers=2, worker_index=worker)
    assert _rows(dataset) == [expected]


def test_auto_picks_file_sharding_when_the_dataset_can_shard():
    files = [torch.arange(4) + 10 * i for i in range(4)]
    worker1 = DistributedDataset(FileDataset(files), CPU2, num_workers=2, worker_index=1)
    # Worker 1 reads files 1 and 3. Each of its batches is a global batch of 4 rows: one row per
    # replica of the 2 x 2, so each batch makes 2 steps of this worker's 2 replicas.
    assert _rows(worker1) == [[[10], [11]], [[12], [13]], [[30], [31]], [[32], [33]]]


def test_file_policy_without_files_is_a_clear_error():
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.FILE)
    with pytest.raises(td.DatasetError, match="shard"):
        DistributedDataset([torch.arange(4)], CPU2, num_workers=2, worker_index=0, options=options)


def test_off_policy_reads_the_whole_dataset_batched_by_the_global_batch():
    # TensorFlow 2.21 with OFF: every worker reads all of it; a batch of G = 5 rows is cut by
    # batch_sizes_for_worker(5, 2, 2, 1) = [1, 1, 2, 1] and taken 2 pieces a step.
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
    dataset = DistributedDataset([torch.arange(5)], CPU2, num_workers=2, worker_index=1, options=options)
    assert _rows(dataset) == [[[0], [1]], [[2, 3], [4]]]
    assert len(dataset) == 2


def test_workers_agree_to_stop_and_pad_with_empty_batches():
    # This worker's one batch makes two steps (4 rows over 2 x 2 replicas, 2 a step); the other
    # worker still has data for a third.
    others = iter([True, True, True, False])

    def sync(report: StepReport) -> list[StepReport]:
        return [report, StepReport(next(others), 2, 0)]

    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
    dataset = DistributedDataset(iter([torch.arange(4.0)]), CPU2, num_workers=2, worker_index=0,
                                 options=options, sync_step=sync)
    steps = list(dataset)
    assert len(steps) == 3
    assert [v.shape[0] for v in steps[2].values] == [0, 0]
    assert steps[2].values[0].dtype == torch.float32
