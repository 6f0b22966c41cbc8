"""How a global batch is cut into per-replica batches."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torch_distribute import nest
from torch_distribute.errors import DatasetError


def batch_sizes_for_worker(global_batch_size: int, num_workers: int, num_replicas_per_worker: int, worker_index: int) -> list[int]:
    """TensorFlow's ``batch_sizes_for_worker``: the sub-batch sizes, rotated for ``worker_index``.

    The global batch is cut into ``num_workers * num_replicas_per_worker`` sub-batches whose
    sizes differ by at most one; the list is rotated left by ``worker_index * replicas``, so
    its first ``num_replicas_per_worker`` entries are this worker's replicas' sizes.

    >>> batch_sizes_for_worker(7, 2, 2, 0), batch_sizes_for_worker(7, 2, 2, 1)
    ([2, 2, 2, 1], [2, 1, 2, 2])
    >>> batch_sizes_for_worker(10, 1, 4, 0)
    [3, 3, 2, 2]
    """
    num_subbatches = num_workers * num_replicas_per_worker
    floor = global_batch_size // num_subbatches
    num_ceil = global_batch_size - num_subbatches * floor
    sizes = [floor + 1] * num_ceil + [floor] * (num_subbatches - num_ceil)
    offset = worker_index * num_replicas_per_worker
    return sizes[offset:] + sizes[:offset]


def to_tensors(batch: Any) -> Any:
    """NumPy arrays become tensors; anything else that is not a tensor is refused."""

    def convert(leaf: Any) -> torch.Tensor:
        if isinstance(leaf, torch.Tensor):
            return leaf
        if isinstance(leaf, np.ndarray):
            return torch.from_numpy(leaf)
        raise DatasetError(
            f"A dataset element contains a {type(leaf).__name__}; distributed datasets need "
            "batches made of tensors or NumPy arrays (tuples, lists and dicts of them)."
        )

    return nest.map_structure(convert, batch)


def batch_dim(batch: Any) -> int:
    """The size of the first dimension shared by every tensor of ``batch``."""
    leaves = nest.leaves(batch)
    if not leaves:
        raise DatasetError("A dataset element is empty (no tensors in it).")
    sizes = set()
    for leaf in leaves:
        if leaf.dim() == 0:
            raise DatasetError(
                "The dataset yields unbatched elements (a tensor with no batch dimension). "
                "Distributed datasets take *global batches*: wrap a map-style dataset in "
                "torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH_SIZE)."
            )
        sizes.add(leaf.shape[0])
    if len(sizes) > 1:
        raise DatasetError(
            f"The tensors of one batch have different first dimensions {sorted(sizes)}; "
            "every tensor of a batch must have the batch size as its first dimension."
        )
    return sizes.pop()


def split_batch(batch: Any, sizes: list[int]) -> list[Any]:
    """Cut every tensor of ``batch`` along dim 0 into pieces of ``sizes`` (zeros allowed)."""
    if len(sizes) == 1:  # one replica: the batch itself, no views to make
        return [batch]
    leaves, spec = nest.flatten(batch)
    pieces = [torch.split(leaf, sizes, dim=0) for leaf in leaves]
    return [nest.unflatten([p[k] for p in pieces], spec) for k in range(len(sizes))]


def empty_like_batch(batch: Any) -> Any:
    """A batch with the structure, dtypes and trailing shape of ``batch`` but 0 rows."""
    return nest.map_structure(lambda t: t.new_empty((0, *t.shape[1:])), batch)


def to_device(batch: Any, device: torch.device) -> Any:
    return nest.map_structure(
        lambda t: t if t.device == device else t.to(device, non_blocking=True), batch
    )
