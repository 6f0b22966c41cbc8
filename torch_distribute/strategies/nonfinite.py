"""Reporting a non-finite gradient (or loss) instead of letting it spread silently.

One NaN in one replica's batch makes that replica's loss and gradient NaN; summed across
replicas it reaches every parameter of every replica and worker at the next optimizer step,
and the job goes on, exiting 0. So the mirrored family checks the gradient it is about to
apply, the sum over every replica and worker, once per optimizer step, before the update:
one fused pass (``torch._foreach_norm(grads)``: NaN and inf survive a 2-norm; a finite value
whose square overflows is then confirmed with the max) and one flag read (under ``MultiWorkerMirroredStrategy`` the device has just been waited for anyway,
for the buckets' signatures). Only when it is not finite does more happen: each replica's
last loss (recorded at its ``backward()``) is looked at, and the workers exchange which of
their replicas had a non-finite loss, so that the report names the step, the replica(s) and
the worker(s) where it appeared.

``td.config.set_nonfinite_check``: ``"warn"`` (the default) warns once, at the first such
step; ``"raise"`` raises ``td.NonFiniteError`` before the update; ``"off"`` checks nothing.
A ``GradScaler`` or ``LossScaleOptimizer`` that skips non-finite steps is not affected
(it unscales and decides before the step; a skipped step applies nothing). Keras'
``TerminateOnNaN`` keeps its meaning in ``fit``: it sees the NaN loss at the batch's end.

>>> import torch
>>> bool(gradients_finite([torch.ones(2), torch.tensor([1.0, float("nan")])]))
False
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torch_distribute import config
from torch_distribute.errors import NonFiniteError

if TYPE_CHECKING:
    from torch_distribute.context import StrategyLike

_lock = threading.Lock()
# strategy -> {replica id: its last loss given to backward() inside run}
_last_losses: weakref.WeakKeyDictionary[object, dict[int, torch.Tensor]] = weakref.WeakKeyDictionary()


def record_loss(strategy: StrategyLike, replica_id: int, tensors: Any) -> None:
    """Remember the loss a replica gives ``backward()`` (called by the backward wrapper)."""
    if config.get_nonfinite_check() == "off":
        return
    loss = tensors[0] if isinstance(tensors, (tuple, list)) and tensors else tensors
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        with _lock:
            _last_losses.setdefault(strategy, {})[replica_id] = loss.detach()


def gradients_finite(grads: list[torch.Tensor], exact: bool = False) -> torch.Tensor:
    """One boolean tensor: whether every value of every gradient is finite (one fused pass,
    no sync). The 2-norm (``_foreach_norm``'s fast, vectorized case; NaN and inf survive it)
    can also overflow on huge finite values; ``exact=True`` uses the max instead (slower on
    CPU), to confirm a non-finite answer.

    >>> bool(gradients_finite([torch.tensor([3e38, 3e38])])), bool(gradients_finite([torch.tensor([3e38])], exact=True))
    (False, True)
    """
    if not grads:
        return torch.tensor(True)
    norms = torch._foreach_norm(grads, math.inf) if exact else torch._foreach_norm(grads)
    device = grads[0].device
    return torch.stack([n.to(device) for n in norms]).isfinite().all()


class NonFiniteMonitor:
    """One strategy's check: call ``check`` with the gradients about to be applied."""

    def __init__(self, strategy: StrategyLike):
        self._strategy = weakref.ref(strategy)
        self._reported = False

    def check(self, grads: Sequence[torch.Tensor | None], where: str,
              gather: Callable[[list[tuple[int, float]]], list[list[tuple[int, float]]]]) -> None:
        """``grads``: the global gradients of one optimizer step, before it is applied;
        ``where``: the step, for the message; ``gather``: every worker's list of
        ``(replica id, loss)`` with a non-finite loss, in worker order (a collective: every
        worker calls ``check`` alike, since every one holds the same global sum)."""
        mode = config.get_nonfinite_check()
        if mode == "off" or (self._reported and mode == "warn"):
            return
        present = [g for g in grads if g is not None]
        if bool(gradients_finite(present)) or bool(gradients_finite(present, exact=True)):
            return
        strategy = self._strategy()
        with _lock:
            losses = dict(_last_losses.get(strategy, {}))
        local = [(replica, float(loss)) for replica, loss in sorted(losses.items())
                 if not math.isfinite(float(loss))]
        per_worker = gather(local)
        message = _message(where, per_worker, strategy)
        self._reported = True
        if mode == "raise":
            raise NonFiniteError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _message(where: str, per_worker: list[list[tuple[int, float]]], strategy: StrategyLike | None) -> str:
    found = [f"replica {replica} (worker {worker}): loss {loss}"
             for worker, replicas in enumerate(per_worker) for replica, loss in replicas]
    if found:
        origin = "It appeared in the loss of " + ", ".join(found) + "."
    else:
        origin = ("Every replica's loss was finite: a backward produced inf or NaN, or the sum "
                  "over the replicas overflowed.")
    return (
        f"The gradient of {where} is not finite (inf or NaN) after summing over the "
        f"{strategy.num_replicas_in_sync} replicas: applied, it would make every parameter of "
        f"every replica non-finite. {origin} Look at that step's batch on that replica "
        "(e.g. torch.isfinite(x).all()), or lower the learning rate. "
        'td.config.set_nonfinite_check("raise") stops at the first such step, before the update; '
        '"off" checks nothing.'
    )
