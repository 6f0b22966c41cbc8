"""Loss scaling for synchronous training: divide by the *global* batch, sum across replicas.

Gradients are SUMMED across replicas, so each replica's loss must be its share of the mean
over the global batch: ``sum(per_example_loss) / global_batch_size``. Then the summed
gradient is exactly the gradient of the mean loss over the whole global batch, as on one
device.

Always pass ``global_batch_size``. Without it the global batch is guessed as
``local_batch × num_replicas``, which is wrong on a ragged last batch (7 examples over 2
replicas: one replica has 4, the other 3; neither 4×2 nor 3×2 is 7) and on empty replicas.
A call without it that gets fewer rows than an earlier call from the same line of the
program (under the same strategy) warns once, naming the number to pass.
"""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from typing import Any

import torch

from torch_distribute import context
from torch_distribute.errors import ContextError, InvalidArgumentError


def _require_replica_context(name: str) -> context.ReplicaContextLike:
    if context.in_cross_replica_context():
        raise ContextError(
            f"td.{name}() was called in cross-replica context; call it inside the function "
            "given to strategy.run() (replica context)."
        )
    replica = context.get_replica_context()
    assert replica is not None
    return replica


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """``sum(per_example_loss * sample_weight) / global_batch_size`` (0 when it is 0).

    >>> import torch, torch_distribute as td
    >>> td.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
    tensor(1.)
    """
    replica = _require_replica_context("compute_average_loss")
    loss = torch.as_tensor(per_example_loss)
    if loss.dim() == 0:
        raise InvalidArgumentError(
            "compute_average_loss expects per-example losses (a tensor with a batch dimension), "
            "got a scalar: compute the loss with reduction='none'."
        )
    if sample_weight is not None:
        loss = loss * _align_weight(torch.as_tensor(sample_weight, dtype=loss.dtype, device=loss.device), loss)
    if global_batch_size is None:
        global_batch_size = loss.shape[0] * replica.num_replicas_in_sync
        if not torch.compiler.is_compiling():
            _GUESSES.record(replica, loss.shape[0], inspect.currentframe())
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        if isinstance(global_batch_size, torch.Tensor) and global_batch_size.dim() == 0 and not global_batch_size.is_floating_point():
            global_batch_size = int(global_batch_size)
        else:
            raise InvalidArgumentError(
                f"global_batch_size must be an int, got {type(global_batch_size).__name__}."
            )
    if global_batch_size < 0:
        raise InvalidArgumentError(f"global_batch_size must be >= 0, got {global_batch_size}.")
    total = loss.sum()
    if global_batch_size == 0:
        return total * 0.0
    return total / global_batch_size


class _GuessedBatchSizes:
    """The most rows a call of ``compute_average_loss`` without ``global_batch_size`` got,
    per strategy and per calling line; a call with fewer warns once for that line."""

    _WARNED = -1  # in place of a line's largest batch once it warned

    def __init__(self) -> None:
        self._largest: weakref.WeakKeyDictionary[Any, dict[tuple[str, int], int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def record(self, replica: context.ReplicaContextLike, rows: int, frame: Any) -> None:
        """``frame``: ``compute_average_loss``'s own; the line that called it is the site."""
        caller = frame.f_back if frame is not None else None
        if caller is None:
            return
        site = (caller.f_code.co_filename, caller.f_lineno)
        with self._lock:
            try:
                per_site = self._largest.setdefault(replica.strategy, {})
            except TypeError:  # a strategy that cannot be weakly referenced: not tracked
                return
            largest = per_site.get(site, 0)
            if largest == self._WARNED or rows >= largest:
                if largest != self._WARNED:
                    per_site[site] = rows
                return
            per_site[site] = self._WARNED
        replicas = replica.num_replicas_in_sync
        warnings.warn(
            f"td.compute_average_loss() without global_batch_size got {rows} rows on replica "
            f"{replica.replica_id_in_sync_group}, fewer than the {largest} of an earlier batch "
            f"({site[0]}:{site[1]}): the global batch is guessed as rows × replicas = "
            f"{rows} × {replicas} = {rows * replicas}, so the examples of this smaller (last) batch "
            f"weigh more than the others and the gradient differs from one device's. Pass the "
            f"dataset's global batch size: compute_average_loss(..., global_batch_size="
            f"{largest * replicas}) ({largest} rows × {replicas} replicas).",
            UserWarning,
            stacklevel=3,
        )


_GUESSES = _GuessedBatchSizes()


def _align_weight(weight: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """Squeeze or expand trailing dims of ``weight`` to the loss's rank (as TF does)."""
    while weight.dim() > loss.dim() and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    while 0 < weight.dim() < loss.dim():
        weight = weight.unsqueeze(-1)
    if weight.dim() > loss.dim():
        raise InvalidArgumentError(
            f"sample_weight of shape {tuple(weight.shape)} does not fit per-example losses of "
            f"shape {tuple(loss.shape)}."
        )
    return weight


def scale_regularization_loss(regularization_loss: torch.Tensor | list[torch.Tensor] | Any) -> torch.Tensor:
    """``sum(regularization_loss) / num_replicas_in_sync``: counted once after the SUM.

    >>> import torch, torch_distribute as td
    >>> td.scale_regularization_loss([torch.tensor(1.0), torch.tensor(2.0)])
    tensor(3.)
    """
    replica = _require_replica_context("scale_regularization_loss")
    if isinstance(regularization_loss, (list, tuple)):
        if not regularization_loss:
            return torch.tensor(0.0)
        total = torch.stack([torch.as_tensor(x).sum() for x in regularization_loss]).sum()
    else:
        total = torch.as_tensor(regularization_loss).sum()
    return total / replica.num_replicas_in_sync
