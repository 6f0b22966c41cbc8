"""Where each optimizer's gradients stand between a backward and the optimizer step.

The mirrored family sums the replicas' gradients at the step, unless something needed the
global gradient earlier (``GradScaler.unscale_``, clipping: ``apply_to_global_gradients``).
``GlobalGradients`` remembers, per optimizer, how far that went, so the step neither sums
twice nor ignores what was handed to the replicas:

- ``LOCAL``: each replica holds its own part (a backward ran); nothing summed yet.
- ``SUMMED``: the sum over every replica and worker is in the primary tensors' ``.grad``
  (the replicas' parts dropped), while the function that needed it runs.
- ``SHARED``: summed, and then a copy handed to every replica, which may have changed its
  own (replica 0's is the one the step applies).

>>> import torch
>>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
>>> grads = GlobalGradients()
>>> grads.state(optimizer)
<GradientState.LOCAL: 'local'>
>>> grads.mark_summed(optimizer); grads.mark_shared(optimizer)
>>> grads.take(optimizer), grads.state(optimizer)
(<GradientState.SHARED: 'shared'>, <GradientState.LOCAL: 'local'>)
"""

from __future__ import annotations

import enum
import weakref

import torch


class GradientState(enum.Enum):
    """How far an optimizer's gradients were combined since the last backward."""

    LOCAL = "local"
    SUMMED = "summed"
    SHARED = "shared"


class GlobalGradients:
    """The ``GradientState`` of every optimizer of one strategy (``LOCAL`` unless marked)."""

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[torch.optim.Optimizer, GradientState] = (
            weakref.WeakKeyDictionary()
        )

    def state(self, optimizer: torch.optim.Optimizer) -> GradientState:
        return self._states.get(optimizer, GradientState.LOCAL)

    def is_local(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.state(optimizer) is GradientState.LOCAL

    def mark_summed(self, optimizer: torch.optim.Optimizer) -> None:
        """The sum is in the primary tensors' gradients."""
        self._states[optimizer] = GradientState.SUMMED

    def mark_shared(self, optimizer: torch.optim.Optimizer) -> None:
        """The sum was handed to every replica."""
        self._states[optimizer] = GradientState.SHARED

    def take(self, optimizer: torch.optim.Optimizer) -> GradientState:
        """The state the step finds; the step consumes it (the optimizer is ``LOCAL`` again)."""
        return self._states.pop(optimizer, GradientState.LOCAL)

    def forget(self, optimizer: torch.optim.Optimizer) -> None:
        """``zero_grad``: the optimizer's gradients are gone, whatever was combined."""
        self._states.pop(optimizer, None)

    def forget_all(self) -> None:
        """A new ``run``: its backward makes local gradients again."""
        self._states.clear()
