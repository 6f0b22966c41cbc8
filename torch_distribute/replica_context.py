"""``ReplicaContext``: what a replica function sees of the strategy it runs under.

Strategies make one per replica and push it on the context stack for the duration of
``run``; ``td.get_replica_context()`` returns it. ``merge_call`` is the one way from replica
context back to cross-replica context; ``all_reduce`` and ``all_gather`` are built on it.

>>> import torch, torch_distribute as td
>>> ctx = td.get_replica_context()
>>> ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
(0, 1)
>>> ctx.all_reduce("sum", torch.tensor(3.0))
tensor(3.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torch_distribute import context
from torch_distribute.collectives import differentiable
from torch_distribute.eager import never_compiled
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.values import (
    DistributedValues,
    check_reducible,
    check_same_layout,
    select_replica,
)

if TYPE_CHECKING:
    from torch_distribute.reduce_op import ReduceOp


class ReplicaContext:
    """The replica context of one replica of ``strategy``.

    Strategies that run several replicas in one process subclass it and override
    ``merge_call_now`` so the replicas meet; the base runs the merge function at once (one
    local replica).
    """

    def __init__(self, strategy: context.StrategyLike, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group

    @property
    def strategy(self) -> context.StrategyLike:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id among all replicas of all workers."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def local_replica_id(self) -> int:
        """This replica's index among the replicas of this process."""
        return self._replica_id - self._strategy.extended.replica_id_offset

    @property
    def devices(self) -> tuple[Any, ...]:
        return (self._strategy.extended.worker_devices[self.local_replica_id],)

    @never_compiled
    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Per-replica arguments arrive as ``PerReplica``; ``PerReplica`` results are handed
        back to each replica as its own component. Under ``torch.compile`` it runs eagerly,
        between two graphs: it meets the other replicas.
        """
        if not isinstance(args, tuple):
            raise InvalidArgumentError(
                f"merge_call args must be a tuple, got {type(args).__name__}: "
                "write args=(x,) for a single argument."
            )
        return self.merge_call_now(merge_fn, args, kwargs or {})

    def merge_call_now(self, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``merge_call`` without argument checks: what strategies override."""
        context.push_frame(self._strategy, None)
        try:
            result = merge_fn(self._strategy, *args, **kwargs)
        finally:
            context.pop_frame()
        # This process's only replica takes its component of per-replica results.
        return select_replica(0, result)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduce ``value`` (a tensor or nest of tensors) over all replicas; differentiable.

        Raises:
            InvalidArgumentError: a leaf that is not a tensor (or Python number), or this
                process's replicas giving values of different shapes or dtypes (named with
                them), before anything is reduced.
        """
        check_reducible(value, "ReplicaContext.all_reduce")
        return differentiable.all_reduce(_CheckedMerge(self, "ReplicaContext.all_reduce", None), reduce_op, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate ``value`` from every replica along ``axis``, in replica order.

        Raises:
            InvalidArgumentError: a leaf that is not a tensor (or Python number), or this
                process's replicas giving values of different dtypes or of different shapes
                outside ``axis`` (named with them), before anything is gathered.
        """
        check_reducible(value, "ReplicaContext.all_gather")
        return differentiable.all_gather(_CheckedMerge(self, "ReplicaContext.all_gather", axis), value, axis)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class _CheckedMerge:
    """A replica context for ``collectives.differentiable`` whose merge first checks the
    replicas' values (dtypes and shapes, no data) and then lets the strategy combine them.

    It meets the other replicas in the same ``merge_call`` as the collective itself, so the
    check costs no extra synchronisation; with one local replica there is nothing to compare.
    """

    def __init__(self, replica_context: ReplicaContext, what: str, axis: int | None):
        self._context = replica_context
        self._what = what
        self._axis = axis

    @property
    def num_replicas_in_sync(self) -> int:
        return self._context.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._context.replica_id_in_sync_group

    def merge_call_now(self, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        what, axis = self._what, self._axis

        def checked(strategy: context.StrategyLike, *per_replica: Any) -> Any:
            offset = strategy.extended.replica_id_offset
            for value in per_replica:
                if isinstance(value, DistributedValues):
                    components = [torch.as_tensor(v) for v in value.values]
                    if axis is not None:
                        components = [c.unsqueeze(0) if c.dim() == 0 else c for c in components]
                    check_same_layout(components, what, axis=axis, first_replica=offset)
            return merge_fn(strategy, *per_replica)

        return self._context.merge_call_now(checked, args, kwargs)
