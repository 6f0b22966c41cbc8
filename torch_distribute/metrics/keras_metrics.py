"""The Keras-named sync-on-read metrics: ``Mean``, ``Sum``, the accuracies and the errors.

Each one is a ``Metric`` (see ``base``): one state slot per local replica, updated inside
``strategy.run`` without communication, summed across replicas and workers by ``result()``.
Weights broadcast to the values and ranks are aligned as in Keras.

>>> import torch_distribute as td
>>> acc = td.metrics.Accuracy()
>>> acc.update_state([1, 2, 3, 4], [0, 2, 3, 4])
>>> acc.result()
tensor(0.7500)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.metrics.base import Metric, acc_dtype, as_tensor, is_empty_batch

__all__ = [
    "Accuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "SparseCategoricalAccuracy",
    "Sum",
]


def _align_ranks(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Squeeze a trailing size-1 dim from whichever input has one extra (Keras' rule)."""
    if y_pred.dim() == y_true.dim() + 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred.squeeze(-1)
    elif y_true.dim() == y_pred.dim() + 1 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    if y_true.shape != y_pred.shape:
        raise InvalidArgumentError(
            f"y_true of shape {tuple(y_true.shape)} and y_pred of shape {tuple(y_pred.shape)} "
            "do not match."
        )
    return y_true, y_pred


def _weighted_sums(values: torch.Tensor, sample_weight: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(values * w), sum(w))`` with ``w`` broadcast to ``values`` as Keras does.

    A weight with one dim fewer than ``values`` (per-sample weights for per-element values)
    gets trailing dims added; one with an extra trailing size-1 dim is squeezed.
    """
    if sample_weight is None:
        return values.sum(), torch.tensor(values.numel(), dtype=values.dtype, device=values.device)
    weight = as_tensor(sample_weight).to(device=values.device, dtype=values.dtype)
    if weight.dim() == values.dim() + 1 and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    while weight.dim() < values.dim():
        weight = weight.unsqueeze(-1)
    try:
        weight = torch.broadcast_to(weight, values.shape)
    except RuntimeError as error:
        raise InvalidArgumentError(
            f"sample_weight of shape {tuple(as_tensor(sample_weight).shape)} cannot be "
            f"broadcast to values of shape {tuple(values.shape)}."
        ) from error
    return (values * weight).sum(), weight.sum()


class Mean(Metric):
    """Weighted mean of every element passed to ``update_state``.

    >>> import torch, torch_distribute as td
    >>> m = td.metrics.Mean()
    >>> m.update_state([1.0, 3.0], sample_weight=[1.0, 3.0])
    >>> m.result()
    tensor(2.5000)
    """

    _default_name = "mean"

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Add ``values`` (any shape; weights broadcast to it) to this replica's totals."""
        index = self._local_index()
        values = as_tensor(values)
        if is_empty_batch(values):
            return
        with torch.no_grad():
            values = values.to(acc_dtype(values.device))
            total, count = _weighted_sums(values, sample_weight)
        self._add(index, total=total, count=count)


class Sum(Mean):
    """Weighted sum of every element passed to ``update_state``.

    >>> import torch_distribute as td
    >>> s = td.metrics.Sum()
    >>> s.update_state([1.0, 2.0], sample_weight=[2.0, 0.5])
    >>> s.result()
    tensor(3.)
    """

    _state_names = ("total",)
    _default_name = "sum"

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Add ``sum(values * sample_weight)`` to this replica's total."""
        index = self._local_index()
        values = as_tensor(values)
        if is_empty_batch(values):
            return
        with torch.no_grad():
            total, _ = _weighted_sums(values.to(acc_dtype(values.device)), sample_weight)
        self._add(index, total=total)

    def _compute(self, totals: dict[str, torch.Tensor]) -> torch.Tensor:
        return totals["total"]


