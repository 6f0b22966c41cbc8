"""Keras' mixed-precision policies for ``td.keras.Model``.

A policy names the dtype a model computes in and the dtype its parameters are kept in.
``"mixed_float16"`` and ``"mixed_bfloat16"`` compute the forward pass under
``torch.autocast`` and keep the parameters, the loss and the metrics in float32; under
``"mixed_float16"`` ``compile`` wraps the optimizer in a ``LossScaleOptimizer`` (dynamic
loss scaling), as Keras does. A model takes the global policy when it is made, or its own
``dtype=``; calling it (in ``fit`` or in a custom loop) computes under the policy.

>>> import torch, torch_distribute as td
>>> td.keras.mixed_precision.set_global_policy("mixed_bfloat16")
>>> policy = td.keras.mixed_precision.global_policy()
>>> policy.compute_dtype, policy.variable_dtype
('bfloat16', 'float32')
>>> td.keras.mixed_precision.set_global_policy("float32")
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from torch_distribute import nest
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.mixed_precision import LossScaleOptimizer

__all__ = ["LossScaleOptimizer", "Policy", "call_under_policy", "global_policy", "set_global_policy"]

_COMPUTE_DTYPES = {"float32": torch.float32, "mixed_float16": torch.float16, "mixed_bfloat16": torch.bfloat16}


class Policy:
    """A dtype policy: ``"float32"``, ``"mixed_float16"`` or ``"mixed_bfloat16"``.

    ``compute_dtype`` and ``variable_dtype`` are dtype names, as in Keras;
    ``autocast_dtype`` is the ``torch.dtype`` to autocast to (``None`` for float32).
    """

    def __init__(self, name: str | Policy):
        if isinstance(name, Policy):
            name = name.name
        if name not in _COMPUTE_DTYPES:
            hint = ""
            if name in ("float16", "bfloat16", "float64"):
                hint = (f" A pure {name} policy (parameters in {name} too) is not supported: convert "
                        f"the module with module.to(torch.{name}) before wrapping it, or use a mixed policy.")
            raise InvalidArgumentError(
                f"Unknown dtype policy {name!r}: use one of {sorted(_COMPUTE_DTYPES)}.{hint}"
            )
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @property
    def compute_dtype(self) -> str:
        return str(_COMPUTE_DTYPES[self._name]).removeprefix("torch.")

    @property
    def variable_dtype(self) -> str:
        return "float32"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward pass autocasts to, ``None`` when it computes in float32."""
        dtype = _COMPUTE_DTYPES[self._name]
        return None if dtype == torch.float32 else dtype

    @property
    def needs_loss_scaling(self) -> bool:
        """Whether gradients risk underflowing (float16) and the loss should be scaled."""
        return self.autocast_dtype == torch.float16

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'


_lock = threading.Lock()
_global = Policy("float32")


def set_global_policy(policy: Policy | str | None) -> None:
    """Set the policy models made from now on take (``None``: back to ``"float32"``)."""
    global _global
    with _lock:
        _global = Policy("float32" if policy is None else policy)


def global_policy() -> Policy:
    """The policy a model made now takes."""
    return _global


def call_under_policy(policy: Policy, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` under ``torch.autocast`` to the policy's compute dtype (on the
    device of the first tensor argument), with floating outputs cast back to float32."""
    dtype = policy.autocast_dtype
    if dtype is None:
        return call(*args, **kwargs)
    first = next((t for t in nest.flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
    with torch.autocast(first.device.type if first is not None else "cpu", dtype=dtype):
        outputs = call(*args, **kwargs)
    return nest.map_structure(_to_float32, outputs)


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.float()
    return value
