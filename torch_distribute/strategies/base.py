"""``Strategy`` and ``StrategyExtended``: what every strategy offers.

A strategy owns a set of replica devices. Its ``scope()`` makes modules, optimizers and
metrics created inside it belong to it; ``run`` calls a step function once per replica;
``reduce``/``gather``/``experimental_local_results`` turn per-replica results into tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from torch_distribute import context, nest
from torch_distribute.collectives import CrossDeviceOps, select_cross_device_ops
from torch_distribute.devices import LogicalDevice
from torch_distribute.errors import ContextError, InvalidArgumentError, InvalidAxisError
from torch_distribute.input import (
    DatasetFromFunction,
    DistributedDataset,
    InputContext,
    InputOptions,
    ValueContext,
)
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.strategies import capture
from torch_distribute.strategies.replicated_state import ReplicatedState
from torch_distribute.values import DistributedValues, Mirrored, PerReplica, select_replica


class StrategyExtended:
    """The lower-level API of a strategy (``strategy.extended``)."""

    def __init__(
        self,
        strategy: Strategy,
        devices: tuple[LogicalDevice, ...],
        cross_device_ops: CrossDeviceOps | None = None,
        parameter_device: LogicalDevice | None = None,
    ):
        self._strategy = strategy
        self.worker_devices: tuple[LogicalDevice, ...] = devices
        self._torch_devices = [d.torch_device for d in devices]
        if cross_device_ops is None:
            cross_device_ops = select_cross_device_ops(devices)
        cross_device_ops.validate(devices)
        self._cross_device_ops = cross_device_ops
        # A separate parameter device holds the one central copy (CentralStorageStrategy);
        # otherwise replica 0's device holds the user's tensors.
        self._parameter_device = parameter_device
        self._state = ReplicatedState(
            self._torch_devices,
            cross_device_ops,
            parameter_device.torch_device if parameter_device is not None else None,
        )
        self._num_workers = 1
        self._worker_index = 0
        self._replica_id_offset = 0

    # -- topology ------------------------------------------------------------------------
    @property
    def num_local_replicas(self) -> int:
        return len(self.worker_devices)

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_workers * len(self.worker_devices)

    @property
    def parameter_devices(self) -> tuple[LogicalDevice, ...]:
        if self._parameter_device is not None:
            return (self._parameter_device,)
        return self.worker_devices

    @property
    def is_chief(self) -> bool:
        return self._worker_index == 0

    @property
    def should_checkpoint(self) -> bool:
        return self.is_chief

    @property
    def should_save_summary(self) -> bool:
        return self.is_chief

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        return self._cross_device_ops

    @property
    def _primary_device(self) -> torch.device:
        return self._state.primary_device

    # -- reductions (cross-replica) ----------------------------------------------------
    def _components(self, value: Any) -> list[torch.Tensor]:
        """One tensor per local replica for ``value`` (a distributed value or a plain one)."""
        if isinstance(value, DistributedValues):
            if len(value.values) != self.num_local_replicas:
                raise InvalidArgumentError(
                    f"This {type(value).__name__} has {len(value.values)} components but the "
                    f"strategy has {self.num_local_replicas} local replicas; use values produced "
                    "by this strategy's run() or distributed datasets."
                )
            return [torch.as_tensor(v) for v in value.values]
        copies = self._state.local_copies(value) if isinstance(value, torch.Tensor) else None
        if copies is not None:
            return list(copies)
        return [torch.as_tensor(value)] * self.num_local_replicas

    def _reduce_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM over worker processes; a single process has nothing to add."""
        return tensor

    def _gather_across_workers(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        """Concatenate over worker processes in worker order; a single process: as is."""
        return tensor

    def _any_worker_has_data(self, local_has_data: bool) -> bool:
        """Whether any replica of any worker still has input (one process: the local answer)."""
        return local_has_data

    def _all_reduce_per_replica(self, reduce_op: ReduceOp, per_replica: list[Any]) -> list[Any]:
        """All-reduce a list of values (each a ``PerReplica`` or plain); results per replica."""
        components = [self._components(v) for v in per_replica]
        per_replica_lists = [[c[k] for c in components] for k in range(self.num_local_replicas)]
        totals = self._cross_device_ops.batch_reduce(ReduceOp.SUM, per_replica_lists, self._primary_device)
        out = []
        for total in totals:
            total = self._reduce_across_workers(total)
            if reduce_op is ReduceOp.MEAN:
                total = _divide(total, self.num_replicas_in_sync)
            out.append(PerReplica(self._cross_device_ops.broadcast(total, self._torch_devices)))
        return out

    def _all_gather_per_replica(self, per_replica: list[Any], axis: int) -> tuple[list[Any], list[tuple[int, ...]]]:
        gathered, sizes = [], []
        for value in per_replica:
            components = self._components(value)
            local = torch.cat([c.to(self._primary_device) for c in components], dim=axis)
            local_sizes = torch.tensor([c.shape[axis] for c in components], dtype=torch.int64)
            total = self._gather_across_workers(local, axis)
            sizes.append(tuple(int(n) for n in self._gather_across_workers(local_sizes, 0)))
            gathered.append(PerReplica(self._cross_device_ops.broadcast(total, self._torch_devices)))
        return gathered, sizes

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> torch.Tensor:
        """Reduce a per-replica ``value`` onto ``destinations`` (a device or a tensor)."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)])[0]

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Iterable[tuple[Any, Any]]) -> list[torch.Tensor]:
        """``reduce_to`` for several (value, destination) pairs."""
        op = ReduceOp.from_value(reduce_op)
        pairs = list(value_destination_pairs)
        out = []
        for value, destination in pairs:
            if isinstance(value, Mirrored) and op is ReduceOp.MEAN:
                out.append(torch.as_tensor(value.values[0]).to(_device_of(destination, self)))
                continue
            # A plain value stands for every local replica's value at once: summing it over
            # several local replicas would count it N times. (With one local replica it is
            # that replica's value, summed across workers as TF does.)
            if not isinstance(value, DistributedValues) and op is ReduceOp.SUM and self.num_local_replicas > 1:
                if isinstance(value, (int, float)) and value == 0:
                    out.append(torch.as_tensor(value).to(_device_of(destination, self)))
                    continue
                if self._state.lookup(value) is None:
                    raise InvalidArgumentError(
                        "Cannot SUM-reduce a value that is not a distributed value (it is the same "
                        "on every replica, so the sum would count it N times). Reduce the "
                        "PerReplica value returned by strategy.run(), or use ReduceOp.MEAN."
                    )
            components = self._components(value)
            device = _device_of(destination, self)
            if len(components) == 1:  # nothing to combine locally: no packing
                total = components[0].to(device, copy=True)
            else:
                total = self._cross_device_ops.reduce(ReduceOp.SUM, components, device)
            total = self._reduce_across_workers(total)
            out.append(_divide(total, self.num_replicas_in_sync) if op is ReduceOp.MEAN else total)
        return out

    def update(self, var: torch.Tensor, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, group: bool = True) -> Any:
        """Apply ``fn(copy, *args)`` to every replica's copy of ``var`` (cross-replica context).

        ``PerReplica``/``Mirrored`` arguments are split so each copy gets its own component.
        """
        kwargs = kwargs or {}
        record = self._state.lookup(var)
        if record is not None and not self._state.replica0_is_primary:
            # Central storage: update the one central value; replicas read it afresh.
            with torch.no_grad():
                result = fn(var, *select_replica(0, args), **select_replica(0, kwargs))
            self._state.broadcast([record])
            return result if group else [result]
        copies = self._state.local_copies(var) or (var,)
        with torch.no_grad():
            results = [
                fn(replica_copy, *select_replica(k, args), **select_replica(k, kwargs))
                for k, replica_copy in enumerate(copies)
            ]
        if record is not None:
            record.mark_synced()
        if group:
            return results[0] if all(r is results[0] for r in results) else Mirrored(results)
        return results

    def value_container(self, value: Any) -> Any:
        return value

    # -- hooks the strategies implement ------------------------------------------------
    def _call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _capture_parameter(
        self, tensor: torch.Tensor, is_buffer: bool, norm_layer: nn.Module | None = None
    ) -> torch.Tensor | None:
        """Called for every parameter/buffer registered inside ``scope()``."""
        moved = None
        if tensor.device != self._primary_device:
            if isinstance(tensor, nn.Parameter):
                moved = nn.Parameter(tensor.detach().to(self._primary_device), tensor.requires_grad)
            else:
                moved = tensor.to(self._primary_device)
        self._state.register(moved if moved is not None else tensor, is_buffer, norm_layer)
        return moved

    def _capture_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called for every optimizer created inside ``scope()``."""


class Strategy:
    """Base class of all strategies; see ``MirroredStrategy`` for the full story.

    >>> import torch, torch_distribute as td
    >>> strategy = td.OneDeviceStrategy("cpu")
    >>> strategy.reduce("sum", strategy.run(lambda: torch.tensor(2.0)), axis=None)
    tensor(2.)
    """

    _is_default = False

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        capture.install()
        capture.register_strategy(self)

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        return None

    # -- scope -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Objects created inside belong to this strategy (mirrored on every replica)."""
        frames = context.current_frames()
        top = frames[-1] if frames else None
        if top is not None and top.strategy is not self and not top.strategy._is_default:
            where = "replica function" if top.replica_context is not None else "scope"
            raise ContextError(
                f"Mixing strategies: {type(self).__name__}.scope() was entered inside the {where} "
                f"of a different {type(top.strategy).__name__}. Exit the other scope first; "
                "objects belong to exactly one strategy."
            )
        # Re-entering our own scope inside a replica function keeps the replica context.
        replica_context = top.replica_context if top is not None and top.strategy is self else None
        context.push_frame(self, replica_context)
        try:
            yield self
        finally:
            context.pop_frame()
        if replica_context is None and not any(f.strategy is self for f in context.current_frames()):
            # Leaving the scope: what was created in it now gets its replica copies and, with
            # several workers, the chief's values (as TF does when a variable is created).
            self._extended._state.sync_stale()

    # -- running ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, options: Any = None) -> Any:
        """Call ``fn(*args, **kwargs)`` once per replica; return per-replica results.

        ``PerReplica`` arguments (from a distributed dataset) give each replica its own
        component. Returns a nest of ``PerReplica`` (or the plain value when every replica
        returned the very same object).
        """
        if not isinstance(args, (tuple, list)) or isinstance(args, str):
            raise InvalidArgumentError(
                f"strategy.run(fn, args=...) takes a tuple of arguments, got "
                f"{type(args).__name__}: write args=(x,) to pass a single argument."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidArgumentError(f"strategy.run kwargs must be a dict, got {type(kwargs).__name__}.")
        if not callable(fn):
            raise InvalidArgumentError(f"strategy.run needs a callable, got {type(fn).__name__}.")
        current = context.get_replica_context()
        if current is not None and context.has_strategy():
            raise ContextError(
                "strategy.run() was called inside a replica function; call the inner function "
                "directly (it already runs once per replica)."
            )
        return self._extended._call_for_each_replica(fn, tuple(args), kwargs or {})

    # -- reductions -------------------------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine per-replica values across all replicas (and workers).

        ``axis=None`` combines the values themselves. ``axis=k`` also reduces along
        dimension ``k``; with MEAN that is the exact mean over every element of every replica
        (the sum divided by the total count, so uneven replica batches weigh correctly).
        The result is detached: it is for reporting (``total += strategy.reduce(...)`` must
        not keep every step's graph alive); use ``ReplicaContext.all_reduce`` to differentiate.
        """
        context.require_cross_replica("reduce")
        op = ReduceOp.from_value(reduce_op)
        value = _detached(value)
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise InvalidAxisError(f"reduce axis must be an int or None, got {axis!r}.")
        return nest.map_structure(lambda v: self._reduce_one(op, v, axis), value)

    def _reduce_one(self, op: ReduceOp, value: Any, axis: int | None) -> torch.Tensor:
        extended = self._extended
        if axis is None:
            return extended.reduce_to(op, value, extended._primary_device)
        components = extended._components(value)
        if isinstance(value, Mirrored) or (not isinstance(value, DistributedValues) and op is ReduceOp.MEAN):
            components = components[:1]
            replicate = self.num_replicas_in_sync
        else:
            replicate = 1
        numerators, counts = [], []
        for c in components:
            if c.dim() == 0:
                raise InvalidAxisError(f"reduce axis {axis} is out of range for a scalar value; use axis=None.")
            if not -c.dim() <= axis < c.dim():
                raise InvalidAxisError(
                    f"reduce axis {axis} is out of range for a per-replica value of shape "
                    f"{tuple(c.shape)} (valid: {-c.dim()} .. {c.dim() - 1})."
                )
            numerators.append(c.sum(dim=axis).to(extended._primary_device))
            counts.append(c.shape[axis])
        if len({tuple(n.shape) for n in numerators}) > 1:
            raise InvalidArgumentError(
                "Per-replica values differ in shape outside the reduced axis: "
                f"{[tuple(c.shape) for c in components]}."
            )
        numerator = extended._reduce_across_workers(torch.stack(numerators).sum(0) * replicate)
        if op is ReduceOp.SUM:
            return numerator
        count = extended._reduce_across_workers(
            torch.tensor(sum(counts) * replicate, device=extended._primary_device)
        )
        return numerator / count

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate per-replica values along ``axis`` in replica order (cross-replica)."""
        context.require_cross_replica("gather")
        value = _detached(value)
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise InvalidAxisError(f"gather axis must be an int, got {axis!r}.")

        def gather_one(v: Any) -> torch.Tensor:
            components = [c.unsqueeze(0) if c.dim() == 0 else c for c in self._extended._components(v)]
            for c in components:
                if not -c.dim() <= axis < c.dim():
                    raise InvalidAxisError(
                        f"gather axis {axis} is out of range for a per-replica value of shape {tuple(c.shape)}."
                    )
            return self._extended._gather_across_workers(
                torch.cat([c.to(self._extended._primary_device) for c in components], dim=axis), axis
            )

        return nest.map_structure(gather_one, value)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` that live in this process, in replica order.

        For a parameter or module made in ``scope()``, each replica's copy.
        """
        if isinstance(value, DistributedValues):
            return value.values
        if isinstance(value, torch.Tensor):
            copies = self._extended._state.local_copies(value)
            if copies is not None:
                return copies
        if isinstance(value, nn.Module):
            replicas = self._extended._state.module_replicas(value)
            if replicas is not None:
                return replicas
        return (value,)

    local_results = experimental_local_results

    # -- input -------------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: InputOptions | None = None) -> DistributedDataset:
        """Split every *global* batch of ``dataset`` across the replicas."""
        ext = self._extended
        return DistributedDataset(
            dataset,
            devices=ext._torch_devices,
            num_workers=ext._num_workers,
            worker_index=ext._worker_index,
            options=options,
            sync_has_data=ext._any_worker_has_data,
        )

    distribute_dataset = experimental_distribute_dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None) -> DatasetFromFunction:
        """Build the input pipeline with ``dataset_fn(InputContext)``; each replica gets its own elements."""
        ext = self._extended
        input_context = InputContext(ext._num_workers, ext._worker_index, self.num_replicas_in_sync)
        return DatasetFromFunction(
            dataset_fn(input_context),
            devices=ext._torch_devices,
            options=options,
            sync_has_data=ext._any_worker_has_data,
        )

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``PerReplica`` of ``value_fn(ValueContext)`` called for each local replica."""
        ext = self._extended
        values = []
        for k, device in enumerate(ext._torch_devices):
            value = value_fn(ValueContext(ext._replica_id_offset + k, self.num_replicas_in_sync))
            values.append(nest.map_structure(lambda v, d=device: v.to(d) if isinstance(v, torch.Tensor) else v, value))
        return PerReplica(values)

    distribute_values_from_function = experimental_distribute_values_from_function

    def __repr__(self) -> str:
        devices = ", ".join(d.name for d in self._extended.worker_devices)
        return f"{type(self).__name__}(devices=[{devices}], num_replicas_in_sync={self.num_replicas_in_sync})"


def _device_of(destination: Any, extended: StrategyExtended) -> torch.device:
    if destination is None:
        return extended._primary_device
    if isinstance(destination, torch.Tensor):
        return destination.device
    if isinstance(destination, torch.device):
        return destination
    from torch_distribute.devices import canonicalize

    return canonicalize(destination).torch_device


def _divide(tensor: torch.Tensor, count: int) -> torch.Tensor:
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor / count
    return tensor.double() / count


def _detached(value: Any) -> Any:
    def detach(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            return type(leaf)([v.detach() if isinstance(v, torch.Tensor) else v for v in leaf.values])
        return leaf.detach() if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf

    return nest.map_structure(detach, value)