class _MeanMetricWrapper(Mean):
    """A ``Mean`` of per-sample values ``self._values(y_true, y_pred)`` (Keras' wrapper)."""

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - abstract

    # A Mean whose update_state takes (y_true, y_pred), as Keras' MeanMetricWrapper is (so
    # isinstance(metric, Mean) holds as there): the override is deliberately not Mean's signature.
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Add this batch's per-sample values, weighted by ``sample_weight``."""
        index = self._local_index()
        y_true, y_pred = as_tensor(y_true), as_tensor(y_pred)
        if is_empty_batch(y_true, y_pred):
            return
        with torch.no_grad():
            if y_true.device != y_pred.device:
                y_true = y_true.to(y_pred.device)
            values = self._values(y_true, y_pred).to(acc_dtype(y_pred.device))
            total, count = _weighted_sums(values, sample_weight)
        self._add(index, total=total, count=count)


class Accuracy(_MeanMetricWrapper):
    """How often ``y_pred`` equals ``y_true``, element by element.

    >>> import torch_distribute as td
    >>> acc = td.metrics.Accuracy()
    >>> acc.update_state([1, 2, 3, 4], [0, 2, 3, 4])
    >>> acc.result()
    tensor(0.7500)
    """

    _default_name = "accuracy"

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        y_true, y_pred = _align_ranks(y_true, y_pred)
        return torch.eq(y_true, y_pred)


class SparseCategoricalAccuracy(_MeanMetricWrapper):
    """How often the integer label ``y_true`` is the arg-max of ``y_pred``.

    ``y_true`` has shape ``(B,)`` or ``(B, 1)``; ``y_pred`` (logits or probabilities)
    ``(B, C)``.

    >>> import torch_distribute as td
    >>> acc = td.metrics.SparseCategoricalAccuracy()
    >>> acc.update_state([2, 1], [[0.1, 0.6, 0.3], [0.05, 0.95, 0.0]])
    >>> acc.result()
    tensor(0.5000)
    """

    _default_name = "sparse_categorical_accuracy"

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1:
            y_true = y_true.squeeze(-1)
        predicted = y_pred.argmax(-1)
        if y_true.shape != predicted.shape:
            raise InvalidArgumentError(
                f"SparseCategoricalAccuracy expects y_true of shape {tuple(predicted.shape)} "
                f"(or with a trailing 1) for y_pred of shape {tuple(y_pred.shape)}, got "
                f"{tuple(y_true.shape)}."
            )
        return torch.eq(y_true, predicted)


class CategoricalAccuracy(_MeanMetricWrapper):
    """How often the arg-max of one-hot ``y_true`` is the arg-max of ``y_pred``.

    >>> import torch_distribute as td
    >>> acc = td.metrics.CategoricalAccuracy()
    >>> acc.update_state([[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0.0]])
    >>> acc.result()
    tensor(0.5000)
    """

    _default_name = "categorical_accuracy"

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if y_true.shape != y_pred.shape:
            raise InvalidArgumentError(
                f"CategoricalAccuracy expects one-hot y_true of y_pred's shape "
                f"{tuple(y_pred.shape)}, got {tuple(y_true.shape)}."
            )
        return torch.eq(y_true.argmax(-1), y_pred.argmax(-1))


class MeanAbsoluteError(_MeanMetricWrapper):
    """Mean of ``|y_pred - y_true|``: per-sample means over the last axis, then weighted.

    >>> import torch_distribute as td
    >>> mae = td.metrics.MeanAbsoluteError()
    >>> mae.update_state([[0.0, 1.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 0.0]])
    >>> mae.result()
    tensor(0.5000)
    """

    _default_name = "mean_absolute_error"

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return _per_sample_error(y_true, y_pred, torch.abs)


class MeanSquaredError(_MeanMetricWrapper):
    """Mean of ``(y_pred - y_true) ** 2``: per-sample means over the last axis, then weighted.

    >>> import torch_distribute as td
    >>> mse = td.metrics.MeanSquaredError()
    >>> mse.update_state([[0.0, 1.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 0.0]])
    >>> mse.result()
    tensor(0.5000)
    """

    _default_name = "mean_squared_error"

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return _per_sample_error(y_true, y_pred, torch.square)


def _per_sample_error(y_true: torch.Tensor, y_pred: torch.Tensor, penalty: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``penalty(y_pred - y_true)`` averaged over the last axis (one value per sample)."""
    y_true, y_pred = _align_ranks(y_true, y_pred)
    dtype = acc_dtype(y_pred.device)
    error = penalty(y_pred.to(dtype) - y_true.to(dtype))
    return error.mean(-1) if error.dim() >= 2 else error
