"""``DeviceMesh``: the workers of a job arranged in a grid with named axes (Keras 3's
``keras.distribution.DeviceMesh``, TensorFlow DTensor's ``Mesh``).

One worker process per device, numbered row-major: on a ``(2, 2)`` mesh with axes
``("data", "model")`` workers 0 and 1 form the first row (data position 0) and split its
model across the ``"model"`` axis, workers 2 and 3 the second row. The batch is split over
the data axis (``batch_dim_name``); parameters are split over the other axes as a
``LayoutMap`` says, and FSDP2 shards what each worker holds over the data axis too.

>>> mesh = DeviceMesh((2, 2), ("data", "model"))
>>> mesh.shape, mesh.axis_names, mesh.size
((2, 2), ('data', 'model'), 4)
>>> mesh.coordinates(3), mesh.axis_size("model")
({'data': 1, 'model': 1}, 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch_distribute.errors import LayoutError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

__all__ = ["DeviceMesh"]


class DeviceMesh:
    """A grid of the job's workers with a name for each axis.

    ``shape``: the number of workers along each axis; their product must be the number of
    workers (checked when a strategy uses the mesh). ``axis_names``: one distinct name per
    axis, e.g. ``("data", "model")``.

    >>> DeviceMesh((4,), ("data",)).shape
    (4,)
    """

    def __init__(self, shape: Sequence[int], axis_names: Sequence[str]):
        if isinstance(shape, int) or not isinstance(shape, Sequence):
            raise LayoutError(f"DeviceMesh shape must be a tuple of positive ints, got {shape!r}.")
        shape = tuple(shape)
        if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape):
            raise LayoutError(f"DeviceMesh shape must be a tuple of positive ints, got {shape!r}.")
        if isinstance(axis_names, str) or not isinstance(axis_names, Sequence):
            raise LayoutError(f"DeviceMesh axis_names must be a tuple of names, got {axis_names!r}.")
        names = tuple(axis_names)
        if len(names) != len(shape):
            raise LayoutError(
                f"DeviceMesh has {len(shape)} axes (shape {shape}) but {len(names)} axis names "
                f"{names}: give one name per axis.")
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise LayoutError(f"DeviceMesh axis names must be distinct non-empty strings, got {names}.")
        self._shape = shape
        self._names = names

    @property
    def shape(self) -> tuple[int, ...]:
        """The number of workers along each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The name of each axis, in order."""
        return self._names

    @property
    def size(self) -> int:
        """How many workers the mesh holds."""
        total = 1
        for n in self._shape:
            total *= n
        return total

    def axis_size(self, name: str) -> int:
        """How many workers lie along the axis ``name``."""
        return self._shape[self.axis_index(name)]

    def axis_index(self, name: str) -> int:
        """The position of the axis ``name``."""
        if name not in self._names:
            raise LayoutError(f"The mesh has no axis named {name!r}; its axes are {self._names}.")
        return self._names.index(name)

    def coordinates(self, worker_index: int) -> dict[str, int]:
        """Where worker ``worker_index`` sits: its position along each axis (row-major)."""
        if not 0 <= worker_index < self.size:
            raise LayoutError(f"Worker {worker_index} is not on a mesh of {self.size} workers.")
        position: dict[str, int] = {}
        rest = worker_index
        for name, n in reversed(list(zip(self._names, self._shape, strict=True))):
            position[name] = rest % n
            rest //= n
        return {name: position[name] for name in self._names}

    def check_workers(self, num_workers: int) -> None:
        """Raise ``LayoutError`` unless the mesh holds exactly ``num_workers`` workers."""
        if self.size != num_workers:
            raise LayoutError(
                f"The DeviceMesh {self._shape} holds {self.size} workers but the job has {num_workers}: "
                f"make the product of the shape {num_workers}.")

    def build(self, device_type: str) -> TorchDeviceMesh:
        """torch's ``DeviceMesh`` for this grid (every worker calls it: a collective)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self._shape, mesh_dim_names=self._names)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and (self._shape, self._names) == (other.shape, other.axis_names)

    def __hash__(self) -> int:
        return hash((self._shape, self._names))

    def __repr__(self) -> str:
        return f"DeviceMesh(shape={self._shape}, axis_names={self._names})"
