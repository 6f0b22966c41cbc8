"""Every worker reads the same global batch in a served Keras model's step.

With several workers each worker's Keras ``fit`` reads the whole global batch and computes
the forward of its own rows of it (``forward.py``); the loss and metrics then use every
worker's outputs with this worker's targets. That is right only if every worker read the
same batch: the same data, in the same order (no shuffling, or shuffling drawn from the same
seed). So every step first compares a fingerprint of the batch across workers (one small
gather), and a difference is a ``ReplicaMismatchError``, never a silently wrong gradient.

>>> import torch
>>> a = fingerprint((torch.arange(4.0), torch.tensor([1, 0, 2, 3])))
>>> b = fingerprint((torch.arange(4.0), torch.tensor([0, 1, 2, 3])))
>>> bool(torch.equal(a, b))
False
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torch_distribute import nest
from torch_distribute.errors import ReplicaMismatchError

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy

_PRIME = 65521
#: At most this many elements of each tensor are read (evenly spaced), so the check costs the
#: same for a batch of images as for a batch of labels.
SAMPLED = 1 << 16
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(batch: Any) -> torch.Tensor:
    """Exact integer sums of (up to ``SAMPLED`` evenly spaced) elements of every tensor in
    ``batch``, read as integers of their own width, plain and weighted by position (so a
    reordering changes it), with each tensor's size: shape ``(1, 3 * tensors)``."""
    parts: list[int] = []
    for leaf in nest.leaves(batch):
        if not isinstance(leaf, torch.Tensor):
            continue
        flat = leaf.detach().contiguous().reshape(-1)
        word = _WORDS.get(flat.element_size())
        data = flat.view(word) if word is not None else flat.view(torch.uint8)
        if data.numel() > SAMPLED:
            data = data[:: data.numel() // SAMPLED][:SAMPLED]
        data = data.to(torch.int64)  # sums wrap around alike on every worker
        weights = torch.arange(data.numel(), device=data.device) % _PRIME + 1
        parts += [int(data.sum()), int((data * weights).sum()), leaf.numel()]
    return torch.tensor([parts], dtype=torch.int64)


def check_same_batch(strategy: Strategy, batch: Any, what: str) -> None:
    """Raise ``ReplicaMismatchError`` unless every worker's ``batch`` is the same."""
    extended = strategy.extended
    if extended.num_workers_in_sync == 1:
        return
    mine = fingerprint(batch)
    every = extended.gather_across_workers(mine, 0)
    if every.shape[0] == extended.num_workers_in_sync and bool((every == mine).all()):
        return
    differing = [w for w in range(every.shape[0]) if not torch.equal(every[w:w + 1], every[0:1])]
    raise ReplicaMismatchError(
        f"The workers read different global batches in Keras' {what} (workers {differing} differ "
        "from worker 0). Under a strategy with several workers every worker passes the same data to "
        "fit/evaluate/predict and the library splits each global batch between them: give every "
        "worker the same arrays or dataset, with shuffle=False or the same seed on every worker "
        "(keras.utils.set_random_seed(SEED) before fit)."
    )
