"""How a worker's stream of batches becomes its replicas' batches, step by step.

The rules are TensorFlow 2.21's, read off what it gives for the same datasets
(``tests/test_tf_input_guide.py`` holds the cases), with ``N`` replicas in sync over ``W``
workers of ``R`` local replicas each:

- **One worker, or ``AutoShardPolicy.DATA``**: every batch is a global batch. It is cut in
  order into ``N`` pieces of ``ceil(rows / N)`` rows, the last ones smaller or empty (4 rows
  over 3 replicas: ``[0, 1], [2, 3], []``; 7 over 3: 3, 3 and 1 rows), and piece ``k`` goes to
  global replica ``k``: worker ``w`` keeps pieces ``w·R`` to ``w·R + R - 1``. One step per
  global batch, and ``strategy.gather(batch, 0)`` gives the global batch back in order. (With
  one replica per worker this is TensorFlow's assignment; with several, TensorFlow deals the
  pieces round-robin over the workers, an order its guide says not to rely on.)
- **``OFF`` and ``FILE`` with several workers**: each worker reads its own dataset (all of it
  with ``OFF``, its files with ``FILE``), batched by the *global* batch size ``G`` as with any
  other policy. The worker cuts each batch in order into the per-replica sizes
  ``batch_sizes_for_worker(G, W, R, worker)`` (a short batch fills the first of them), and its
  replicas take the pieces ``R`` at a time, so a full batch makes ``W`` steps and every step
  trains on ``G`` rows over all workers, as ``compute_average_loss(global_batch_size=G)``
  assumes. ``G`` is a ``DataLoader``'s ``batch_size``, else the first batch's size.

>>> ceil_split_sizes(4, 3), ceil_split_sizes(7, 3), ceil_split_sizes(2, 2)
([2, 2, 0], [3, 3, 1], [1, 1])
>>> [[t.tolist() for t in step] for step in own_batches_by_step([torch.arange(8)], 8, 2, 1, 0)]
[[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from torch_distribute.input.batching import batch_dim, batch_sizes_for_worker, split_batch


def ceil_split_sizes(rows: int, pieces: int) -> list[int]:
    """The sizes of ``pieces`` consecutive pieces of ``ceil(rows / pieces)`` rows (the last
    ones smaller or empty): how TensorFlow splits one global batch over the replicas."""
    chunk = -(-rows // pieces)
    return [max(0, min(chunk, rows - k * chunk)) for k in range(pieces)]


def data_shard(batch: Any, num_workers: int, replicas: int, worker_index: int) -> list[Any]:
    """This worker's ``replicas`` pieces of one global batch (DATA, or a single worker)."""
    total = num_workers * replicas
    sizes = ceil_split_sizes(batch_dim(batch), total)
    before = sum(sizes[: worker_index * replicas])
    mine = sizes[worker_index * replicas:(worker_index + 1) * replicas]
    if total == replicas:
        return split_batch(batch, mine)
    after = batch_dim(batch) - before - sum(mine)
    return split_batch(split_batch(batch, [before, sum(mine), after])[1], mine)


def fill_in_order_sizes(rows: int, cycle: list[int]) -> list[int]:
    """The sizes that cut ``rows`` rows in order by ``cycle`` (repeated as needed); the last
    size is what is left. A global batch smaller than the replicas gives empty pieces in the
    cycle (3 rows over 4 replicas: ``[1, 1, 1, 0]``); those that close a round are kept, so
    that every worker's full batch makes the same number of steps.

    >>> fill_in_order_sizes(6, [2, 2]), fill_in_order_sizes(3, [2, 2]), fill_in_order_sizes(0, [2])
    ([2, 2, 2], [2, 1], [])
    >>> fill_in_order_sizes(3, [1, 1, 1, 0]), fill_in_order_sizes(3, [1, 0, 1, 1])
    ([1, 1, 1, 0], [1, 0, 1, 1])
    """
    sizes: list[int] = []
    left = rows
    k = 0
    while left > 0:
        take = min(cycle[k % len(cycle)], left)
        sizes.append(take)
        left -= take
        k += 1
    while k % len(cycle) and cycle[k % len(cycle)] == 0:
        sizes.append(0)
        k += 1
    return sizes


def own_pieces(batches: Iterable[Any], global_batch_size: int | None, num_workers: int,
               replicas: int, worker_index: int) -> Iterator[Any]:
    """The per-replica pieces of a worker's own batches, in order (OFF and FILE across workers).

    ``global_batch_size`` ``None``: the first batch's rows.
    """
    cycle: list[int] | None = None
    for batch in batches:
        rows = batch_dim(batch)
        if cycle is None:
            size = global_batch_size if global_batch_size else rows
            cycle = batch_sizes_for_worker(size, num_workers, replicas, worker_index)
            if not any(cycle):  # a global batch smaller than the replicas: one row each at least
                cycle = [1]
        yield from split_batch(batch, fill_in_order_sizes(rows, cycle)) if rows else ()


def own_batches_by_step(batches: Iterable[Any], global_batch_size: int | None, num_workers: int,
                        replicas: int, worker_index: int) -> Iterator[list[Any]]:
    """``own_pieces`` grouped ``replicas`` at a time: one list per step (the last one may be
    shorter; the caller pads it with empty batches)."""
    step: list[Any] = []
    for piece in own_pieces(batches, global_batch_size, num_workers, replicas, worker_index):
        step.append(piece)
        if len(step) == replicas:
            yield step
            step = []
    if step:
        yield step


def steps_for_own_rows(rows_per_batch: Iterable[int], global_batch_size: int, num_workers: int,
                       replicas: int, worker_index: int) -> int:
    """How many steps ``own_batches_by_step`` makes of batches of these sizes.

    >>> steps_for_own_rows([4, 4, 2], 4, 2, 1, 0)
    5
    """
    cycle = batch_sizes_for_worker(global_batch_size, num_workers, replicas, worker_index)
    if not any(cycle):
        cycle = [1]
    pieces = sum(len(fill_in_order_sizes(rows, cycle)) for rows in rows_per_batch)
    return -(-pieces // replicas)


def loader_batch_size(dataset: Any) -> int | None:
    """A ``DataLoader``'s ``batch_size`` (the global batch size it was given), else ``None``."""
    if isinstance(dataset, torch.utils.data.DataLoader) and isinstance(dataset.batch_size, int):
        return dataset.batch_size
    return None
