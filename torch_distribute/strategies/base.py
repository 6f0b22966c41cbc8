"""``Strategy`` and ``StrategyExtended``: the contract every strategy keeps.

A strategy owns a set of replica devices, in one process or across worker processes. The
user-facing half is ``Strategy``: ``scope()``, ``run``, ``reduce``, ``gather``,
``experimental_local_results`` and the input helpers. Everything the layers above
(losses, metrics, checkpoints, fault tolerance, Keras-style training) need from a strategy
is the public API of ``StrategyExtended`` (``strategy.extended``); nothing above reads a
private attribute. ``docs/architecture.md`` has a page on adding a strategy.

The calls a strategy receives, in the order they happen (every process of the job makes
each call, unless said otherwise):

1. ``Strategy.__init__``: the strategy finds its devices (and, across processes, its
   cluster) and builds its ``StrategyExtended``.
2. ``with strategy.scope():`` -- while user code builds modules, optimizers and
   schedulers, the interception layer (``strategies/interception.py``) calls
   ``extended.capture_parameter`` for every parameter and buffer registered on a module,
   ``extended.capture_optimizer`` for every optimizer and ``extended.capture_scheduler``
   for every LR scheduler. When the outermost scope of this strategy is left,
   ``extended.finish_scope()`` runs (replica copies are made, the chief's initial values
   are broadcast, parameter servers receive their shards).
3. ``strategy.run(fn, args)`` -> ``extended.call_for_each_replica(fn, args, kwargs)``:
   ``fn`` runs once per local replica under a ``ReplicaContext``. Inside it,
   ``optimizer.step()`` of a captured optimizer becomes
   ``extended.optimizer_step(optimizer, step, closure)`` (once per step, not once per
   replica, when ``extended.intercepts_optimizer_steps``), ``optimizer.zero_grad()``
   becomes ``extended.optimizer_zero_grad`` and ``scheduler.step()``
   ``extended.scheduler_step``. ``ReplicaContext.all_reduce``/``all_gather`` reach
   ``extended.replica_all_reduce``/``replica_all_gather`` through ``merge_call``.
4. Cross-replica: ``strategy.reduce``/``gather`` combine ``extended.local_components`` of a
   value with ``extended.reduce_across_workers``/``gather_across_workers``; metrics do the
   same for their totals; distributed datasets ask ``extended.any_worker_has_data`` each
   step.
5. Checkpoints: ``extended.should_checkpoint`` says whether this process writes;
   ``extended.checkpoint_state(obj)``/``load_checkpoint_state(obj, state)`` read and
   write the state of an object the strategy captured; fault tolerance shares per-worker
   values with ``extended.all_gather_objects`` and flags with
   ``extended.coordination_store``.

>>> import torch, torch_distribute as td
>>> strategy = td.OneDeviceStrategy("cpu")
>>> strategy.extended.num_workers_in_sync, strategy.extended.worker_index
(1, 0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from torch_distribute import context, nest
from torch_distribute.collectives.arithmetic import divide
from torch_distribute.devices import LogicalDevice, canonicalize
from torch_distribute.errors import ContextError, InvalidArgumentError, InvalidAxisError
from torch_distribute.input import (
    DatasetFromFunction,
    DistributedDataset,
    InputContext,
    InputOptions,
    ValueContext,
)
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.strategies import interception
from torch_distribute.values import DistributedValues, Mirrored, PerReplica, select_replica


class StrategyExtended:
    """The lower-level API of a strategy (``strategy.extended``): the strategy contract.

    The defaults describe one worker process whose replicas share nothing: no copies, no
    cross-worker communication. Subclasses override what their strategy changes; the
    mirrored family (``strategies/replicated.py``) adds per-replica copies.
    """

    def __init__(self, strategy: Strategy, devices: tuple[LogicalDevice, ...]):
        self._strategy = strategy
        self.worker_devices: tuple[LogicalDevice, ...] = devices
        self._replica_devices = tuple(d.torch_device for d in devices)

    # -- topology (any process, any time) -----------------------------------------------
    @property
    def replica_devices(self) -> tuple[torch.device, ...]:
        """The torch device of each local replica, in local replica order."""
        return self._replica_devices

    @property
    def primary_device(self) -> torch.device:
        """Where the user's tensors live and cross-replica results land."""
        return self._replica_devices[0]

    @property
    def parameter_devices(self) -> tuple[Any, ...]:
        return self.worker_devices

    @property
    def num_local_replicas(self) -> int:
        return len(self.worker_devices)

    @property
    def num_workers_in_sync(self) -> int:
        """Worker processes whose replicas train in lockstep (1 in one process)."""
        return 1

    @property
    def worker_index(self) -> int:
        """This process's index among ``num_workers_in_sync`` (0 in one process)."""
        return 0

    @property
    def replica_id_offset(self) -> int:
        """``replica_id_in_sync_group`` of this process's first local replica."""
        return self.worker_index * self.num_local_replicas

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers_in_sync * self.num_local_replicas

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints (every process takes part in saving)."""
        return self.is_chief

    @property
    def should_save_summary(self) -> bool:
        return self.is_chief

    # -- 1-2. scope and capture (cross-replica context, every process) --------------------
    def capture_parameter(
        self, module: nn.Module, name: str, tensor: torch.Tensor, is_buffer: bool
    ) -> torch.Tensor | None:
        """``tensor`` was registered as ``module.<name>`` (a parameter or a buffer) inside
        ``scope()``.

        Return a replacement tensor to register instead (e.g. moved to the strategy's
        device), or ``None`` to keep ``tensor``.
        """
        return None

    def capture_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer was created inside ``scope()``."""

    def capture_scheduler(self, scheduler: Any) -> None:
        """An LR scheduler was created for an optimizer this strategy captured."""

    @property
    def intercepts_optimizer_steps(self) -> bool:
        """Whether captured optimizers' ``step``/``zero_grad`` must go through
        ``optimizer_step``/``optimizer_zero_grad`` (and schedulers through
        ``scheduler_step``). False: they run untouched, at no cost."""
        return False

    def finish_scope(self) -> None:
        """The outermost ``scope()`` of this strategy was left: finish what was captured."""

    def owns(self, obj: Any) -> bool:
        """Whether ``obj`` (a tensor or a module) holds state captured by this strategy."""
        return False

    # -- 3. running ------------------------------------------------------------------------
    def call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Call ``fn`` once per local replica under its ``ReplicaContext``; regroup results."""
        raise NotImplementedError

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], closure: Callable[[], Any] | None
    ) -> Any:
        """``optimizer.step(closure)`` of a captured optimizer; ``step`` is torch's own."""
        return step(closure) if closure is not None else step()

    def optimizer_zero_grad(
        self, optimizer: torch.optim.Optimizer, zero_grad: Callable[..., Any], set_to_none: bool
    ) -> None:
        """``optimizer.zero_grad(set_to_none)`` of a captured optimizer."""
        zero_grad(set_to_none)

    def scheduler_step(self, scheduler: Any, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``scheduler.step(*args, **kwargs)``: advance once per training step."""
        replica = context.get_replica_context()
        if replica is None or replica.num_replicas_in_sync == 1:
            return step(*args, **kwargs)
        # Every replica calls scheduler.step(); it must advance once per training step.
        return replica.merge_call(lambda _strategy: step(*args, **kwargs))

    # -- 3-4. values and reductions --------------------------------------------------------
    def local_components(self, value: Any) -> list[torch.Tensor]:
        """One tensor per local replica for ``value`` (a distributed value or a plain one)."""
        if isinstance(value, DistributedValues):
            if len(value.values) != self.num_local_replicas:
                raise InvalidArgumentError(
                    f"This {type(value).__name__} has {len(value.values)} components but the "
                    f"strategy has {self.num_local_replicas} local replicas; use values produced "
                    "by this strategy's run() or distributed datasets."
                )
            return [torch.as_tensor(v) for v in value.values]
        return [torch.as_tensor(value)] * self.num_local_replicas

    def local_copies(self, obj: Any) -> tuple[Any, ...] | None:
        """Each local replica's copy of a captured tensor or module, else ``None``."""
        return None

    def reduce_locally(self, components: list[torch.Tensor], destination: torch.device) -> torch.Tensor:
        """SUM of the local replicas' components, on ``destination`` (a new tensor)."""
        total = components[0].to(destination, copy=True)
        for component in components[1:]:
            total.add_(component.to(destination))
        return total

    def broadcast_locally(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor`` on every local replica's device, in replica order."""
        return [tensor.to(device) for device in self._replica_devices]

    def reduce_across_workers(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM of ``tensor`` over worker processes (a new tensor; as is with one worker)."""
        return tensor

    def gather_across_workers(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        """Concatenation over worker processes along ``axis``, in worker order."""
        return tensor

    def any_worker_has_data(self, local_has_data: bool) -> bool:
        """Whether any replica of any worker still has input (one process: the local answer)."""
        return local_has_data

    def all_gather_objects(self, obj: Any, what: str) -> list[Any]:
        """Small picklable values from every worker, in worker order (``what`` names it in errors)."""
        return [obj]

    @property
    def coordination_store(self) -> Any | None:
        """A ``torch.distributed.Store`` every worker of the job reaches, or ``None``."""
        return None

    def replica_all_reduce(self, reduce_op: ReduceOp, per_replica: list[Any]) -> list[Any]:
        """All-reduce values (each a ``PerReplica`` or plain) over all replicas; a
        ``PerReplica`` result for each (called in a ``merge_call``)."""
        out = []
        for value in per_replica:
            total = self.reduce_across_workers(self.reduce_locally(self.local_components(value), self.primary_device))
            if reduce_op is ReduceOp.MEAN:
                total = divide(total, self.num_replicas_in_sync)
            out.append(PerReplica(self.broadcast_locally(total)))
        return out

    def replica_all_gather(self, per_replica: list[Any], axis: int) -> tuple[list[Any], list[tuple[int, ...]]]:
        """Concatenate values over all replicas along ``axis``; also every replica's size
        along ``axis`` (called in a ``merge_call``)."""
        gathered, sizes = [], []
        for value in per_replica:
            components = self.local_components(value)
            local = torch.cat([c.to(self.primary_device) for c in components], dim=axis)
            local_sizes = torch.tensor([c.shape[axis] for c in components], dtype=torch.int64)
            total = self.gather_across_workers(local, axis)
            sizes.append(tuple(int(n) for n in self.gather_across_workers(local_sizes, 0)))
            gathered.append(PerReplica(self.broadcast_locally(total)))
        return gathered, sizes

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> torch.Tensor:
        """Reduce a per-replica ``value`` onto ``destinations`` (a device or a tensor)."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)])[0]

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Iterable[tuple[Any, Any]]) -> list[torch.Tensor]:
        """``reduce_to`` for several (value, destination) pairs."""
        op = ReduceOp.from_value(reduce_op)
        out = []
        for value, destination in list(value_destination_pairs):
            device = self._device_of(destination)
            if isinstance(value, Mirrored) and op is ReduceOp.MEAN:
                out.append(torch.as_tensor(value.values[0]).to(device))
                continue
            # A plain value stands for every local replica's value at once: summing it over
            # several local replicas would count it N times. (With one local replica it is
            # that replica's value, summed across workers as TF does.)
            if not isinstance(value, DistributedValues) and op is ReduceOp.SUM and self.num_local_replicas > 1:
                if isinstance(value, (int, float)) and value == 0:
                    out.append(torch.as_tensor(value).to(device))
                    continue
                if not (isinstance(value, torch.Tensor) and self.owns(value)):
                    raise InvalidArgumentError(
                        "Cannot SUM-reduce a value that is not a distributed value (it is the same "
                        "on every replica, so the sum would count it N times). Reduce the "
                        "PerReplica value returned by strategy.run(), or use ReduceOp.MEAN."
                    )
            components = self.local_components(value)
            if len(components) == 1:  # nothing to combine locally
                total = components[0].to(device, copy=True)
            else:
                total = self.reduce_locally(components, device)
            total = self.reduce_across_workers(total)
            out.append(divide(total, self.num_replicas_in_sync) if op is ReduceOp.MEAN else total)
        return out

    def update(self, var: torch.Tensor, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, group: bool = True) -> Any:
        """Apply ``fn(copy, *args)`` to every replica's copy of ``var`` (cross-replica context).

        ``PerReplica``/``Mirrored`` arguments are split so each copy gets its own component.
        """
        kwargs = kwargs or {}
        copies = self.local_copies(var) or (var,)
        with torch.no_grad():
            results = [
                fn(replica_copy, *select_replica(k, args), **select_replica(k, kwargs))
                for k, replica_copy in enumerate(copies)
            ]
        self.after_update(var)
        if group:
            return results[0] if all(r is results[0] for r in results) else Mirrored(results)
        return results

    def after_update(self, var: torch.Tensor) -> None:
        """``update`` changed every copy of ``var`` alike: nothing to re-broadcast."""

    # -- 5. checkpoints --------------------------------------------------------------------
    def checkpoint_state(self, obj: Any) -> Any:
        """What a checkpoint saves for ``obj`` (a module, optimizer, scheduler...)."""
        return obj.state_dict()

    def load_checkpoint_state(self, obj: Any, state: Any) -> Any:
        """Restore what ``checkpoint_state`` gave, saved under any strategy or none."""
        return obj.load_state_dict(state)

    # -- helpers -------------------------------------------------------------------------------
    def _device_of(self, destination: Any) -> torch.device:
        if destination is None:
            return self.primary_device
        if isinstance(destination, torch.Tensor):
            return destination.device
        if isinstance(destination, torch.device):
            return destination
        return canonicalize(destination).torch_device


class Strategy:
    """Base class of all strategies; see ``MirroredStrategy`` for the full story.

    >>> import torch, torch_distribute as td
    >>> strategy = td.OneDeviceStrategy("cpu")
    >>> strategy.reduce("sum", strategy.run(lambda: torch.tensor(2.0)), axis=None)
    tensor(2.)
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        interception.install()
        interception.register_strategy(self)

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        return self._extended.num_replicas_in_sync

    @property
    def is_default(self) -> bool:
        """True for the default strategy (the one in force outside every scope)."""
        return False

    @property
    def cluster_resolver(self) -> Any:
        return None

    # -- scope -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Objects created inside belong to this strategy (mirrored on every replica)."""
        frames = context.current_frames()
        top = frames[-1] if frames else None
        if top is not None and top.strategy is not self and not top.strategy.is_default:
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
            self._extended.finish_scope()

    # -- running ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
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
        return self._extended.call_for_each_replica(fn, tuple(args), kwargs or {})

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
            return extended.reduce_to(op, value, extended.primary_device)
        components = extended.local_components(value)
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
            numerators.append(c.sum(dim=axis).to(extended.primary_device))
            counts.append(c.shape[axis])
        if len({tuple(n.shape) for n in numerators}) > 1:
            raise InvalidArgumentError(
                "Per-replica values differ in shape outside the reduced axis: "
                f"{[tuple(c.shape) for c in components]}."
            )
        numerator = extended.reduce_across_workers(torch.stack(numerators).sum(0) * replicate)
        if op is ReduceOp.SUM:
            return numerator
        count = extended.reduce_across_workers(
            torch.tensor(sum(counts) * replicate, device=extended.primary_device)
        )
        return numerator / count

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate per-replica values along ``axis`` in replica order (cross-replica)."""
        context.require_cross_replica("gather")
        value = _detached(value)
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise InvalidAxisError(f"gather axis must be an int, got {axis!r}.")
        extended = self._extended

        def gather_one(v: Any) -> torch.Tensor:
            components = [c.unsqueeze(0) if c.dim() == 0 else c for c in extended.local_components(v)]
            for c in components:
                if not -c.dim() <= axis < c.dim():
                    raise InvalidAxisError(
                        f"gather axis {axis} is out of range for a per-replica value of shape {tuple(c.shape)}."
                    )
            return extended.gather_across_workers(
                torch.cat([c.to(extended.primary_device) for c in components], dim=axis), axis
            )

        return nest.map_structure(gather_one, value)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` that live in this process, in replica order.

        For a parameter or module made in ``scope()``, each replica's copy.
        """
        if isinstance(value, DistributedValues):
            return value.values
        if isinstance(value, (torch.Tensor, nn.Module)):
            copies = self._extended.local_copies(value)
            if copies is not None:
                return copies
        return (value,)

    local_results = experimental_local_results

    # -- input -------------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: InputOptions | None = None) -> DistributedDataset:
        """Split every *global* batch of ``dataset`` across the replicas."""
        ext = self._extended
        return DistributedDataset(
            dataset,
            devices=list(ext.replica_devices),
            num_workers=ext.num_workers_in_sync,
            worker_index=ext.worker_index,
            options=options,
            sync_has_data=ext.any_worker_has_data,
        )

    distribute_dataset = experimental_distribute_dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None) -> DatasetFromFunction:
        """Build the input pipeline with ``dataset_fn(InputContext)``; each replica gets its own elements."""
        ext = self._extended
        input_context = InputContext(ext.num_workers_in_sync, ext.worker_index, self.num_replicas_in_sync)
        return DatasetFromFunction(
            dataset_fn(input_context),
            devices=list(ext.replica_devices),
            options=options,
            sync_has_data=ext.any_worker_has_data,
        )

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``PerReplica`` of ``value_fn(ValueContext)`` called for each local replica."""
        ext = self._extended
        values = []
        for k, device in enumerate(ext.replica_devices):
            value = value_fn(ValueContext(ext.replica_id_offset + k, self.num_replicas_in_sync))
            values.append(nest.map_structure(lambda v, d=device: v.to(d) if isinstance(v, torch.Tensor) else v, value))
        return PerReplica(values)

    distribute_values_from_function = experimental_distribute_values_from_function

    def __repr__(self) -> str:
        devices = ", ".join(d.name for d in self._extended.worker_devices)
        return f"{type(self).__name__}(devices=[{devices}], num_replicas_in_sync={self.num_replicas_in_sync})"


def _detached(value: Any) -> Any:
    def detach(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            return type(leaf)([v.detach() if isinstance(v, torch.Tensor) else v for v in leaf.values])
        return leaf.detach() if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf

    return nest.map_structure(detach, value)
