"""The per-replica steps of ``td.keras.Model`` that ``strategy.run`` distributes, and the
functions that run one on every replica for each batch (``step_function``).

Each replica trains (or tests, or predicts) on its rows of a global batch; in training its
loss is its rows' share of the mean over the *global* batch, so summing the gradients over
the replicas (``optimizer.step()`` does under a strategy) gives those of one device.

>>> import torch, torch_distribute as td
>>> from torch_distribute.keras.replica_steps import ReplicaSteps
>>> steps = ReplicaSteps(torch.nn.Linear(2, 3))
>>> td.get_strategy().run(steps.predict_step, args=((torch.ones(4, 2), torch.zeros(4)),)).shape
torch.Size([4, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from torch_distribute import metrics as td_metrics
from torch_distribute import nest
from torch_distribute.compiled_function import function as td_function
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras.compile_utils import LossesContainer, MetricsContainer
from torch_distribute.keras.data_adapter import unpack
from torch_distribute.mixed_precision import LossScaleOptimizer

__all__ = ["ReplicaSteps", "StepFunction", "step_function"]

# ``fn(steps, *batch_args)``: ``strategy.run`` of one of ``steps``' methods (``step_function``).
StepFunction = Callable[..., Any]


class _Distributed(Protocol):
    """What ``step_function`` reads of a model: the strategy it belongs to."""

    @property
    def distribute_strategy(self) -> Any: ...


class ReplicaSteps:
    """The steps ``strategy.run`` runs on each replica, for a model and what ``compile`` made.

    ``model`` is called with a batch's ``x`` (unpacked when a tuple or list). ``predict_step``
    needs nothing else; ``train_step`` and ``test_step`` need the loss, the metrics and the
    loss tracker(s), and ``train_step`` the optimizer (a ``LossScaleOptimizer`` scales the
    loss). ``class_weight`` is a table of weights by class id (see
    ``training_loops.class_weights``), applied on top of the sample weights.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        optimizer: torch.optim.Optimizer | LossScaleOptimizer | None = None,
        loss: LossesContainer | None = None,
        metrics: MetricsContainer | None = None,
        loss_tracker: td_metrics.Mean | None = None,
        output_loss_trackers: Sequence[td_metrics.Mean] = (),
        class_weight: torch.Tensor | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.metrics = metrics
        self.loss_tracker = loss_tracker
        self.output_loss_trackers = list(output_loss_trackers)
        self.class_weight = class_weight

    def call(self, x: Any) -> Any:
        """The model's outputs on ``x`` (``model(*x)`` for a tuple or list of inputs)."""
        return self.model(*x) if isinstance(x, (tuple, list)) else self.model(x)

    def weights_for(self, y: Any, sample_weight: Any) -> torch.Tensor | None:
        """The per-sample weights: ``sample_weight`` times the weight of each row's class."""
        weight = None if sample_weight is None else torch.as_tensor(sample_weight).reshape(-1).float()
        if self.class_weight is not None and y is not None and isinstance(y, torch.Tensor):
            labels = y.argmax(-1) if y.dim() > 1 and y.shape[-1] > 1 else y.reshape(-1)
            per_class = self.class_weight.to(labels.device)[labels.long()]
            weight = per_class if weight is None else weight * per_class.to(weight.device)
        return weight

    def update_trackers(self, total: torch.Tensor, parts: list[tuple[Any, torch.Tensor]], y: Any, y_pred: Any,
                        sample_weight: torch.Tensor | None) -> None:
        """Add a step's losses and outputs to the loss tracker(s) and the metrics."""
        self.loss_tracker.update_state(total.detach())
        for tracker, (_, values) in zip(self.output_loss_trackers, parts, strict=False):
            tracker.update_state(values.detach())
        self.metrics.update_state(y, nest.map_structure(torch.Tensor.detach, y_pred), sample_weight)

    def _compiled_loss(self) -> LossesContainer:
        if self.loss is None:
            raise InvalidArgumentError("train_step and test_step need the loss: ReplicaSteps(model, loss=...).")
        return self.loss

    def train_step(self, batch: Any, global_rows: int) -> None:
        """One optimizer step on this replica's rows of a global batch of ``global_rows`` rows."""
        x, y, sample_weight = unpack(batch)
        if y is None:
            raise InvalidArgumentError("fit needs targets: pass y=, or batches of (x, y).")
        y_pred = self.call(x)
        weight = self.weights_for(y, sample_weight)
        total, parts = self._compiled_loss()(y, y_pred, weight)
        # This replica's share of the mean over the global batch: gradients are summed over replicas.
        loss = total.sum() / global_rows if global_rows else total.sum() * 0.0
        if isinstance(self.optimizer, LossScaleOptimizer):
            loss = self.optimizer.get_scaled_loss(loss)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.update_trackers(total, parts, y, y_pred, weight)

    def test_step(self, batch: Any) -> None:
        """Update the loss tracker(s) and the metrics on this replica's rows."""
        x, y, sample_weight = unpack(batch)
        if y is None:
            raise InvalidArgumentError("evaluate needs targets: pass y=, or batches of (x, y).")
        with torch.no_grad():
            y_pred = self.call(x)
            weight = self.weights_for(y, sample_weight)
            total, parts = self._compiled_loss()(y, y_pred, weight)
            self.update_trackers(total, parts, y, y_pred, weight)

    def predict_step(self, batch: Any) -> Any:
        """The model's outputs on this replica's rows."""
        x, _, _ = unpack(batch)
        with torch.no_grad():
            return self.call(x)


def step_function(model: _Distributed, step: str, compiled: bool) -> StepFunction:
    """``f(steps, *args)``: ``model.distribute_strategy.run(steps.<step>, args)``, named after
    ``step`` (``"train_step"`` gives ``train_function``); with ``compiled``, a ``td.function``
    (the replica step compiled; replicas on one device share its graphs)."""

    def run_step(steps: ReplicaSteps, *args: object) -> Any:
        return model.distribute_strategy.run(getattr(steps, step), args=args)

    run_step.__name__ = run_step.__qualname__ = step.replace("_step", "_function")
    return td_function(run_step) if compiled else run_step
