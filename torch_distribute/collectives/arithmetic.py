"""The one division every MEAN reduction uses.

Integer tensors are divided exactly, in float64 (a MEAN of integer counts is a fraction,
never a floor); floating and complex tensors keep their dtype.

>>> import torch
>>> divide(torch.tensor([3, 4]), 2)
tensor([1.5000, 2.0000], dtype=torch.float64)
>>> divide(torch.tensor([3.0]), 2)
tensor([1.5000])
"""

from __future__ import annotations

import torch


def divide(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """``tensor / count``: exact for integers (float64), same dtype for floating point."""
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor / count
    return tensor.double() / count
