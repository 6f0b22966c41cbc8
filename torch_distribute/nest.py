"""Helpers for the nests (tuples, lists, dicts) that flow through ``run`` and datasets."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.utils import _pytree as pytree

from torch_distribute.errors import ReplicaMismatchError


def flatten(structure: Any) -> tuple[list[Any], Any]:
    """Leaves of ``structure`` and a spec that rebuilds it (tuples, lists, dicts, namedtuples)."""
    return pytree.tree_flatten(structure)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    return pytree.tree_unflatten(leaves, spec)


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """Apply ``fn`` to every leaf of ``structure`` (``None`` is a leaf, as in torch's pytree).

    The containers batches are made of are walked directly: this runs on every step, and
    the generic pytree machinery costs tens of microseconds per call.
    """
    kind = type(structure)
    if kind is tuple or kind is list:
        return kind(map_structure(fn, item) for item in structure)
    if kind is dict:
        return {key: map_structure(fn, value) for key, value in structure.items()}
    if isinstance(structure, tuple) and hasattr(kind, "_fields"):  # namedtuple
        return kind(*(map_structure(fn, item) for item in structure))
    if isinstance(structure, (list, tuple, Mapping)):  # other containers: pytree knows them
        return pytree.tree_map(fn, structure)
    return fn(structure)


def leaves(structure: Any) -> list[Any]:
    """The leaves of ``structure``, in order (fast path of ``flatten`` without the spec)."""
    out: list[Any] = []
    map_structure(out.append, structure)
    return out


def map_structure_up_to(structures: list[Any], fn: Callable[..., Any]) -> Any:
    """Zip several structures of the same shape and apply ``fn`` to each tuple of leaves.

    Raises ``ReplicaMismatchError`` naming both shapes when they differ.
    """
    flats = [flatten(s) for s in structures]
    spec0 = flats[0][1]
    for index, (_, spec) in enumerate(flats[1:], start=1):
        if spec != spec0:
            raise ReplicaMismatchError(
                "Replicas returned values of different structure: replica 0 returned "
                f"{_describe(structures[0])} but replica {index} returned "
                f"{_describe(structures[index])}. Every replica must return the same nest."
            )
    leaves = [fn(*parts) for parts in zip(*(f[0] for f in flats), strict=True)]
    return unflatten(leaves, spec0)


def _describe(structure: Any) -> str:
    if isinstance(structure, Mapping):
        return f"a dict with keys {sorted(map(str, structure))}"
    if isinstance(structure, (list, tuple)):
        return f"a {type(structure).__name__} of length {len(structure)}"
    return f"a {type(structure).__name__}"
