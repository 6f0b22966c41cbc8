"""Packing many tensors into one flat buffer per dtype and device, and back; and tensors of
different lengths padded to one for a gather, and joined after it.

Every collective that moves many small tensors (in-process cross-device ops, cross-worker
broadcasts and buffer averages) packs them first, so a model costs a handful of
collectives, not one per tensor. A gather whose workers hold different lengths along an axis
(``all_gather_along``) pads each to the longest (``padded_along``) and cuts the pieces back
(``joined_along``).

>>> import torch
>>> a, b = torch.ones(2, 2), torch.zeros(3)
>>> flat = pack([a, b])
>>> flat.shape
torch.Size([7])
>>> [tuple(t.shape) for t in unpack(flat, [a, b])]
[(2, 2), (3,)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` (same dtype and device) one after the other."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, templates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``templates`` (the inverse of ``pack``)."""
    out, offset = [], 0
    for t in templates:
        n = t.numel()
        out.append(flat[offset:offset + n].view(t.shape))
        offset += n
    return out


def group_by_dtype_and_device(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in groups that can share one flat buffer, first-seen order."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def apply_packed_(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], Any]) -> None:
    """Run the in-place ``collective`` on one packed buffer per dtype and device, and write
    the results back into ``tensors``."""
    with torch.no_grad():
        for group in group_by_dtype_and_device(tensors):
            flat = pack([t.detach() for t in group])
            collective(flat)
            for t, piece in zip(group, unpack(flat, group), strict=True):
                t.copy_(piece)


def packs_by_dtype(tensors: Sequence[torch.Tensor], num_packs: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, each dtype split into at most ``num_packs``
    packs of similar size."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    packs: list[list[int]] = []
    for indices in by_dtype.values():
        total = sum(tensors[i].numel() for i in indices)
        target = max(1, -(-total // num_packs))
        current: list[int] = []
        size = 0
        for i in indices:
            current.append(i)
            size += tensors[i].numel()
            if size >= target and len(packs) < num_packs * len(by_dtype):
                packs.append(current)
                current, size = [], 0
        if current:
            packs.append(current)
    return packs


def padded_along(tensor: torch.Tensor, axis: int, length: int) -> torch.Tensor:
    """``tensor`` with zeros appended along ``axis`` up to ``length`` (contiguous)."""
    if tensor.shape[axis] < length:
        pad_shape = list(tensor.shape)
        pad_shape[axis] = length - tensor.shape[axis]
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=axis)
    return tensor.contiguous()


def joined_along(pieces: Sequence[torch.Tensor], lengths: Sequence[int], axis: int,
                 device: torch.device) -> torch.Tensor:
    """The first ``lengths[k]`` of each padded piece along ``axis``, concatenated on ``device``.

    >>> joined_along([padded_along(torch.ones(1), 0, 2), torch.zeros(2)], [1, 2], 0, torch.device("cpu")).tolist()
    [1.0, 0.0, 0.0]
    """
    return torch.cat([p.narrow(axis, 0, n).to(device) for p, n in zip(pieces, lengths, strict=True)], dim=axis)
