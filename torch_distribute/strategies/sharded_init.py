"""Sharding a model that no worker ever holds whole: its tensors replaced by stand-ins on the
meta device, the stand-ins split (tensor parallelism, then FSDP2), each worker's shards
allocated, then filled one tensor at a time from where its values come from.

``TensorSources.collect(roots)`` records where each parameter and buffer of the module trees
gets its values; ``replace_with_stand_ins()`` then puts a meta stand-in in its place (a tensor registered in two modules,
tied weights, stays one stand-in):

- a ``DeferredTensor`` (``deferred_init.py``): its recorded writes, replayed;
- a tensor with values (made before the scope, or read early): those values;
- a tensor registered on the meta device: no values; the model's ``init_weights()`` sets
  them after sharding (torchtitan's convention), on the sharded tensors.

``sync_from_chief(group)`` makes every worker's values the chief's: tensors with values are
broadcast (as before any sharding), recorded random draws start from the chief's generator
states (a few KB each, never the values). ``fill()`` then writes each worker's part:
the whole tensor is computed (on the device it was built on), this worker's shard copied
into its allocated shard, the rest dropped, so a worker's peak memory is its shards plus
the largest single tensor.

>>> import torch
>>> from torch_distribute.strategies.deferred_init import defer
>>> model = torch.nn.Linear(2, 2)
>>> model.weight = torch.nn.Parameter(defer(torch.zeros(2, 2)))
>>> sources = TensorSources.take([model])
>>> model.weight.is_meta, sources.count
(True, 2)
>>> model.to_empty(device="cpu") and sources.fill() is None
True
>>> float(model.weight.detach().abs().sum())
0.0
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torch_distribute.strategies.deferred_init import (
    has_values,
    is_deferred,
    materialize,
    random_draws,
    realized_by,
    recipe_signature,
    release_buffers,
)
from torch_distribute.values import is_dtensor

if TYPE_CHECKING:
    from torch_distribute.collectives.worker_group import WorkerGroup

__all__ = ["TensorSources", "tensors_without_values"]


@dataclass
class _Source:
    name: str  # where it first was, e.g. "blocks.0.attn.q.weight"
    value: torch.Tensor  # the DeferredTensor or the tensor with values
    places: list[tuple[nn.Module, str, bool]]  # (module, attribute, is_buffer), tied ones too

    @property
    def deferred(self) -> bool:
        return is_deferred(self.value) and realized_by(self.value) is None

    @property
    def has_values(self) -> bool:
        return not is_deferred(self.value) or has_values(self.value)

    def whole(self) -> torch.Tensor:
        """The values (for a deferred tensor: in a buffer the next call reuses)."""
        if is_deferred(self.value):
            return materialize(self.value, reuse=True)
        return self.value.detach()


class TensorSources:
    """Where each parameter and buffer of some module trees gets its values (see the module
    docstring); made by ``take``."""

    def __init__(self, sources: list[_Source]):
        self._sources = sources

    @classmethod
    def collect(cls, roots: list[nn.Module]) -> TensorSources:
        """Record every parameter and buffer of ``roots`` (nothing is changed yet)."""
        sources: dict[int, _Source] = {}
        for root in roots:
            for prefix, module in root.named_modules(remove_duplicate=False):
                named = [(False, n, t) for n, t in module.named_parameters(recurse=False, remove_duplicate=False)]
                named += [(True, n, t) for n, t in module.named_buffers(recurse=False, remove_duplicate=False)]
                for is_buffer, name, tensor in named:
                    if is_dtensor(tensor) or (tensor.is_meta and not is_deferred(tensor)):
                        continue
                    source = sources.setdefault(id(tensor), _Source(f"{prefix}.{name}" if prefix else name, tensor, []))
                    if (module, name, is_buffer) not in source.places:
                        source.places.append((module, name, is_buffer))
        return cls(list(sources.values()))

    @classmethod
    def take(cls, roots: list[nn.Module]) -> TensorSources:
        """``collect``, then ``replace_with_stand_ins``."""
        sources = cls.collect(roots)
        sources.replace_with_stand_ins()
        return sources

    def replace_with_stand_ins(self) -> None:
        """Put a meta stand-in in every recorded place (one per tensor: tied ones stay tied)."""
        for source in self._sources:
            stand_in = _stand_in(source.value, source.places[0][2])
            for module, name, _ in source.places:
                setattr(module, name, stand_in)  # a buffer stays one, persistent or not

    @property
    def count(self) -> int:
        """How many distinct tensors were taken."""
        return len(self._sources)

    def without_values(self) -> list[str]:
        """The tensors made on the meta device (their model must initialize them)."""
        return [s.name for s in self._sources if not s.has_values]

    def signature(self) -> str:
        """What was taken and how each is built (no values), as a short digest: equal on
        every worker that built the same model."""
        parts = [f"{s.name}={recipe_signature(s.value) if s.deferred else tuple(s.value.shape)}"
                 for s in self._sources]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def sync_from_chief(self, group: WorkerGroup) -> None:
        """Every worker's values become the chief's (see the module docstring)."""
        valued = [s.value.detach() for s in self._sources if not s.deferred and s.has_values]
        if valued:
            wholes = [materialize(v) if is_deferred(v) else v for v in valued]
            group.broadcast_packed_(wholes, src=0, what="initial values from the chief")
            for source, whole in zip([s for s in self._sources if not s.deferred and s.has_values], wholes,
                                     strict=True):
                source.value = whole
        draws = random_draws([s.value for s in self._sources if s.deferred])
        if draws:
            states = [d.state.clone() for d in draws]
            group.broadcast_packed_(states, src=0, what="the chief's random generator states")
            for draw, state in zip(draws, states, strict=True):
                draw.state = state

    @torch.no_grad()
    def fill(self) -> None:
        """Write every taken tensor's values into the sharded (or whole) tensor now in its
        place, one tensor at a time."""
        try:
            for source in self._sources:
                if not source.has_values:
                    continue
                module, name, _ = source.places[0]
                _write_part(getattr(module, name), source.whole())
        finally:
            release_buffers()


def tensors_without_values(roots: list[nn.Module]) -> list[str]:
    """The parameters and buffers of ``roots`` made on the meta device: nothing gives them
    values but the model's own ``init_weights()``."""
    names = []
    for root in roots:
        for name, tensor in [*root.named_parameters(), *root.named_buffers()]:
            if is_dtensor(tensor):
                continue
            if (is_deferred(tensor) and not has_values(tensor)) or (tensor.is_meta and not is_deferred(tensor)):
                names.append(name)
    return names


