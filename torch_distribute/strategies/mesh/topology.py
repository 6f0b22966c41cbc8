"""Where one worker sits on a mesh: which replica it belongs to and whether it speaks for it.

A *replica* is one position along the batch axis: the workers that share it (its
tensor-parallel peers along the model axis) read the same batch and compute the same loss,
each with its part of the layers. ``strategy.num_replicas_in_sync`` is the number of
replicas, the batch is split among them, and in a reduction each replica's value counts
once: its first worker (position 0 on every other axis) contributes it, its peers
contribute nothing.

>>> from torch_distribute.strategies.mesh.device_mesh import DeviceMesh
>>> place = MeshPlace(DeviceMesh((2, 2), ("data", "model")), "data", worker_index=3)
>>> place.num_replicas, place.replica_index, place.speaks_for_replica
(2, 1, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch_distribute.errors import LayoutError
from torch_distribute.strategies.mesh.device_mesh import DeviceMesh
from torch_distribute.strategies.mesh.layout_map import LayoutMap

__all__ = ["MeshLayout", "MeshPlace"]


@dataclass(frozen=True)
class MeshPlace:
    """Worker ``worker_index``'s place on ``mesh``, whose batch is split over ``batch_axis``."""

    mesh: DeviceMesh
    batch_axis: str
    worker_index: int

    def __post_init__(self) -> None:
        if self.batch_axis not in self.mesh.axis_names:
            raise LayoutError(
                f"batch_dim_name {self.batch_axis!r} is not an axis of the mesh; its axes are "
                f"{self.mesh.axis_names}.")

    @property
    def num_replicas(self) -> int:
        """How many replicas (positions along the batch axis) split each global batch."""
        return self.mesh.axis_size(self.batch_axis)

    @property
    def replica_index(self) -> int:
        """This worker's replica: its position along the batch axis."""
        return self.mesh.coordinates(self.worker_index)[self.batch_axis]

    @property
    def speaks_for_replica(self) -> bool:
        """Whether this worker is its replica's first (position 0 on every other axis)."""
        here = self.mesh.coordinates(self.worker_index)
        return all(position == 0 for axis, position in here.items() if axis != self.batch_axis)

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The axes other than the batch axis."""
        return tuple(a for a in self.mesh.axis_names if a != self.batch_axis)


@dataclass(frozen=True)
class MeshLayout:
    """A strategy's mesh arguments, checked: the mesh, its layouts, the batch axis.

    >>> from torch_distribute.strategies.mesh.device_mesh import DeviceMesh
    >>> MeshLayout.resolve(DeviceMesh((2, 2), ("data", "model")), None, None).batch_axis
    'data'
    """

    mesh: DeviceMesh
    layout_map: LayoutMap | None
    batch_axis: str

    @classmethod
    def resolve(cls, mesh: DeviceMesh | None, layout_map: LayoutMap | Mapping[str, Any] | None,
                batch_dim_name: str | None) -> MeshLayout:
        """The layout the strategy's ``mesh``, ``layout_map`` and ``batch_dim_name`` describe.

        A ``LayoutMap`` brings its mesh; a plain dict (torch's ``parallelize_module`` plan,
        or per-dimension layouts) needs ``mesh``. The batch axis defaults to the mesh's first.
        """
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise LayoutError(f"mesh must be a td.DeviceMesh, got {type(mesh).__name__}.")
        if isinstance(layout_map, LayoutMap):
            if mesh is not None and mesh != layout_map.device_mesh:
                raise LayoutError(
                    f"mesh {mesh} differs from the LayoutMap's {layout_map.device_mesh}; give one mesh.")
            mesh = layout_map.device_mesh
        elif layout_map is not None:
            if not isinstance(layout_map, Mapping):
                raise LayoutError(
                    f"layout_map must be a td.LayoutMap or a dict of path -> layout, got {type(layout_map).__name__}.")
            if mesh is None:
                raise LayoutError("A layout_map given as a dict needs mesh=td.DeviceMesh(...) too.")
            entries = layout_map
            layout_map = LayoutMap(mesh)
            for key, value in entries.items():
                layout_map[key] = value
        if mesh is None:
            raise LayoutError("Give mesh=td.DeviceMesh(...) or layout_map=td.LayoutMap(mesh).")
        if batch_dim_name is not None and not isinstance(batch_dim_name, str):
            raise LayoutError(f"batch_dim_name must be a mesh axis name, got {batch_dim_name!r}.")
        batch_axis = batch_dim_name if batch_dim_name is not None else mesh.axis_names[0]
        if batch_axis not in mesh.axis_names:
            raise LayoutError(
                f"batch_dim_name {batch_axis!r} is not an axis of the mesh; its axes are {mesh.axis_names}.")
        if len(mesh.axis_names) > 2:
            raise LayoutError(
                f"The mesh {mesh.shape} has {len(mesh.axis_names)} axes; FullyShardedStrategy takes a batch "
                "axis and at most one model axis.")
        return cls(mesh, layout_map, batch_axis)

    def describe(self) -> str:
        """The mesh and the batch axis as text (compared between workers)."""
        return f"mesh {self.mesh.shape} axes {self.mesh.axis_names}, batch split over {self.batch_axis!r}"
