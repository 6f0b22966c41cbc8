"""The one-replica strategies: the default strategy and ``OneDeviceStrategy``.

``run`` calls the function directly in the calling thread: no threads, no tensor
substitution, so a step costs what the hand-written loop costs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_distribute import context
from torch_distribute.devices import DeviceLike, LogicalDevice, canonicalize
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.replicated import ReplicatedExtended
from torch_distribute.values import select_replica


class SingleReplicaExtended(ReplicatedExtended):
    """One replica on one device. ``place_state=False`` (the default strategy): nothing
    made is moved or recorded."""

    def __init__(self, strategy: Strategy, device: LogicalDevice, place_state: bool):
        super().__init__(strategy, (device,))
        self._place_state = place_state
        self._replica_context = ReplicaContext(strategy, 0)

    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return call_on_this_thread(self._replica_context, self.replica_devices[0], fn, args, kwargs)

    def capture_parameter(self, module: nn.Module, name: str, tensor: torch.Tensor, is_buffer: bool) -> torch.Tensor | None:
        return super().capture_parameter(module, name, tensor, is_buffer) if self._place_state else None


def call_on_this_thread(
    replica_context: ReplicaContext, device: torch.device, fn: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    """Run a process's only replica directly in the calling thread, on its device."""
    device_guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    context.push_frame(replica_context.strategy, replica_context)
    try:
        with device_guard:
            return fn(*select_replica(0, args), **select_replica(0, kwargs))
    finally:
        context.pop_frame()


class OneDeviceStrategy(Strategy):
    """Everything on one device: the single-device case of the same program.

    Modules made in its scope are placed on the device; datasets are moved there.

    >>> import torch, torch_distribute as td
    >>> strategy = td.OneDeviceStrategy("cpu")
    >>> with strategy.scope():
    ...     layer = torch.nn.Linear(2, 1)
    >>> strategy.num_replicas_in_sync
    1
    """

    def __init__(self, device: DeviceLike = "cpu"):
        super().__init__(SingleReplicaExtended(self, canonicalize(device), place_state=True))


class _DefaultStrategy(Strategy):
    """The strategy in force when none is: one replica, nothing moved or mirrored."""

    def __init__(self) -> None:
        super().__init__(SingleReplicaExtended(self, LogicalDevice("cpu", 0), place_state=False))

    @property
    def is_default(self) -> bool:
        return True

    def _reduce_one(self, op: Any, value: Any, axis: int | None) -> torch.Tensor:
        # Keep the value on its own device: the default strategy owns no device.
        if axis is None:
            return self.extended.local_components(value)[0]
        return super()._reduce_one(op, value, axis)


def _default_frame() -> context.Frame:
    strategy = _DefaultStrategy()
    return context.Frame(strategy, ReplicaContext(strategy, 0))


context.set_default_frame_factory(_default_frame)
