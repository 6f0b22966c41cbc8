"""How a worker's stream of batches becomes its replicas' batches, step by step.

The rules are TensorFlow 2.21's, read off what it gives for the same datasets
(``tests/test_tf_guide_distributed_input.py``, ``tests/test_tf_guides_multi_worker.py`` and
``tests/test_sharding.py`` hold the cases), with ``N`` replicas in sync over ``W``
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
  other policy. As TensorFlow's ``Dataset.rebatch(batch_sizes_for_worker(G, W, R, worker))``,
  the worker's rows are one stream, cut in order into pieces of the sizes
  ``batch_sizes_for_worker(G, W, R, worker)``, cycled: a piece may take rows of two batches
  (a short batch in the middle of the stream does not shift what follows), a size 0 is an
  empty piece, and the last piece holds what is left (no empty piece follows it). Its replicas
  take the pieces ``R`` at a time, so a full batch makes ``W`` steps and every step trains on
  ``G`` rows over all workers, as ``compute_average_loss(global_batch_size=G)`` assumes.
  ``G`` is a ``DataLoader``'s ``batch_size``, else the first batch's size.

>>> ceil_split_sizes(4, 3), ceil_split_sizes(7, 3), ceil_split_sizes(2, 2)
([2, 2, 0], [3, 3, 1], [1, 1])
>>> [[t.tolist() for t in step] for step in own_batches_by_step([torch.arange(8)], 8, 2, 1, 0)]
[[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
>>> [t.tolist() for t in own_pieces([torch.arange(3), torch.arange(10, 13)], 3, 2, 2, 0)]  # sizes 1, 1, 1, 0
[[0], [1], [2], [], [10], [11], [12], []]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from torch_distribute import nest
from torch_distribute.input.batching import (
    batch_dim,
    batch_sizes_for_worker,
    empty_like_batch,
    split_batch,
)


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


def cycle_for_worker(global_batch_size: int, num_workers: int, replicas: int, worker_index: int) -> list[int]:
    """The piece sizes a worker cycles through under OFF and FILE (``batch_sizes_for_worker``;
    a global batch smaller than the replicas: one row a piece)."""
    cycle = batch_sizes_for_worker(global_batch_size, num_workers, replicas, worker_index)
    return cycle if any(cycle) else [1]


class _RowStream:
    """The rows of consecutive batches not handed out yet, taken in pieces of any size."""

    def __init__(self, first: Any):
        self._parts: deque[tuple[Any, int]] = deque()
        self._empty = empty_like_batch(first)
        self.rows = 0

    def add(self, batch: Any, rows: int) -> None:
        if rows:
            self._parts.append((batch, rows))
            self.rows += rows

    def take(self, size: int) -> Any:
        """The next ``size`` rows (at most ``self.rows``): one batch, a slice, or a concatenation."""
        if size == 0:  # a new tensor each time: pieces are told apart by identity (step_rows)
            return empty_like_batch(self._empty)
        taken = []
        needed = size
        while needed:
            batch, rows = self._parts.popleft()
            if rows > needed:
                head, tail = split_batch(batch, [needed, rows - needed])
                self._parts.appendleft((tail, rows - needed))
                batch, rows = head, needed
            taken.append(batch)
            needed -= rows
        self.rows -= size
        if len(taken) == 1:
            return taken[0]
        flat = [nest.flatten(part) for part in taken]
        return nest.unflatten([torch.cat(leaves) for leaves in zip(*(f[0] for f in flat), strict=True)],
                              flat[0][1])


def own_pieces(batches: Iterable[Any], global_batch_size: int | None, num_workers: int,
               replicas: int, worker_index: int) -> Iterator[Any]:
    """The per-replica pieces of a worker's own batches, in order (OFF and FILE across workers):
    the stream of its rows cut by ``cycle_for_worker`` (see the module docstring).

    ``global_batch_size`` ``None``: the first batch's rows.

    >>> [t.tolist() for t in own_pieces([torch.arange(4), torch.arange(10, 13), torch.arange(20, 24)], 4, 2, 1, 0)]
    [[0, 1], [2, 3], [10, 11], [12, 20], [21, 22], [23]]
    """
    cycle: list[int] = []
    stream: _RowStream | None = None
    k = 0
    for batch in batches:
        rows = batch_dim(batch)
        if stream is None:
            cycle = cycle_for_worker(global_batch_size or rows, num_workers, replicas, worker_index)
            stream = _RowStream(batch)
        stream.add(batch, rows)
        while cycle[k % len(cycle)] <= stream.rows:  # ends: the cycle has a size above 0
            yield stream.take(cycle[k % len(cycle)])
            k += 1
    if stream is not None and stream.rows:
        yield stream.take(stream.rows)


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


def count_own_pieces(rows: int, cycle: list[int]) -> int:
    """How many pieces ``own_pieces`` cuts a stream of ``rows`` rows into with ``cycle``.

    >>> count_own_pieces(11, [2]), count_own_pieces(3, [1, 1, 1, 0]), count_own_pieces(3, [1, 0, 1, 1]), count_own_pieces(0, [2])
    (6, 4, 4, 0)
    """
    per_cycle = sum(cycle)
    full, left = divmod(rows, per_cycle)
    pieces = full * len(cycle)
    for size in cycle:  # the last, partial cycle: what the loop of own_pieces hands out
        if size > left:
            return pieces + (1 if left else 0)
        left -= size
        pieces += 1
    return pieces  # not reached: left < sum(cycle)


def steps_for_own_rows(rows_per_batch: Iterable[int], global_batch_size: int, num_workers: int,
                       replicas: int, worker_index: int) -> int:
    """How many steps ``own_batches_by_step`` makes of batches of these sizes.

    >>> steps_for_own_rows([4, 4, 2], 4, 2, 1, 0), steps_for_own_rows([3, 3, 3], 3, 2, 2, 0)
    (5, 6)
    """
    rows = list(rows_per_batch)
    if not rows:
        return 0
    cycle = cycle_for_worker(global_batch_size, num_workers, replicas, worker_index)
    return -(-count_own_pieces(sum(rows), cycle) // replicas)


def loader_batch_size(dataset: Any) -> int | None:
    """A ``DataLoader``'s ``batch_size`` (the global batch size it was given), else ``None``."""
    if isinstance(dataset, torch.utils.data.DataLoader) and isinstance(dataset.batch_size, int):
        return dataset.batch_size
    return None
