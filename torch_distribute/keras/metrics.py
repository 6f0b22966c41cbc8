"""The metric strings ``compile(metrics=...)`` accepts, resolved to sync-on-read metrics.

Every metric here is a ``td.metrics`` metric: ``update_state`` inside ``strategy.run`` touches
only the calling replica's slot, ``result()`` is the global value. ``compile`` creates them
in the model's strategy scope.

``"accuracy"`` / ``"acc"`` pick binary, sparse-categorical or categorical accuracy from the
shapes of the targets and predictions, as Keras does (and keep the name you gave).

>>> import torch, torch_distribute as td
>>> acc = td.keras.metrics.get("accuracy")
>>> acc.update_state(torch.tensor([1, 0]), torch.tensor([[0.2, 0.8], [0.3, 0.7]]))
>>> acc.result()
tensor(0.5000)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_distribute import metrics as td_metrics
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras import losses as losses_module

# tf.keras.metrics' names for the metrics td.metrics defines.
CategoricalAccuracy = td_metrics.CategoricalAccuracy
MeanAbsoluteError = td_metrics.MeanAbsoluteError
MeanSquaredError = td_metrics.MeanSquaredError
SparseCategoricalAccuracy = td_metrics.SparseCategoricalAccuracy

__all__ = [
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "InferredAccuracy",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "SparseCategoricalAccuracy",
    "MeanMetricWrapper",
    "RootMeanSquaredError",
    "SparseTopKCategoricalAccuracy",
    "TopKCategoricalAccuracy",
    "get",
    "names",
]


class MeanMetricWrapper(td_metrics.Mean):
    """Mean over samples of ``fn(y_true, y_pred)`` (one value per sample), sync-on-read.

    >>> import torch, torch_distribute as td
    >>> m = td.keras.metrics.MeanMetricWrapper(lambda t, p: (t == p).float(), name="eq")
    >>> m.update_state(torch.tensor([1, 2]), torch.tensor([1, 3]))
    >>> m.result()
    tensor(0.5000)
    """

    def __init__(self, fn: Callable[..., torch.Tensor], name: str | None = None, **kwargs: Any):
        super().__init__(name=name or getattr(fn, "__name__", "metric"))
        self._fn = fn
        self._kwargs = kwargs

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        y_pred = torch.as_tensor(y_pred)
        if y_pred.dim() > 0 and y_pred.shape[0] == 0:
            return
        with torch.no_grad():
            values = losses_module.per_sample(self._fn(torch.as_tensor(y_true), y_pred.detach(), **self._kwargs))
        super().update_state(values, sample_weight=_per_row(sample_weight))


def _per_row(sample_weight: Any) -> Any:
    if sample_weight is None:
        return None
    weight = torch.as_tensor(sample_weight)
    return weight.reshape(weight.shape[0], -1)[:, 0] if weight.dim() > 1 else weight


def binary_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    y_true, y_pred = losses_module.align_ranks(y_true, y_pred)
    matches = (y_true == (y_pred > threshold).to(y_true.dtype)).to(torch.float32)
    return matches.mean(-1) if matches.dim() > 1 else matches


def sparse_categorical_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    y_true = y_true.to(y_pred.device)
    if y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    return (y_pred.argmax(-1) == y_true.long()).to(torch.float32)


def categorical_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return (y_pred.argmax(-1) == y_true.to(y_pred.device).argmax(-1)).to(torch.float32)


def top_k_categorical_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor, k: int = 5) -> torch.Tensor:
    return sparse_top_k_categorical_accuracy(y_true.to(y_pred.device).argmax(-1), y_pred, k)


def sparse_top_k_categorical_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor, k: int = 5) -> torch.Tensor:
    y_true = y_true.to(y_pred.device)
    if y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    top = y_pred.topk(min(k, y_pred.shape[-1]), dim=-1).indices
    return (top == y_true.long().unsqueeze(-1)).any(-1).to(torch.float32)


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` equals the 0/1 target."""

    def __init__(self, name: str = "binary_accuracy", threshold: float = 0.5):
        super().__init__(binary_accuracy, name=name, threshold=threshold)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the one-hot target is among the ``k`` highest predictions."""

    def __init__(self, k: int = 5, name: str = "top_k_categorical_accuracy"):
        super().__init__(top_k_categorical_accuracy, name=name, k=k)


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer target is among the ``k`` highest predictions."""

    def __init__(self, k: int = 5, name: str = "sparse_top_k_categorical_accuracy"):
        super().__init__(sparse_top_k_categorical_accuracy, name=name, k=k)


