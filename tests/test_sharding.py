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


# TensorFlow 2.21's MultiWorkerMirroredStrategy under OFF (2 or 3 workers of 1 CPU replica, each
# reading the whole dataset): each worker's rows are one stream cut by its rotated sizes
# batch_sizes_for_worker(G, W, 1, w), a piece taking rows of two batches where a short batch
# sits in the middle.
TF_OFF = [
    # (batches, workers, worker, TensorFlow's steps on that worker)
    ([4, 3, 4], 2, 0, [[0, 1], [2, 3], [10, 11], [12, 20], [21, 22], [23]]),
    ([3, 3], 2, 0, [[0, 1], [2], [10, 11], [12]]),
    ([3, 3], 2, 1, [[0], [1, 2], [10], [11, 12]]),
    ([4, 3], 3, 0, [[0, 1], [2], [3], [10, 11], [12]]),
    ([4, 3], 3, 1, [[0], [1], [2, 3], [10], [11], [12]]),
    ([4, 3], 3, 2, [[0], [1, 2], [3], [10], [11, 12]]),
]


@pytest.mark.parametrize(("sizes", "workers", "worker", "expected"), TF_OFF)
def test_off_policy_cuts_the_workers_rows_as_one_stream_as_tensorflow(sizes, workers, worker, expected):
    batches = [torch.arange(10 * k, 10 * k + rows) for k, rows in enumerate(sizes)]
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
    dataset = DistributedDataset(batches, [torch.device("cpu")], num_workers=workers, worker_index=worker,
                                 options=options)
    assert [step.tolist() for step in dataset] == expected  # one replica: plain tensors
    assert len(dataset) == len(expected)


def test_off_policy_hands_out_the_empty_pieces_of_a_global_batch_smaller_than_the_replicas():
    # 2 workers x 2 replicas, G = 3: batch_sizes_for_worker gives worker 0 the sizes 1, 1, 1, 0
    # and worker 1 1, 0, 1, 1. TensorFlow's Dataset.rebatch of those sizes (what its OFF policy
    # applies) hands out the empty pieces too, so every step holds at most 3 rows over the workers.
    options = td.InputOptions(auto_shard_policy=td.AutoShardPolicy.OFF)
    worker0 = DistributedDataset([torch.arange(3), torch.arange(10, 13)], CPU2, num_workers=2, worker_index=0,
                                 options=options)
    worker1 = DistributedDataset([torch.arange(20, 23)], CPU2, num_workers=2, worker_index=1, options=options)
    assert _rows(worker0) == [[[0], [1]], [[2], []], [[10], [11]], [[12], []]]
    assert _rows(worker1) == [[[20], []], [[21], [22]]]
    assert (len(worker0), len(worker1)) == (4, 2)
