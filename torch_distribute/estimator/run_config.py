"""``RunConfig``: where an ``Estimator`` trains and evaluates (its strategies) and keeps checkpoints."""

from __future__ import annotations

import os
from typing import Any

from torch_distribute.errors import InvalidArgumentError


class RunConfig:
    """``tf.estimator.RunConfig``'s distribution fields.

    ``train_distribute``: the strategy ``train`` runs under (none: the default strategy);
    ``eval_distribute``: the one ``evaluate`` and ``predict`` run under (default: the training
    strategy). ``model_dir`` holds the checkpoints (``keep_checkpoint_max`` of them);
    ``tf_random_seed`` seeds ``torch`` before the model is built.

    >>> import torch_distribute as td
    >>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> config = td.estimator.RunConfig(train_distribute=strategy, eval_distribute=strategy)
    """

    def __init__(self, model_dir: str | os.PathLike[str] | None = None, tf_random_seed: int | None = None,
                 train_distribute: Any = None, eval_distribute: Any = None, keep_checkpoint_max: int = 5):
        for name, strategy in (("train_distribute", train_distribute), ("eval_distribute", eval_distribute)):
            if strategy is not None and not hasattr(strategy, "scope"):
                raise InvalidArgumentError(f"RunConfig {name} must be a td strategy, got {type(strategy).__name__}.")
        self.model_dir = None if model_dir is None else os.fspath(model_dir)
        self.tf_random_seed = tf_random_seed
        self.train_distribute = train_distribute
        self.eval_distribute = eval_distribute
        self.keep_checkpoint_max = keep_checkpoint_max

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some fields changed (as ``tf.estimator.RunConfig.replace``)."""
        fields = dict(model_dir=self.model_dir, tf_random_seed=self.tf_random_seed,
                      train_distribute=self.train_distribute, eval_distribute=self.eval_distribute,
                      keep_checkpoint_max=self.keep_checkpoint_max)
        fields.update(changes)
        return RunConfig(**fields)
