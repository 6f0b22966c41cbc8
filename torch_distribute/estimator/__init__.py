"""``tf.estimator``'s distributed training API over ``td.keras`` ``fit``: ``Estimator``,
``RunConfig(train_distribute=..., eval_distribute=...)``, ``LinearRegressor``."""

from torch_distribute.estimator.estimator import Estimator
from torch_distribute.estimator.linear import (
    LinearModel,
    LinearRegressor,
    NumericColumn,
    numeric_column,
)
from torch_distribute.estimator.run_config import RunConfig

__all__ = ["Estimator", "LinearModel", "LinearRegressor", "NumericColumn", "RunConfig", "numeric_column"]
