"""Differentiable ``all_reduce`` / ``all_gather`` for replica contexts.

Both go through ``merge_call`` so they work whatever the strategy: the strategy's
``extended`` reduces the ``PerReplica`` value, and each replica gets its own component back.
Gradients flow back through the same collective: the gradient of a SUM all-reduce is the SUM
all-reduce of the upstream gradients (MEAN likewise), so every replica must run backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from torch_distribute import nest
from torch_distribute.context import StrategyLike
from torch_distribute.errors import InvalidAxisError
from torch_distribute.reduce_op import ReduceOp


class MergingReplica(Protocol):
    """What the collectives use of a ``ReplicaContext`` (a layer above this one): its public
    ``merge_call_now`` and replica ids.

    >>> import torch_distribute as td
    >>> td.get_replica_context().num_replicas_in_sync
    1
    """

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def replica_id_in_sync_group(self) -> int: ...

    def merge_call_now(self, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...


def _merge_all_reduce(replica_ctx: MergingReplica, op: ReduceOp, tensors: tuple) -> tuple:
    def merge_fn(strategy: StrategyLike, *per_replica: Any) -> Any:
        return strategy.extended.replica_all_reduce(op, list(per_replica))

    return replica_ctx.merge_call_now(merge_fn, tensors, {})


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, replica_ctx: MergingReplica, op: ReduceOp, *tensors: torch.Tensor):
        ctx.replica_ctx = replica_ctx
        ctx.op = op
        return tuple(_merge_all_reduce(replica_ctx, op, tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        reduced = _merge_all_reduce(ctx.replica_ctx, ctx.op, grads)
        return (None, None, *reduced)


def all_reduce(replica_ctx: MergingReplica, reduce_op: ReduceOp | str, value: Any) -> Any:
    op = ReduceOp.from_value(reduce_op)
    leaves, spec = nest.flatten(value)
    tensors = [torch.as_tensor(leaf) for leaf in leaves]
    if replica_ctx.num_replicas_in_sync == 1:
        return nest.unflatten(tensors, spec)
    reduced = _AllReduce.apply(replica_ctx, op, *tensors)
    return nest.unflatten(list(reduced), spec)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, replica_ctx: MergingReplica, axis: int, *tensors: torch.Tensor):
        ctx.replica_ctx = replica_ctx
        ctx.axis = axis

        def merge_fn(strategy: StrategyLike, *per_replica: Any) -> Any:
            return strategy.extended.replica_all_gather(list(per_replica), axis)

        gathered, sizes = replica_ctx.merge_call_now(merge_fn, tensors, {})
        ctx.sizes = sizes
        return tuple(gathered)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        summed = _merge_all_reduce(ctx.replica_ctx, ReduceOp.SUM, grads)
        local = ctx.replica_ctx.replica_id_in_sync_group
        out = []
        for grad, sizes in zip(summed, ctx.sizes, strict=True):
            start = sum(sizes[:local])
            out.append(grad.narrow(ctx.axis, start, sizes[local]))
        return (None, None, *out)


def all_gather(replica_ctx: MergingReplica, value: Any, axis: int) -> Any:
    leaves, spec = nest.flatten(value)
    tensors = [torch.as_tensor(leaf) for leaf in leaves]
    for t in tensors:
        if not -t.dim() <= axis < max(t.dim(), 1):
            raise InvalidAxisError(
                f"all_gather axis {axis} is out of range for a tensor of shape {tuple(t.shape)}."
            )
    tensors = [t.unsqueeze(0) if t.dim() == 0 else t for t in tensors]
    axis = axis % tensors[0].dim() if tensors else axis
    if replica_ctx.num_replicas_in_sync == 1:
        return nest.unflatten(tensors, spec)
    gathered = _AllGather.apply(replica_ctx, axis, *tensors)
    return nest.unflatten(list(gathered), spec)
