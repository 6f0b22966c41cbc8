"""The replica / cross-replica context stack.

Each thread has a stack of frames. ``strategy.scope()`` pushes a cross-replica frame;
``strategy.run`` runs every replica under a replica frame; ``merge_call`` pushes a
cross-replica frame again. With nothing pushed, the default strategy and its default
replica context are current.

>>> import torch_distribute as td
>>> td.in_cross_replica_context()
False
>>> td.get_replica_context().num_replicas_in_sync
1
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch_distribute.errors import ContextError
from torch_distribute.values import select_replica

if TYPE_CHECKING:  # pragma: no cover - typing only, strategies sit in a higher layer
    from torch_distribute.strategies.base import Strategy


@dataclass(frozen=True)
class _Frame:
    strategy: Strategy
    replica_context: ReplicaContext | None  # None: cross-replica context


class _ThreadStack(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []


_stack = _ThreadStack()
_default_strategy_factory: Callable[[], Strategy] | None = None
_default_strategy: Strategy | None = None


def _set_default_strategy_factory(factory: Callable[[], Strategy]) -> None:
    """Called once by the strategies layer, which owns the default strategy class."""
    global _default_strategy_factory
    _default_strategy_factory = factory


def _get_default_strategy() -> Strategy:
    global _default_strategy
    if _default_strategy is None:
        if _default_strategy_factory is None:  # pragma: no cover - import-order bug guard
            raise RuntimeError("torch_distribute.strategies was not imported")
        _default_strategy = _default_strategy_factory()
    return _default_strategy


def push_frame(strategy: Strategy, replica_context: ReplicaContext | None) -> None:
    _stack.frames.append(_Frame(strategy, replica_context))


def pop_frame() -> None:
    _stack.frames.pop()


def current_frames() -> list[_Frame]:
    """A copy of this thread's frames (replica threads start from their caller's)."""
    return list(_stack.frames)


def set_frames(frames: list[_Frame]) -> None:
    _stack.frames = list(frames)


def get_strategy() -> Strategy:
    """The strategy in use: the one whose scope or ``run`` we are in, else the default.

    >>> import torch_distribute as td
    >>> td.get_strategy().num_replicas_in_sync
    1
    """
    if _stack.frames:
        return _stack.frames[-1].strategy
    return _get_default_strategy()


def has_strategy() -> bool:
    """True inside a (non-default) strategy's scope or replica function."""
    return bool(_stack.frames) and not _stack.frames[-1].strategy._is_default


def in_cross_replica_context() -> bool:
    """True in a strategy's scope outside ``run`` (or inside a ``merge_call``)."""
    return bool(_stack.frames) and _stack.frames[-1].replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The current replica context; ``None`` in cross-replica context.

    With no strategy, the default strategy's single replica context.
    """
    if not _stack.frames:
        return _get_default_strategy()._default_replica_context
    return _stack.frames[-1].replica_context


def get_cross_replica_context() -> Strategy | None:
    """The strategy when in cross-replica context, else ``None``."""
    if not _stack.frames:
        return None
    frame = _stack.frames[-1]
    return frame.strategy if frame.replica_context is None else None


def require_cross_replica(method: str) -> None:
    """Raise ``ContextError`` when a cross-replica-only method is called inside ``run``."""
    if _stack.frames and _stack.frames[-1].replica_context is not None:
        ctx = _stack.frames[-1].replica_context
        if ctx.num_replicas_in_sync > 1 or not ctx.strategy._is_default:
            hint = (
                "use td.get_replica_context().all_gather(value, axis)"
                if method == "gather"
                else "use td.get_replica_context().merge_call(fn) to run it in cross-replica "
                "context, or td.get_replica_context().all_reduce(...)"
            )
            raise ContextError(
                f"strategy.{method}() requires cross-replica context but was called inside "
                f"strategy.run() (replica {ctx.replica_id_in_sync_group}): {hint}."
            )


def require_replica_context(what: str) -> ReplicaContext:
    ctx = get_replica_context()
    if ctx is None:
        raise ContextError(
            f"{what} must be called inside strategy.run() (replica context), not in "
            "cross-replica context."
        )
    return ctx


class ReplicaContext:
    """What a replica function can see of the strategy it runs under.

    >>> import torch, torch_distribute as td
    >>> ctx = td.get_replica_context()
    >>> ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
    (0, 1)
    >>> ctx.all_reduce("sum", torch.tensor(3.0))
    tensor(3.)
    """

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group

    @property
    def strategy(self) -> Strategy:
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
        return self._replica_id - self._strategy.extended._replica_id_offset

    @property
    def devices(self) -> tuple[Any, ...]:
        return (self._strategy.extended.worker_devices[self.local_replica_id],)

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Per-replica arguments arrive as ``PerReplica``; ``PerReplica`` results are handed
        back to each replica as its own component.
        """
        if not isinstance(args, tuple):
            from torch_distribute.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"merge_call args must be a tuple, got {type(args).__name__}: "
                "write args=(x,) for a single argument."
            )
        return self._merge_call(merge_fn, args, kwargs or {})

    def _merge_call(self, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        push_frame(self._strategy, None)
        try:
            result = merge_fn(self._strategy, *args, **kwargs)
        finally:
            pop_frame()
        # This process's only replica takes its component of per-replica results.
        return select_replica(0, result)

    def all_reduce(self, reduce_op: Any, value: Any) -> Any:
        """Reduce ``value`` (a tensor or nest of tensors) over all replicas; differentiable."""
        from torch_distribute.replica_ops import all_reduce

        return all_reduce(self, reduce_op, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate ``value`` from every replica along ``axis``, in replica order."""
        from torch_distribute.replica_ops import all_gather

        return all_gather(self, value, axis)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )
