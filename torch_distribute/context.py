"""The replica / cross-replica context stack, and nothing else.

Each thread has a stack of frames. ``strategy.scope()`` pushes a cross-replica frame;
``strategy.run`` runs every replica under a replica frame; ``merge_call`` pushes a
cross-replica frame again. With nothing pushed, the default strategy and its default
replica context are current. This module knows strategies and replica contexts only as the
objects the layers above push, through the Protocols ``StrategyLike``, ``ExtendedLike`` and
``ReplicaContextLike`` (the members this layer and the ones up to the replica context use);
it never imports them.

>>> import torch_distribute as td
>>> td.in_cross_replica_context()
False
>>> td.get_replica_context().num_replicas_in_sync
1
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch_distribute.errors import ContextError

if TYPE_CHECKING:
    from torch_distribute.reduce_op import ReduceOp


class ExtendedLike(Protocol):
    """What the layers below the strategies use of a ``StrategyExtended``.

    >>> import torch_distribute as td
    >>> td.get_strategy().extended.replica_id_offset
    0
    """

    @property
    def replica_id_offset(self) -> int: ...

    @property
    def worker_devices(self) -> tuple[Any, ...]: ...

    def owns(self, obj: object) -> bool: ...

    def replica_all_reduce(self, reduce_op: ReduceOp, per_replica: list[Any]) -> list[Any]: ...

    def replica_all_gather(self, per_replica: list[Any], axis: int) -> tuple[list[Any], list[tuple[int, ...]]]: ...


class StrategyLike(Protocol):
    """What the layers below the strategies use of a ``Strategy``: this module, the replica
    context, the collectives. The strategies layer pushes its ``Strategy`` objects.

    >>> import torch_distribute as td
    >>> td.get_strategy().is_default
    True
    """

    @property
    def is_default(self) -> bool: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def extended(self) -> ExtendedLike: ...

    @property
    def loss_scaling_check(self) -> bool: ...

    def scope(self) -> AbstractContextManager[Any]: ...

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any: ...

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any: ...

    def gather(self, value: Any, axis: int) -> Any: ...

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]: ...

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None) -> Iterable[Any]: ...

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any = None) -> Iterable[Any]: ...


class ReplicaContextLike(Protocol):
    """What this module and the collectives use of a ``ReplicaContext``.

    >>> import torch_distribute as td
    >>> td.get_replica_context().replica_id_in_sync_group
    0
    """

    @property
    def strategy(self) -> StrategyLike: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def replica_id_in_sync_group(self) -> int: ...

    @property
    def local_replica_id(self) -> int: ...

    @property
    def devices(self) -> tuple[Any, ...]: ...

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any: ...

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any: ...

    def all_gather(self, value: Any, axis: int) -> Any: ...


@dataclass(frozen=True)
class Frame:
    """One entry of the stack: a strategy and, inside ``run``, the replica's context."""

    strategy: StrategyLike
    replica_context: ReplicaContextLike | None  # None: cross-replica context


class _ThreadStack(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []


_stack = _ThreadStack()
_default_frame_factory: Callable[[], Frame] | None = None
_default_frame: Frame | None = None


def set_default_frame_factory(factory: Callable[[], Frame]) -> None:
    """Called once by the strategies layer, which owns the default strategy class.

    ``factory()`` returns the frame in force when nothing is pushed: the default strategy
    and its single replica context.
    """
    global _default_frame_factory
    _default_frame_factory = factory


def _get_default_frame() -> Frame:
    global _default_frame
    if _default_frame is None:
        if _default_frame_factory is None:  # pragma: no cover - import-order bug guard
            raise RuntimeError("torch_distribute.strategies was not imported")
        _default_frame = _default_frame_factory()
    return _default_frame


def default_replica_context() -> ReplicaContextLike | None:
    """The default strategy's single replica context (what is current with nothing pushed,
    and inside the default strategy's own scope, as in TensorFlow)."""
    return _get_default_frame().replica_context


def push_frame(strategy: StrategyLike, replica_context: ReplicaContextLike | None) -> None:
    _stack.frames.append(Frame(strategy, replica_context))


def pop_frame() -> None:
    _stack.frames.pop()


def current_frames() -> list[Frame]:
    """A copy of this thread's frames (replica threads start from their caller's)."""
    return list(_stack.frames)


def set_frames(frames: list[Frame]) -> None:
    _stack.frames = list(frames)


def get_strategy() -> StrategyLike:
    """The strategy in use: the one whose scope or ``run`` we are in, else the default.

    >>> import torch_distribute as td
    >>> td.get_strategy().num_replicas_in_sync
    1
    """
    if _stack.frames:
        return _stack.frames[-1].strategy
    return _get_default_frame().strategy


def has_strategy() -> bool:
    """True inside a (non-default) strategy's scope or replica function."""
    return bool(_stack.frames) and not _stack.frames[-1].strategy.is_default


def in_cross_replica_context() -> bool:
    """True in a strategy's scope outside ``run`` (or inside a ``merge_call``)."""
    return bool(_stack.frames) and _stack.frames[-1].replica_context is None


def get_replica_context() -> ReplicaContextLike | None:
    """The current ``ReplicaContext``; ``None`` in cross-replica context.

    With no strategy, the default strategy's single replica context.
    """
    if not _stack.frames:
        return _get_default_frame().replica_context
    return _stack.frames[-1].replica_context


def get_cross_replica_context() -> StrategyLike | None:
    """The strategy when in cross-replica context, else ``None``."""
    if not _stack.frames:
        return None
    frame = _stack.frames[-1]
    return frame.strategy if frame.replica_context is None else None


def require_cross_replica(method: str) -> None:
    """Raise ``ContextError`` when a cross-replica-only method is called inside ``run``."""
    if _stack.frames and _stack.frames[-1].replica_context is not None:
        ctx = _stack.frames[-1].replica_context
        if ctx.num_replicas_in_sync > 1 or not ctx.strategy.is_default:
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
