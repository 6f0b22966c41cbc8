"""``LinearRegressor`` and ``numeric_column``: the canned linear model on dict features."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.estimator.estimator import Estimator
from torch_distribute.estimator.run_config import RunConfig
from torch_distribute.keras import metrics as keras_metrics
from torch_distribute.keras import optimizers as keras_optimizers
from torch_distribute.keras.model import Model

_LEARNING_RATE = 0.2  # TensorFlow's canned linear models' rate for an optimizer given by name


class NumericColumn(NamedTuple):
    key: str
    shape: tuple[int, ...] = (1,)


def numeric_column(key: str, shape: Sequence[int] = (1,)) -> NumericColumn:
    """A real-valued feature ``features[key]`` of ``shape`` per example."""
    return NumericColumn(key, tuple(shape))


class LinearModel(nn.Module):
    """``sum_k features[k] @ W_k + b`` over the feature columns (weights start at zero, as in TF)."""

    def __init__(self, columns: Sequence[NumericColumn], label_dimension: int = 1):
        super().__init__()
        self.columns = list(columns)
        width = sum(int(torch.tensor(c.shape).prod()) for c in self.columns)
        self.linear = nn.Linear(width, label_dimension)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: Any) -> torch.Tensor:
        if not isinstance(features, dict):
            if len(self.columns) != 1:
                raise InvalidArgumentError("Give the features as a dict {column key: tensor}.")
            features = {self.columns[0].key: features}
        missing = [c.key for c in self.columns if c.key not in features]
        if missing:
            raise InvalidArgumentError(f"The features have no {missing}; they have {sorted(features)}.")
        parts = [torch.as_tensor(features[c.key]).float().reshape(-1, int(torch.tensor(c.shape).prod()))
                 for c in self.columns]
        return self.linear(torch.cat(parts, dim=1))


class LinearRegressor(Estimator):
    """``tf.estimator.LinearRegressor``: a linear model trained on the mean squared error.

    ``optimizer``: a name (``"SGD"``, ``"Adam"``, ``"Adagrad"``, ``"RMSProp"``; learning rate
    0.2 as TensorFlow's canned linear models use) or a ``td.keras.optimizers`` spec. TF's
    default ``"Ftrl"`` has no PyTorch counterpart: the default here is ``"SGD"``.
    ``evaluate`` reports ``average_loss``, ``loss``, ``label/mean``, ``prediction/mean``.

    >>> import torch, torch_distribute as td
    >>> regressor = td.estimator.LinearRegressor([td.estimator.numeric_column("feats")])
    >>> batches = [({"feats": torch.ones(10, 1)}, torch.ones(10, 1))] * 100
    >>> result = regressor.train(lambda: batches, steps=10).evaluate(lambda: batches, steps=10)
    >>> result["global_step"], result["average_loss"] < 1e-4
    (10, True)
    """

    def __init__(self, feature_columns: Sequence[NumericColumn | str], model_dir: str | os.PathLike[str] | None = None,
                 label_dimension: int = 1, optimizer: Any = "SGD", config: RunConfig | None = None):
        columns = [numeric_column(c) if isinstance(c, str) else c for c in feature_columns]
        if not columns or not all(isinstance(c, NumericColumn) for c in columns):
            raise InvalidArgumentError("feature_columns must be a non-empty list of td.estimator.numeric_column(...) or keys.")
        if isinstance(optimizer, str):
            name = {"rmsprop": "rmsprop"}.get(optimizer.lower(), optimizer.lower())
            if name == "ftrl":
                raise InvalidArgumentError("The Ftrl optimizer is not available in PyTorch; use 'SGD', 'Adam' or 'Adagrad'.")
            optimizer = keras_optimizers.get(name, learning_rate=_LEARNING_RATE)

        def model_fn() -> Model:
            model = Model(LinearModel(columns, label_dimension), name="linear_regressor")
            model.compile(optimizer=optimizer, loss="mse", metrics=[
                keras_metrics.MeanMetricWrapper(_label_mean, name="label/mean"),
                keras_metrics.MeanMetricWrapper(_prediction_mean, name="prediction/mean"),
            ])
            return model

        super().__init__(model_fn, model_dir=model_dir, config=config)

    def evaluate(self, input_fn: Any, steps: int | None = None, name: str | None = None) -> dict[str, Any]:
        results = super().evaluate(input_fn, steps, name)
        results["average_loss"] = results["loss"]
        return results


def _label_mean(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return y_true.float().reshape(y_true.shape[0], -1).mean(-1)


def _prediction_mean(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return y_pred.float().reshape(y_pred.shape[0], -1).mean(-1)
