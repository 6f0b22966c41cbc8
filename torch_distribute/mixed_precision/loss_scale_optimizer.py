"""``LossScaleOptimizer``: TensorFlow's loss-scaling optimizer, on ``torch.amp.GradScaler``.

It wraps an optimizer and owns one ``GradScaler``. ``get_scaled_loss(loss).backward()``
then ``step()`` unscales the gradients, skips the step if any is inf or NaN, and updates the
scale. Under a strategy this is the machinery ``GradScaler`` uses inside ``run``: the check
sees the gradient summed over every replica and worker, so they all skip the same steps,
and there is one scale, updated once per step.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     model = torch.nn.Linear(4, 1)
...     optimizer = td.mixed_precision.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
>>> def step(x):
...     loss = td.compute_average_loss(model(x).squeeze(1), global_batch_size=8)
...     optimizer.get_scaled_loss(loss).backward()
...     optimizer.step()
...     optimizer.zero_grad()
>>> for x in strategy.experimental_distribute_dataset([torch.ones(8, 4)]):
...     strategy.run(step, args=(x,))
>>> optimizer.loss_scale
32768.0
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.strategies import owner_of

__all__ = ["LossScaleOptimizer"]

# Replica threads scale their losses at once; GradScaler makes its scale tensors lazily, on the
# first scale(), and two threads doing that together trip its own assertion ("_growth_tracker
# initialized before _scale"). One lock for the process: an optimizer stays picklable.
_SCALE_LOCK = threading.Lock()


class LossScaleOptimizer:
    """An optimizer that scales the loss and steps only on finite gradients.

    ``dynamic=True`` (TensorFlow's default): the scale starts at ``initial_scale``, halves on
    every step with an inf or NaN gradient (that step is skipped) and doubles after
    ``dynamic_growth_steps`` finite steps in a row. ``dynamic=False``: the scale stays at
    ``initial_scale``; steps with a non-finite gradient are still skipped, as
    ``GradScaler`` does.

    It is not a ``torch.optim.Optimizer`` subclass: attach LR schedulers to
    ``inner_optimizer``. ``param_groups``, ``state``, ``zero_grad`` and ``state_dict``
    (which includes the scale) act on it as on the inner optimizer.
    """

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
    ):
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"LossScaleOptimizer wraps a torch.optim.Optimizer, got {type(inner_optimizer).__name__}."
            )
        if not isinstance(dynamic, bool):
            raise InvalidArgumentError(f"dynamic must be True or False, got {dynamic!r}.")
        if not dynamic and dynamic_growth_steps is not None:
            raise InvalidArgumentError(
                "dynamic_growth_steps applies only to a dynamic loss scale: drop it, or pass dynamic=True."
            )
        scale = float(2**15 if initial_scale is None else initial_scale)
        if not scale > 0 or scale == float("inf"):
            raise InvalidArgumentError(f"initial_scale must be a positive finite number, got {initial_scale!r}.")
        growth_steps = 2000 if dynamic_growth_steps is None else dynamic_growth_steps
        if isinstance(growth_steps, bool) or not isinstance(growth_steps, int) or growth_steps < 1:
            raise InvalidArgumentError(f"dynamic_growth_steps must be a positive int, got {dynamic_growth_steps!r}.")
        self.inner_optimizer = inner_optimizer
        self.dynamic = dynamic
        self.initial_scale = scale
        self.dynamic_growth_steps = growth_steps if dynamic else None
        self._scaler = torch.amp.GradScaler(
            _compute_device_type(inner_optimizer), init_scale=scale, growth_interval=growth_steps,
        )

    # -- TensorFlow's API ----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self._scaler.get_scale()

    @property
    def dynamic_counter(self) -> int:
        """Finite steps since the scale last changed (0 for a fixed scale)."""
        return self._scaler.state_dict().get("_growth_tracker", 0) if self.dynamic else 0

    def get_scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale: call ``backward()`` on this."""
        with _SCALE_LOCK:
            return self._scaler.scale(loss)

    def get_unscaled_gradients(self, grads: Iterable[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``grads`` divided by the loss scale (new tensors; ``None`` stays ``None``).

        ``step()`` unscales the ``.grad`` it applies by itself: use this to inspect or log
        gradients, not before ``step()``.
        """
        scale = self.loss_scale
        return [None if g is None else g / scale for g in grads]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale the gradients, step the inner optimizer if they are finite, update the scale.

        Returns the inner step's result, or ``None`` for a skipped step.
        """
        if closure is not None:
            raise InvalidArgumentError(
                "LossScaleOptimizer.step() takes no closure: the loss must be scaled before "
                "backward(); use get_scaled_loss(loss).backward(), then step()."
            )
        result = self._scaler.step(self.inner_optimizer)
        if self.dynamic:
            self._scaler.update()
        else:
            self._scaler.update(self.initial_scale)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none)

    # -- what code written for a torch optimizer reads ---------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner_optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.inner_optimizer.state

    @property
    def learning_rate(self) -> float:
        """Keras' ``optimizer.learning_rate``: the inner optimizer's first group's ``lr``;
        assigning sets every group's."""
        return self.inner_optimizer.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise InvalidArgumentError(f"learning_rate must be a number >= 0, got {value!r}.")
        for group in self.inner_optimizer.param_groups:
            group["lr"] = float(value)

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner_optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner_optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state and the loss scale's."""
        return {"optimizer": self.inner_optimizer.state_dict(), "loss_scale": self._scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"optimizer", "loss_scale"}:
            raise InvalidArgumentError(
                "This state is not a LossScaleOptimizer's (keys 'optimizer' and 'loss_scale'); "
                "load an inner optimizer's state into inner_optimizer instead."
            )
        self.inner_optimizer.load_state_dict(state_dict["optimizer"])
        self._scaler.load_state_dict(state_dict["loss_scale"])

    @property
    def distribute_strategy(self) -> Any:
        """The strategy whose scope made the inner optimizer (``None`` outside every scope)."""
        return owner_of(self.inner_optimizer)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "fixed"
        return f"LossScaleOptimizer({self.inner_optimizer!r}, {kind} scale {self.loss_scale})"


def _compute_device_type(optimizer: torch.optim.Optimizer) -> str:
    """Where the loss is computed: the replicas' device under a strategy (not the host that
    central storage keeps the parameters on), else the parameters' device."""
    strategy = owner_of(optimizer)
    if strategy is not None:
        return strategy.extended.replica_devices[0].type
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return params[0].device.type if params else "cpu"
