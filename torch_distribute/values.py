"""Distributed values: one logical value with a component per replica.

``PerReplica`` holds values that differ between replicas (a loss, a batch slice);
``Mirrored`` holds values that are the same on every replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch_distribute import nest


class DistributedValues:
    """Base class of values with one component per local replica.

    >>> v = PerReplica((1, 2))
    >>> v.values
    (1, 2)
    """

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        """The components, in local replica order."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        parts = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n  {parts}\n}}"

    def __bool__(self) -> bool:
        # A distributed value has no single truth value; refusing it catches `if loss:`
        # written for one device.
        raise TypeError(
            f"The truth value of a {type(self).__name__} is ambiguous: reduce it first with "
            "strategy.reduce(...) or look at strategy.experimental_local_results(...)."
        )


class PerReplica(DistributedValues):
    """Values that may differ between replicas."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """Values that are identical on every replica."""

    __slots__ = ()


def select_replica(replica_id: int, structure: Any) -> Any:
    """The component of every ``DistributedValues`` leaf of ``structure`` for one replica."""

    def pick(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            return leaf.values[replica_id]
        return leaf

    return nest.map_structure(pick, structure)


def regroup(per_replica_results: Sequence[Any], always_wrap: bool = False) -> Any:
    """Combine one nest per replica into one nest of ``PerReplica`` leaves.

    Leaves that are the very same object on every replica stay plain (as TF does) unless
    ``always_wrap``. Different nest shapes raise ``ReplicaMismatchError``.
    """
    if len(per_replica_results) == 1:
        return per_replica_results[0]

    def combine(*leaves: Any) -> Any:
        first = leaves[0]
        if not always_wrap and all(leaf is first for leaf in leaves[1:]):
            return first
        return PerReplica(leaves)

    return nest.map_structure_up_to(list(per_replica_results), combine)
