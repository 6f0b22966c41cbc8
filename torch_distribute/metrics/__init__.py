"""Sync-on-read metrics, as Keras metrics behave under ``tf.distribute``.

A metric made inside ``strategy.scope()`` keeps one state slot per local replica.
``update_state`` inside ``strategy.run`` touches only the calling replica's slot (no
communication per step); ``result()`` sums the slots of every replica (and every worker)
and computes the global value, so a ``Mean`` over ``range(10)`` is 4.5 for any number of
replicas. Inside ``run``, ``result()`` goes through ``merge_call``: every replica must call
it, and every replica gets the same global value.

The package holds ``base`` (the ``Metric`` base class), ``keras_metrics`` (``Mean``,
``Sum``, the accuracies and errors) and ``torchmetrics_adapter`` (``TorchMetric``).

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     mean = td.metrics.Mean()
>>> _ = strategy.run(lambda x: mean.update_state(x), args=(td.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([6.0])]),))
>>> mean.result()
tensor(3.)
"""

from torch_distribute.metrics.base import Metric
from torch_distribute.metrics.keras_metrics import (
    Accuracy,
    CategoricalAccuracy,
    Mean,
    MeanAbsoluteError,
    MeanSquaredError,
    SparseCategoricalAccuracy,
    Sum,
)
from torch_distribute.metrics.torchmetrics_adapter import SyncOnReadMetric, TorchMetric

__all__ = [
    "Accuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "Sum",
    "SyncOnReadMetric",
    "TorchMetric",
]