def _stand_in(tensor: torch.Tensor, is_buffer: bool) -> torch.Tensor:
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    if is_buffer or not isinstance(tensor, nn.Parameter):
        return meta
    return nn.Parameter(meta, requires_grad=tensor.requires_grad)


def _write_part(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this worker's part of ``whole`` into ``target`` (a DTensor's local shard, or a
    whole tensor)."""
    if not is_dtensor(target):
        target.copy_(whole)
        return
    dtensor: Any = target
    local = dtensor.to_local()
    part = _local_view(whole, dtensor.device_mesh, dtensor.placements)
    if part is None:  # placements the view below does not cover (FSDP2's strided shards)
        from torch.distributed.tensor import distribute_tensor

        part = distribute_tensor(whole.detach(), dtensor.device_mesh, dtensor.placements,
                                 src_data_rank=None).to_local()
    local.copy_(part)


def _local_view(whole: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor | None:
    """This worker's part of ``whole`` as a view (no copy), for ``Shard`` and ``Replicate``
    placements (DTensor's own split: ``torch.chunk`` along each sharded dimension, in mesh
    order); None for any other placement."""
    from torch.distributed.tensor import Replicate, Shard

    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    part = whole
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            return None
        dim = placement.dim if placement.dim >= 0 else placement.dim + whole.dim()
        chunks = torch.chunk(part, mesh.size(mesh_dim), dim=dim)
        index = coordinate[mesh_dim]
        part = chunks[index] if index < len(chunks) else part.narrow(dim, 0, 0)
    return part
