"""``LayoutMap``: which mesh axis each dimension of each parameter is split over (Keras 3's
``keras.distribution.LayoutMap``), or torch's own tensor-parallel styles, by path.

Three kinds of entries, told apart by their value and key:

- ``layout_map[r"attn\\.(q|k|v)\\.weight"] = ("model", None)``: a *parameter layout*, one
  mesh axis (or ``None``: whole) per dimension of every parameter whose path (as
  ``model.named_parameters()`` spells it) the regular expression matches (``re.search``, as
  Keras does). Torch's ``nn.Linear`` stores ``weight`` as ``(out, in)``: ``("model",
  None)`` splits the output features (a *colwise* layer), ``(None, "model")`` the input
  features (*rowwise*).
- ``layout_map[r"blocks\\.\\d+\\.ln1\\.output"] = ("data", "model", None)``: an *output
  layout* (a key ending in ``.output``, Keras' ``"layer/output"``): the module's output is
  split along the dimension given the model axis, here the sequence: sequence parallelism.
- ``layout_map["blocks.*.mlp.up"] = ColwiseParallel()``: a torch ``ParallelStyle`` for the
  modules the key names, in ``parallelize_module``'s own spelling (a module path, ``*``
  matching one name): torch's plans are accepted as they are.

The strategy turns the map into a ``parallelize_module`` plan when it shards the model
(``strategies/mesh/plan.py``), and refuses what cannot work there (``LayoutError``).

>>> from torch_distribute.strategies.mesh.device_mesh import DeviceMesh
>>> layout_map = LayoutMap(DeviceMesh((2, 2), ("data", "model")))
>>> layout_map[r"mlp\\.up\\.weight"] = ("model", None)
>>> layout_map["blocks.0.mlp.up.weight"]
('model', None)
>>> layout_map["blocks.0.mlp.down.weight"] is None
True
"""

from __future__ import annotations

import re
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

from torch_distribute.errors import LayoutError
from torch_distribute.strategies.mesh.device_mesh import DeviceMesh

__all__ = ["OUTPUT_SUFFIX", "Layout", "LayoutMap", "is_parallel_style"]

#: A key ending with this names a module's output, not a parameter (Keras' ``"/output"``).
OUTPUT_SUFFIX = ".output"

#: A per-dimension layout (a mesh axis name, or ``None`` for whole), or a torch ``ParallelStyle``.
Layout = Any  # tuple[str | None, ...] or a torch ParallelStyle


def is_parallel_style(value: Any) -> bool:
    """Whether ``value`` is one of torch's tensor-parallel styles (``ColwiseParallel``...)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(value, ParallelStyle)


class LayoutMap(MutableMapping[str, Layout]):
    """A dict from path patterns to layouts on ``device_mesh`` (see the module docstring).

    Looking a path up (``layout_map[path]``) gives the entry stored under exactly that key,
    else the one whose pattern matches it (``None`` if none does; ``LayoutError`` if several
    do), as Keras' ``LayoutMap.get`` does.

    >>> from torch_distribute.strategies.mesh.device_mesh import DeviceMesh
    >>> layout_map = LayoutMap(DeviceMesh((4,), ("model",)))
    >>> layout_map["head.weight"] = ("model", None)
    >>> list(layout_map), layout_map.device_mesh.shape
    (['head.weight'], (4,))
    """

    def __init__(self, device_mesh: DeviceMesh):
        if not isinstance(device_mesh, DeviceMesh):
            raise LayoutError(f"LayoutMap needs a td.DeviceMesh, got {type(device_mesh).__name__}.")
        self._mesh = device_mesh
        self._entries: dict[str, Layout] = {}

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh whose axes the layouts name."""
        return self._mesh

    def __setitem__(self, key: str, layout: Layout) -> None:
        if not isinstance(key, str) or not key:
            raise LayoutError(f"A LayoutMap key is a non-empty path pattern (a string), got {key!r}.")
        if is_parallel_style(layout):
            self._entries[key] = layout
            return
        if isinstance(layout, str) or not isinstance(layout, Sequence):
            raise LayoutError(
                f"The layout for {key!r} must be a tuple with one mesh axis name (or None) per dimension, "
                f"e.g. ('model', None), or a torch ParallelStyle; got {layout!r}.")
        axes = tuple(layout)
        for axis in axes:
            if axis is not None and axis not in self._mesh.axis_names:
                raise LayoutError(
                    f"The layout {axes} for {key!r} names the axis {axis!r}, but the mesh's axes are "
                    f"{self._mesh.axis_names}.")
        try:
            re.compile(key)
        except re.error as error:
            raise LayoutError(f"The LayoutMap key {key!r} is not a regular expression: {error}.") from error
        self._entries[key] = axes

    def __getitem__(self, path: str) -> Layout:
        if path in self._entries:
            return self._entries[path]
        matches = [key for key in self._entries if _matches(key, path)]
        if len(matches) > 1:
            raise LayoutError(f"{path!r} matches several LayoutMap keys: {matches}; make the patterns exclusive.")
        return self._entries[matches[0]] if matches else None

    def __delitem__(self, key: str) -> None:
        del self._entries[key]

    def __contains__(self, key: object) -> bool:
        # The keys stored, not the paths a pattern matches: Mapping's default asks
        # __getitem__, which answers None (no KeyError) for a path nothing matches.
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"LayoutMap({self._mesh!r}, {self._entries!r})"


def _matches(key: str, path: str) -> bool:
    try:
        return re.search(key, path) is not None
    except re.error:
        return False
