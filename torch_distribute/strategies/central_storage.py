"""``CentralStorageStrategy``: replicated compute, parameters kept once on one device.

Parameters, buffers and optimizer state made in ``scope()`` live once, on the parameter
device (the CPU, or the only GPU). Every compute device computes with its own copy of them;
``optimizer.step()`` inside ``run`` reduces the replicas' gradients onto the parameter device,
the user's optimizer updates the central values there, and the copies are refreshed from
them before the replicas compute again. One process, as ``MirroredStrategy``; the same step
function and the same results as one device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torch_distribute.collectives import CrossDeviceOps, ReductionToOneDevice
from torch_distribute.devices import (
    DeviceLike,
    LogicalDevice,
    canonicalize,
    canonicalize_all,
    local_devices,
)
from torch_distribute.errors import InvalidDeviceError
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.extended import StrategyExtended
from torch_distribute.strategies.mirrored import MirroredExtended
from torch_distribute.strategies.replicated_state import ReplicatedState
from torch_distribute.strategies.single_replica import SingleReplicaExtended
from torch_distribute.values import select_replica


class CentralState(ReplicatedState):
    """Per-replica copies around one central value: the user's tensor lives on
    ``parameter_device`` and every replica, replica 0 included, computes with a copy of it.

    >>> import torch
    >>> from torch_distribute.collectives import ReductionToOneDevice
    >>> state = CentralState([torch.device("cpu")], ReductionToOneDevice(), torch.device("cpu"))
    >>> weight = torch.nn.Parameter(torch.ones(2))
    >>> state.register(weight, is_buffer=False); state.sync_stale()
    >>> state.local_copies(weight)[0] is weight, list(state.replicas_on_copies)
    (False, [0])
    """

    def __init__(self, devices: list[torch.device], cross_device_ops: CrossDeviceOps, parameter_device: torch.device):
        super().__init__(devices, cross_device_ops)
        self._parameter_device = parameter_device

    @property
    def primary_device(self) -> torch.device:
        return self._parameter_device

    @property
    def replicas_on_copies(self) -> range:
        return range(self.num_replicas)


class CentralStorageExtended(MirroredExtended):
    """Mirrored replicas whose parameters have one central home on ``parameter_device``:
    its copies are a ``CentralState`` and ``update`` changes the central value.

    >>> import torch_distribute as td
    >>> extended = td.CentralStorageStrategy(["cpu:0", "cpu:1"]).extended
    >>> [d.name for d in extended.parameter_devices], extended.intercepts_optimizer_steps
    (['cpu:0'], True)
    """

    def __init__(self, strategy: Strategy, compute_devices: tuple[LogicalDevice, ...], parameter_device: LogicalDevice):
        self._parameter_device = parameter_device  # read by _new_state, called by super().__init__
        # Gradients and statistics are summed where the parameters live, as in TF.
        reduce_to_parameters = ReductionToOneDevice(reduce_to_device=parameter_device.name)
        super().__init__(strategy, compute_devices, reduce_to_parameters)

    def _new_state(self, devices: list[torch.device], cross_device_ops: CrossDeviceOps) -> ReplicatedState:
        return CentralState(devices, cross_device_ops, self._parameter_device.torch_device)

    @property
    def parameter_devices(self) -> tuple[LogicalDevice, ...]:
        return (self._parameter_device,)

    def update(self, var: torch.Tensor, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
               group: bool = True) -> Any:
        """Update the one central value of a captured ``var``; the replicas read it afresh."""
        record = self._state.lookup(var)
        if record is None:
            return super().update(var, fn, args, kwargs, group)
        with torch.no_grad():
            result = fn(var, *select_replica(0, args), **select_replica(0, kwargs or {}))
        self._state.broadcast([record])
        return result if group else [result]


class CentralStorageStrategy(Strategy):
    """Synchronous training on several local devices, with the parameters on one device.

    ``compute_devices=None`` uses every visible GPU, else the CPU. ``parameter_device=None``
    is the only compute device when there is one, else the CPU (as TensorFlow chooses).
    Optimizer state lives on the parameter device too, so it suits models whose parameters
    and optimizer state are large next to the activations. CPU compute devices
    (``["cpu:0", "cpu:1"]``) are real replicas computing concurrently, for testing without GPUs.

    >>> import torch, torch_distribute as td
    >>> strategy = td.CentralStorageStrategy(["cpu:0", "cpu:1"])
    >>> strategy.extended.parameter_devices
    (LogicalDevice(kind='cpu', index=0, physical_index=None),)
    >>> with strategy.scope():
    ...     layer = torch.nn.Linear(2, 1)
    ...     optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    >>> strategy.num_replicas_in_sync
    2
    """

    def __init__(
        self,
        compute_devices: Sequence[DeviceLike] | None = None,
        parameter_device: DeviceLike | None = None,
    ):
        compute = canonicalize_all(compute_devices) if compute_devices is not None else local_devices()
        if parameter_device is not None:
            central = canonicalize(parameter_device)
        elif len(compute) == 1:
            central = compute[0]
        else:
            central = LogicalDevice("cpu", 0)
        if central.is_cuda and compute[0].kind == "cpu":
            raise InvalidDeviceError(
                f"The parameter device {central.name} is a GPU but the compute devices "
                f"({', '.join(d.name for d in compute)}) are CPUs: keep the parameters on the CPU "
                "(parameter_device=None or 'cpu'), or compute on GPUs."
            )
        if compute == (central,):
            extended: StrategyExtended = SingleReplicaExtended(self, central, place_state=True)
        else:
            extended = CentralStorageExtended(self, compute, central)
        super().__init__(extended)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` in this process: for a parameter or module made in
        ``scope()``, the one central value (as TensorFlow's central variables have one
        component), not the replicas' compute copies.

        >>> import torch, torch_distribute as td
        >>> strategy = td.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     layer = torch.nn.Linear(2, 1)
        >>> len(strategy.experimental_local_results(layer.weight))
        1
        """
        if isinstance(value, (torch.Tensor, nn.Module)) and self.extended.local_copies(value) is not None:
            return (value,)
        return super().experimental_local_results(value)

    local_results = experimental_local_results
