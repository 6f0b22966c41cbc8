"""The mirrored family's base: strategies that keep a copy of every captured tensor per
local replica (``OneDevice``, ``Mirrored``, ``CentralStorage``, ``MultiWorkerMirrored``).

``ReplicatedExtended`` owns the ``ReplicatedState`` (the per-replica copies) and the
in-process ``CrossDeviceOps``, and implements the parts of the strategy contract that
depend on copies: capture (a captured tensor moves to the primary device and gets copies),
``owns``, ``local_copies``, reductions over the local replicas, ``after_update`` and
``finish_scope``. Strategies outside the family (parameter servers, fully sharded) derive
from ``StrategyExtended`` directly.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     layer = torch.nn.Linear(2, 1)
>>> strategy.extended.owns(layer), len(strategy.extended.local_copies(layer.weight))
(True, 2)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from torch_distribute.collectives import CrossDeviceOps, select_cross_device_ops
from torch_distribute.collectives.arithmetic import divide
from torch_distribute.devices import LogicalDevice
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.strategies.base import Strategy
from torch_distribute.strategies.extended import StrategyExtended, first_tensor
from torch_distribute.strategies.replicated_state import ReplicatedState
from torch_distribute.values import PerReplica


class ReplicatedExtended(StrategyExtended):
    """``StrategyExtended`` with one copy of every captured tensor per local replica.

    Replica 0 computes with the user's tensor itself; a variant with another layout of the
    copies (central storage) overrides ``_new_state``. Subclasses reach the copies through
    ``self._state`` (a ``ReplicatedState``).
    """

    def __init__(
        self,
        strategy: Strategy,
        devices: tuple[LogicalDevice, ...],
        cross_device_ops: CrossDeviceOps | None = None,
    ):
        super().__init__(strategy, devices)
        if cross_device_ops is None:
            cross_device_ops = select_cross_device_ops(devices)
        cross_device_ops.validate(devices)
        self._cross_device_ops = cross_device_ops
        self._state = self._new_state(list(self.replica_devices), cross_device_ops)

    def _new_state(self, devices: list[torch.device], cross_device_ops: CrossDeviceOps) -> ReplicatedState:
        """Hook: the per-replica copies this strategy keeps (called once, by ``__init__``)."""
        return ReplicatedState(devices, cross_device_ops)

    # -- topology --------------------------------------------------------------------------
    @property
    def primary_device(self) -> torch.device:
        return self._state.primary_device

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        return self._cross_device_ops

    # -- capture ---------------------------------------------------------------------------
    def capture_parameter(
        self, module: nn.Module, name: str, tensor: torch.Tensor, is_buffer: bool
    ) -> torch.Tensor | None:
        # Running statistics change in place inside the batch-norm kernel, unseen by version
        # counters: their records watch the layer's training flag instead.
        is_running_stat = is_buffer and isinstance(module, _NormBase) and name in ("running_mean", "running_var")
        norm_layer = module if is_running_stat else None
        moved: torch.Tensor | None = None
        primary = self.primary_device
        if tensor.device != primary:
            if isinstance(tensor, nn.Parameter):
                moved = nn.Parameter(tensor.detach().to(primary), tensor.requires_grad)
            else:
                moved = tensor.to(primary)
        self._state.register(moved if moved is not None else tensor, is_buffer, norm_layer)
        return moved

    def finish_scope(self) -> None:
        self._state.sync_stale()

    @property
    def keeps_captured_tensors(self) -> bool:
        # Replicas compute with copies found by the identity of the user's tensor
        # (ReplicaTensorMode): whoever holds that tensor computes with the replica's copy.
        return True

    def _replicas_share_a_device(self) -> bool:
        """Whether some replicas share a device (CPU replicas, logical GPUs of one card): those
        can share compiled graphs."""
        devices = self.replica_devices
        return len(set(devices)) < len(devices)

    def compiling_replica_steps(self, take_turns: bool) -> None:
        # Replicas that share a device can share their compiled graphs only if replica 0 also
        # computes with a copy, not with the user's parameters (dynamo traces those as module
        # parameters: other inputs, in another order).
        if self._replicas_share_a_device():
            self._state.put_every_replica_on_copies()

    def owns(self, obj: Any) -> bool:
        tensor = first_tensor(obj)
        return tensor is not None and self._state.lookup(tensor) is not None

    def local_copies(self, obj: Any) -> tuple[Any, ...] | None:
        if isinstance(obj, torch.Tensor):
            return self._state.local_copies(obj)
        if isinstance(obj, nn.Module):
            return self._state.module_replicas(obj)
        return None

    # -- values and reductions ---------------------------------------------------------------
    def local_components(self, value: Any) -> list[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            copies = self._state.local_copies(value)
            if copies is not None:
                return list(copies)
        return super().local_components(value)

    def reduce_locally(self, components: list[torch.Tensor], destination: torch.device) -> torch.Tensor:
        return self._cross_device_ops.reduce(ReduceOp.SUM, components, destination)

    def broadcast_locally(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._cross_device_ops.broadcast(tensor, list(self.replica_devices))

    def replica_all_reduce(self, reduce_op: ReduceOp, per_replica: list[Any]) -> list[Any]:
        # All values in one packed local reduction, then one cross-worker reduction each.
        components = [self.local_components(v) for v in per_replica]
        per_replica_lists = [[c[k] for c in components] for k in range(self.num_local_replicas)]
        totals = self._cross_device_ops.batch_reduce(ReduceOp.SUM, per_replica_lists, self.primary_device)
        out = []
        for total in totals:
            total = self.reduce_across_workers(total)
            if reduce_op is ReduceOp.MEAN:
                total = divide(total, self.num_replicas_in_sync)
            out.append(PerReplica(self.broadcast_locally(total)))
        return out

    def after_update(self, var: torch.Tensor) -> None:
        record = self._state.lookup(var)
        if record is not None:
            record.mark_synced()
