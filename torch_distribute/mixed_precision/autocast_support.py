"""Whether a device can autocast to a dtype, as a clear error instead of torch's warning.

Asked for a dtype a device does not support, ``torch.autocast`` warns and *disables itself*:
the model then trains in float32 while the user believes it is in float16. This check
turns that into a ``td.UnsupportedDtypeError`` naming what to use instead.

>>> import torch
>>> check_autocast("cpu", torch.bfloat16)
>>> check_autocast("cpu", torch.float64)
Traceback (most recent call last):
...
torch_distribute.errors.UnsupportedDtypeError: torch.autocast on 'cpu' cannot compute in torch.float64 ...
"""

from __future__ import annotations

import warnings

import torch

from torch_distribute.errors import UnsupportedDtypeError

__all__ = ["check_autocast"]


def check_autocast(device_type: str, dtype: torch.dtype) -> None:
    """Raise ``UnsupportedDtypeError`` unless ``torch.autocast(device_type, dtype)`` computes in ``dtype``."""
    reason = None
    if not torch.amp.is_autocast_available(device_type):
        reason = "torch has no autocast for this device type"
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                enabled = torch.autocast(device_type, dtype=dtype).fast_dtype == dtype
                enabled = enabled and not any("isabling autocast" in str(w.message) for w in caught)
            except RuntimeError as error:  # e.g. CUDA without bfloat16
                enabled, reason = False, str(error)
        if not enabled and reason is None:
            reason = "; ".join(str(w.message).replace("\n", " ") for w in caught) or "torch disables it"
    if reason is not None:
        other = "torch.bfloat16" if dtype == torch.float16 else "torch.float16"
        raise UnsupportedDtypeError(
            f"torch.autocast on {device_type!r} cannot compute in {dtype} ({reason}). Use "
            f"{other} if the device supports it, the 'float32' policy, or another device."
        )
