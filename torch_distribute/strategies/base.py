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
   ``extended.capture_submodule`` for every submodule registered on a module,
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
   same for their totals; distributed datasets exchange their reports with
   ``extended.gather_input_reports`` each step.
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
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from torch_distribute import compiled_function, config, context, log, nest
from torch_distribute.eager import never_compiled
from torch_distribute.errors import ContextError, InvalidArgumentError, InvalidAxisError
from torch_distribute.input import (
    DatasetFromFunction,
    DistributedDataset,
    InputContext,
    InputOptions,
    ValueContext,
    step_rows,
)
from torch_distribute.reduce_op import ReduceOp
from torch_distribute.replica_context import ReplicaContext
from torch_distribute.strategies import interception, loss_scaling, networks, torch_patches
from torch_distribute.strategies.extended import StrategyExtended
from torch_distribute.values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    check_reducible,
    check_same_layout,
    exact_tensor,
    regroup,
)

if TYPE_CHECKING:
    from torch_distribute.cluster import ClusterResolver

__all__ = ["Strategy", "StrategyExtended", "get_replica_context", "get_strategy"]

_log = log.get_logger("strategies")


class Strategy:
    """Base class of all strategies; see ``MirroredStrategy`` for the full story.

    >>> import torch, torch_distribute as td
    >>> strategy = td.OneDeviceStrategy("cpu")
    >>> strategy.reduce("sum", strategy.run(lambda: torch.tensor(2.0)), axis=None)
    tensor(2.)
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        self._loss_scaling_check: bool | None = None
        torch_patches.strategy_created(self)
        interception.register_strategy(self)
        if not self.is_default:
            self._log_decisions()

    def _log_decisions(self) -> None:
        """INFO: what this strategy decided (devices, workers, how the cluster was found)."""
        if not _log.isEnabledFor(log.logging.INFO):
            return
        ext = self._extended
        devices = ", ".join(getattr(d, "name", str(d)) for d in ext.worker_devices)
        if tuple(ext.parameter_devices) != tuple(ext.worker_devices):
            devices += " (parameters on " + ", ".join(getattr(d, "name", str(d)) for d in ext.parameter_devices) + ")"
        ops = getattr(ext, "cross_device_ops", None)
        resolver = self.cluster_resolver
        _log.info(
            "%s: %d replica(s) in sync = %d worker(s) x %d local replica(s) on %s%s; this process "
            "is worker %d%s%s", type(self).__name__, ext.num_replicas_in_sync, ext.num_workers_in_sync,
            ext.num_local_replicas, devices,
            f" (cross-device ops: {type(ops).__name__})" if ops is not None and ext.num_local_replicas > 1 else "",
            ext.worker_index, " (the chief)" if ext.is_chief else "",
            f"; cluster found by {type(resolver).__name__}" if resolver is not None else "")

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
    def cluster_resolver(self) -> ClusterResolver | None:
        return None

    # -- checks ------------------------------------------------------------------------------
    def set_loss_scaling_check(self, enabled: bool | None) -> None:
        """Whether ``backward()`` inside this strategy's ``run`` refuses a loss averaged over
        the replica's own batch (``td.LossScalingError``); ``None`` follows
        ``td.config.set_loss_scaling_check`` (on by default). See ``docs/common-mistakes.md``.

        >>> import torch_distribute as td
        >>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> strategy.set_loss_scaling_check(False)   # a per-replica mean, knowingly
        >>> strategy.loss_scaling_check
        False
        """
        if enabled is not None and not isinstance(enabled, bool):
            raise InvalidArgumentError(f"set_loss_scaling_check takes True, False or None, got {enabled!r}.")
        self._loss_scaling_check = enabled

    @property
    def loss_scaling_check(self) -> bool:
        """Whether a loss averaged over one replica's batch is refused (see
        ``set_loss_scaling_check``)."""
        if self._loss_scaling_check is not None:
            return self._loss_scaling_check
        return config.get_loss_scaling_check()

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
        # Re-entering our own scope inside a replica function keeps the replica context. The
        # default strategy's scope keeps its single replica context (TensorFlow: inside it,
        # in_cross_replica_context() is False and get_replica_context() the default one).
        replica_context = top.replica_context if top is not None and top.strategy is self else None
        if replica_context is None and self.is_default:
            replica_context = context.default_replica_context()
        context.push_frame(self, replica_context)
        try:
            with interception.scope_listeners_entered(self):  # the Keras 3 integration, if loaded
                yield self
        finally:
            context.pop_frame()
        if replica_context is None and not any(f.strategy is self for f in context.current_frames()):
            # Leaving the scope: what was created in it now gets its replica copies and, with
            # several workers, the chief's values (as TF does when a variable is created).
            self._extended.finish_scope()

    # -- running ---------------------------------------------------------------------------
    @never_compiled  # a caller's graph ends here; the replicas' steps compile on their own
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` once per replica; return per-replica results.

        ``PerReplica`` arguments (from a distributed dataset) give each replica its own
        component. Returns a nest of ``PerReplica``: a tensor or a Python number from every
        replica is always one (even when it is one object), unless the strategy mirrored it
        (a parameter made in ``scope()``, a merge_call's result); another object that every
        replica returned (``None``, a string) is returned as it is.
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
        step = compiled_function.for_replicas(fn, self._extended.replica_devices, tuple(args), kwargs,
                                              networks=networks.of(self).networks)
        replica_fn = step.fn
        if step.compiled:
            self._extended.compiling_replica_steps(take_turns=step.take_turns)
        if self.num_replicas_in_sync > 1:
            replica_fn = loss_scaling.with_replica_inputs(replica_fn)
            replica_fn = step_rows.with_step_rows(replica_fn, step_rows.find((args, kwargs)))
        return self._extended.call_for_each_replica(replica_fn, tuple(args), kwargs or {})

    # -- reductions -------------------------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine per-replica values across all replicas (and workers).

        ``axis=None`` combines the values themselves. ``axis=k`` also reduces along
        dimension ``k``; with MEAN that is the exact mean over every element of every replica
        (the sum divided by the total count, so uneven replica batches weigh correctly).
        The result is detached: it is for reporting (``total += strategy.reduce(...)`` must
        not keep every step's graph alive); use ``ReplicaContext.all_reduce`` to differentiate.

        Raises:
            InvalidArgumentError: a leaf that is not a tensor (or Python number), or
                replicas whose values differ in dtype or shape (outside ``axis``), naming the
                replicas with their shapes and dtypes; checked before anything is combined.
            InvalidAxisError: ``axis`` out of range.
        """
        context.require_cross_replica("reduce")
        op = ReduceOp.from_value(reduce_op)
        value = _detached(value)
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise InvalidAxisError(f"reduce axis must be an int or None, got {axis!r}.")
        # Every leaf is checked before the first one is combined: a bad leaf must not leave
        # the workers with different collectives done.
        check_reducible(value, "strategy.reduce")
        for leaf in nest.leaves(value):
            self._check_components("strategy.reduce", leaf, axis)
        return nest.map_structure(lambda v: self._reduce_one(op, v, axis), value)

    def _check_components(self, what: str, leaf: object, axis: int | None, *, gather: bool = False) -> None:
        """Axis in range and the replicas' components alike (shapes and dtypes, no data)."""
        if isinstance(leaf, DistributedValues):
            components = [exact_tensor(v) for v in leaf.values]
        else:
            components = [exact_tensor(leaf)]
        if gather:
            components = [c.unsqueeze(0) if c.dim() == 0 else c for c in components]
        if axis is not None:
            for c in components:
                if c.dim() == 0:
                    raise InvalidAxisError(f"reduce axis {axis} is out of range for a scalar value; use axis=None.")
                if not -c.dim() <= axis < c.dim():
                    kind = "gather" if gather else "reduce"
                    raise InvalidAxisError(
                        f"{kind} axis {axis} is out of range for a per-replica value of shape "
                        f"{tuple(c.shape)} (valid: {-c.dim()} .. {c.dim() - 1})."
                    )
        check_same_layout(components, what, axis=axis, first_replica=self._extended.replica_id_offset)

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
            numerators.append(c.sum(dim=axis).to(extended.primary_device))
            counts.append(c.shape[axis])
        numerator = extended.reduce_across_workers(torch.stack(numerators).sum(0) * replicate)
        if op is ReduceOp.SUM:
            return numerator
        count = extended.reduce_across_workers(
            torch.tensor(sum(counts) * replicate, device=extended.primary_device)
        )
        return numerator / count

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate per-replica values along ``axis`` in replica order (cross-replica).

        Raises:
            InvalidArgumentError: a leaf that is not a tensor (or Python number), or
                replicas whose values differ in dtype or in shape outside ``axis``, naming
                the replicas with their shapes and dtypes; checked before anything moves.
            InvalidAxisError: ``axis`` out of range.
        """
        context.require_cross_replica("gather")
        value = _detached(value)
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise InvalidAxisError(f"gather axis must be an int, got {axis!r}.")
        check_reducible(value, "strategy.gather")
        for leaf in nest.leaves(value):
            self._check_components("strategy.gather", leaf, axis, gather=True)
        extended = self._extended

        def gather_one(v: Any) -> torch.Tensor:
            components = [c.unsqueeze(0) if c.dim() == 0 else c for c in extended.local_components(v)]
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
            num_workers=ext.num_input_pipelines,
            worker_index=ext.input_pipeline_id,
            options=options,
            sync_step=ext.gather_input_reports,
        )

    distribute_dataset = experimental_distribute_dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None = None) -> DatasetFromFunction:
        """Build the input pipeline with ``dataset_fn(InputContext)``: once per worker (each replica
        takes its own elements) or, with ``InputReplicationMode.PER_REPLICA``, once per replica."""
        ext = self._extended
        return DatasetFromFunction.from_function(
            dataset_fn,
            list(ext.replica_devices),
            num_workers=ext.num_input_pipelines,
            worker_index=ext.input_pipeline_id,
            replica_id_offset=ext.replica_id_offset,
            num_replicas_in_sync=self.num_replicas_in_sync,
            options=options,
            sync_step=ext.gather_input_reports,
        )

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """``value_fn(ValueContext)`` called for each local replica, regrouped as TensorFlow does:
        a nest of ``PerReplica`` leaves (a tuple of ``PerReplica`` for a function that returns a
        tuple), so that ``run(fn, args=values)`` and ``reduce(op, values)`` take it as it is.

        >>> import torch, torch_distribute as td
        >>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> ids, ones = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: (torch.tensor(ctx.replica_id_in_sync_group), torch.ones(())))
        >>> strategy.reduce("sum", ids, axis=None), strategy.experimental_local_results(ones)
        (tensor(1), (tensor(1.), tensor(1.)))
        """
        ext = self._extended
        values = []
        for k, device in enumerate(ext.replica_devices):
            value = value_fn(ValueContext(ext.replica_id_offset + k, self.num_replicas_in_sync))

            def placed(v: Any, d: Any = device) -> Any:
                return v.to(d) if isinstance(v, torch.Tensor) else v

            values.append(nest.map_structure(placed, value))
        if len(values) == 1:
            return nest.map_structure(lambda v: PerReplica((v,)), values[0])
        return regroup(values, always_wrap=True)

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


def get_strategy() -> Strategy:
    """The strategy in use: the one whose scope or ``run`` we are in, else the default.

    Typed as the ``Strategy`` it is (the layers below the strategies see it through
    ``context.StrategyLike``).

    >>> import torch_distribute as td
    >>> td.get_strategy().num_replicas_in_sync
    1
    """
    return cast(Strategy, context.get_strategy())


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``; ``None`` in cross-replica context.

    With no strategy, the default strategy's single replica context.

    >>> import torch_distribute as td
    >>> td.get_replica_context().replica_id_in_sync_group
    0
    """
    return cast("ReplicaContext | None", context.get_replica_context())
