"""Distributed values: one logical value with a component per replica.

``PerReplica`` holds values that differ between replicas (a loss, a batch slice);
``Mirrored`` holds values that are the same on every replica.

``check_reducible`` and ``check_same_layout`` are the checks every reduction and gather
makes on its input before any data moves (``Strategy.reduce``/``gather``,
``ReplicaContext.all_reduce``/``all_gather``, the in-process cross-device ops): only types,
shapes and dtypes are compared, never data.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_distribute import nest
from torch_distribute.errors import InvalidArgumentError


class DistributedValues:
    """Base class of values with one component per local replica.

    >>> v = PerReplica((1, 2))
    >>> v.values
    (1, 2)
    """

    __slots__ = ("_values", "__weakref__")

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


def regroup(
    per_replica_results: Sequence[Any],
    always_wrap: bool = False,
    mirrored: Callable[[Any], bool] | None = None,
) -> Any:
    """Combine one nest per replica into one nest of ``PerReplica`` leaves.

    A tensor or a Python number from each replica is a ``PerReplica``, even when every
    replica returned the very same object (CPython caches small ints: two replicas'
    ``x.shape[0]`` may be one object or two, which must not change the result), unless
    ``mirrored(leaf)`` says that the strategy itself mirrored it (a captured parameter, a
    merge_call's result handed to every replica). Any other leaf that is the same object on
    every replica (``None``, a module, a string) stays plain, as TF does, unless
    ``always_wrap``. Different nest shapes raise ``ReplicaMismatchError``.

    >>> regroup([(1, None), (1, None)])
    (PerReplica:{
      0: 1,
      1: 1
    }, None)
    """
    if len(per_replica_results) == 1:
        return per_replica_results[0]

    def combine(*leaves: Any) -> Any:
        first = leaves[0]
        if not always_wrap and all(leaf is first for leaf in leaves[1:]):
            if not is_tensor_like(first) or (mirrored is not None and mirrored(first)):
                return first
        return PerReplica(leaves)

    return nest.map_structure_up_to(list(per_replica_results), combine)


def exact_tensor(leaf: object) -> torch.Tensor:
    """``leaf`` as a tensor, Python numbers exactly (``int`` and ``bool`` as int64, ``float``
    as float64, ``complex`` as complex128), so that sums and means of them are exact.

    >>> exact_tensor(3).dtype, exact_tensor(0.1).dtype, exact_tensor(True).item()
    (torch.int64, torch.float64, 1)
    """
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, (bool, int)):
        return torch.tensor(int(leaf), dtype=torch.int64)
    if isinstance(leaf, float):
        return torch.tensor(leaf, dtype=torch.float64)
    if isinstance(leaf, complex):
        return torch.tensor(leaf, dtype=torch.complex128)
    return torch.as_tensor(leaf)


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor, a tensor sharded over workers (none exists until
    ``torch.distributed.tensor`` is imported, which is left to those who shard: about 1 s of
    CPU).

    >>> is_dtensor(torch.ones(2))
    False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


# -- checks on what is reduced or gathered ---------------------------------------------------

#: Python scalars a reduction accepts besides tensors (and NumPy arrays and scalars).
_PYTHON_NUMBERS = (bool, int, float, complex)


def is_tensor_like(leaf: object) -> bool:
    """Whether ``leaf`` can be reduced: a tensor, a Python number, a NumPy array or scalar.

    >>> is_tensor_like(torch.ones(2)), is_tensor_like(3.0), is_tensor_like("3"), is_tensor_like(None)
    (True, True, False, False)
    """
    if isinstance(leaf, (torch.Tensor, *_PYTHON_NUMBERS)):
        return True
    return type(leaf).__module__ == "numpy" and hasattr(leaf, "dtype")


def _shown(leaf: object) -> str:
    text = repr(leaf)
    return text if len(text) <= 60 else text[:57] + "..."


def check_reducible(value: object, what: str) -> None:
    """Raise ``InvalidArgumentError`` unless every leaf of ``value`` (and every component of
    each ``PerReplica``/``Mirrored`` leaf) is a tensor, a Python number or a NumPy array.

    ``what`` names the call in the message (``"strategy.reduce"``).

    >>> check_reducible({"loss": torch.ones(()), "n": 3}, "strategy.reduce")
    >>> check_reducible(PerReplica((torch.ones(2), "x")), "strategy.reduce")
    Traceback (most recent call last):
    ...
    torch_distribute.errors.InvalidArgumentError: strategy.reduce got a PerReplica whose replica 1 is 'x' (type str); it combines tensors (or Python numbers), or nests of them such as the PerReplica values strategy.run() returns.
    """
    hint = ("it combines tensors (or Python numbers), or nests of them such as the PerReplica "
            "values strategy.run() returns.")
    for leaf in nest.leaves(value):
        if isinstance(leaf, DistributedValues):
            for k, component in enumerate(leaf.values):
                if not is_tensor_like(component):
                    raise InvalidArgumentError(
                        f"{what} got a {type(leaf).__name__} whose replica {k} is "
                        f"{_shown(component)} (type {type(component).__name__}); {hint}"
                    )
        elif not is_tensor_like(leaf):
            where = "" if leaf is value else f" in {_shown(value)}"
            raise InvalidArgumentError(
                f"{what} got {_shown(leaf)} (type {type(leaf).__name__}){where}; {hint}"
            )


def _layout(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def check_same_layout(
    components: Sequence[torch.Tensor],
    what: str,
    *,
    axis: int | None = None,
    first_replica: int = 0,
) -> None:
    """Raise ``InvalidArgumentError`` unless the replicas' components of one value can be
    combined: the same dtype, and the same shape (``axis=None``: reduce) or the same shape
    outside ``axis`` (gather, or reduce along ``axis``; ``axis`` must be in range).

    The message names every replica (``first_replica + k``) with its shape and dtype.

    >>> check_same_layout([torch.ones(2, 3), torch.ones(4, 3)], "strategy.gather", axis=0)
    >>> check_same_layout([torch.ones(2, 3), torch.ones(2, 4)], "strategy.gather", axis=0)
    Traceback (most recent call last):
    ...
    torch_distribute.errors.InvalidArgumentError: strategy.gather: the replicas' values differ in shape outside axis 0 (replica 0: (2, 3) float32, replica 1: (2, 4) float32). Every replica must give the same shape except along axis 0.
    """
    if len(components) < 2:
        return
    first = components[0]

    def listing() -> str:
        return ", ".join(f"replica {first_replica + k}: {_layout(c)}" for k, c in enumerate(components))

    if any(c.dtype != first.dtype for c in components[1:]):
        raise InvalidArgumentError(
            f"{what}: the replicas' values have different dtypes ({listing()}). Every replica "
            "must give the same dtype: cast them (e.g. .float()) before combining them."
        )
    if axis is None:
        if any(c.shape != first.shape for c in components[1:]):
            raise InvalidArgumentError(
                f"{what}: the replicas' values differ in shape ({listing()}). Every replica must "
                "give the same shape; for per-example values of different lengths reduce with "
                "axis=0 or use gather."
            )
        return

    def off_axis(tensor: torch.Tensor) -> tuple[int, ...] | None:
        dims = tensor.dim()
        if not -dims <= axis < dims:
            return None
        shape = list(tensor.shape)
        del shape[axis % dims]
        return (dims, *shape)

    if len({off_axis(c) for c in components}) > 1:
        raise InvalidArgumentError(
            f"{what}: the replicas' values differ in shape outside axis {axis} ({listing()}). "
            f"Every replica must give the same shape except along axis {axis}."
        )