class InferredAccuracy(MeanMetricWrapper):
    """``"accuracy"``: binary, sparse-categorical or categorical, chosen from the shapes.

    One output column (or a 1-D output) is binary accuracy (threshold 0.5, or 0 when the loss
    takes logits); class ids against several columns are sparse-categorical; one-hot targets
    are categorical. The same rule as Keras' ``compile(metrics=["accuracy"])``.
    """

    def __init__(self, name: str = "accuracy", from_logits: bool = False):
        super().__init__(self._accuracy, name=name)
        self._threshold = 0.0 if from_logits else 0.5

    def _accuracy(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if y_pred.dim() <= 1 or y_pred.shape[-1] == 1:
            return binary_accuracy(y_true, y_pred, self._threshold)
        if y_true.shape == y_pred.shape:
            return categorical_accuracy(y_true, y_pred)
        return sparse_categorical_accuracy(y_true, y_pred)


class RootMeanSquaredError(td_metrics.MeanSquaredError):
    """``sqrt`` of the mean squared error over every sample seen (not a mean of roots)."""

    _default_name = "root_mean_squared_error"

    def _compute(self, totals: dict[str, torch.Tensor]) -> torch.Tensor:
        return super()._compute(totals).sqrt()


_FACTORIES: dict[str, Callable[..., td_metrics.Metric]] = {
    "binary_accuracy": BinaryAccuracy,
    "categorical_accuracy": td_metrics.CategoricalAccuracy,
    "sparse_categorical_accuracy": td_metrics.SparseCategoricalAccuracy,
    "top_k_categorical_accuracy": TopKCategoricalAccuracy,
    "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    "mean_squared_error": td_metrics.MeanSquaredError,
    "mean_absolute_error": td_metrics.MeanAbsoluteError,
    "root_mean_squared_error": RootMeanSquaredError,
}
_ALIASES = {
    "mse": "mean_squared_error",
    "mae": "mean_absolute_error",
    "rmse": "root_mean_squared_error",
    "top_k_accuracy": "top_k_categorical_accuracy",
}


def names() -> list[str]:
    """Every string ``get`` accepts (loss names measure that loss)."""
    loss_names = [n for n in losses_module.names() if n not in ("mse", "mae")]
    return sorted({"accuracy", "acc", *_FACTORIES, *_ALIASES, *loss_names})


def get(identifier: Any, from_logits: bool = False) -> td_metrics.Metric:
    """A metric from a string, a ``td.metrics`` metric, or a function ``fn(y_true, y_pred)``.

    Call it inside the strategy scope the metric is for (``compile`` does).
    ``from_logits`` (the loss's) sets the threshold of the binary ``"accuracy"``.
    """
    if isinstance(identifier, td_metrics.Metric):
        return identifier
    if isinstance(identifier, str):
        lowered = identifier.lower()
        if lowered in ("accuracy", "acc"):
            return InferredAccuracy(name=identifier, from_logits=from_logits)
        key = _ALIASES.get(lowered, lowered)
        if key in _FACTORIES:
            metric = _FACTORIES[key]()
            metric.name = identifier if lowered in _ALIASES else key
            return metric
        try:
            loss = losses_module.get(identifier)
        except InvalidArgumentError:
            raise InvalidArgumentError(
                f"Unknown metric {identifier!r}. Valid names: {', '.join(names())}. Or pass a "
                "td.metrics metric created in the strategy scope, or a function fn(y_true, y_pred)."
            ) from None
        return MeanMetricWrapper(loss.per_sample, name=identifier)
    if isinstance(identifier, type):
        raise InvalidArgumentError(
            f"metric {identifier.__name__} is a class; pass an instance, e.g. {identifier.__name__}()."
        )
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise InvalidArgumentError(
        f"A metric must be a string, a td.metrics metric or a function, got {type(identifier).__name__}."
    )
