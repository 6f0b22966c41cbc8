"""Keras-style ``compile``/``fit``/``evaluate``/``predict`` under any strategy.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     model = td.keras.Model(torch.nn.Linear(1, 1))
>>> model.compile(optimizer="sgd", loss="mse")
>>> history = model.fit(torch.ones(100, 1), torch.ones(100, 1), batch_size=10, epochs=2, verbose=0)
>>> len(history.history["loss"]), type(model.evaluate(torch.ones(10, 1), torch.ones(10, 1), verbose=0))
(2, <class 'float'>)
"""

from torch_distribute.keras import (
    applications,
    callbacks,
    losses,
    metrics,
    mixed_precision,
    models,
    optimizers,
    preprocessing,
    saving,
    utils,
)
from torch_distribute.keras.callbacks.history import History
from torch_distribute.keras.model import Model, NotCompiledError
from torch_distribute.keras.progbar import Progbar

__all__ = [
    "History",
    "Model",
    "NotCompiledError",
    "Progbar",
    "applications",
    "callbacks",
    "losses",
    "metrics",
    "mixed_precision",
    "models",
    "optimizers",
    "preprocessing",
    "saving",
    "utils",
]
