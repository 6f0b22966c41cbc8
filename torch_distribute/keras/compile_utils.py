"""What ``compile`` builds: the loss of every output and the metrics, matched to the outputs.

A model returns one tensor, a tuple/list of tensors (outputs ``output_1``, ``output_2``...)
or a dict (outputs named by its keys); targets have the same structure. ``loss`` is one
loss for every output, a list (one per output) or a dict (by output name); ``loss_weights``
likewise. ``metrics`` is a flat list for a single output, a list of lists (one per output)
or a dict of lists; with several outputs the logged names get the output's name as prefix
(``output_1_accuracy``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torch_distribute import metrics as td_metrics
from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras import losses as losses_module
from torch_distribute.keras import metrics as metrics_module


def named_outputs(values: Any, what: str = "y_pred") -> list[tuple[str | None, Any]]:
    """``[(name, tensor)]``: ``[(None, t)]`` for one tensor, ``output_<i>`` or dict keys otherwise."""
    if isinstance(values, Mapping):
        return [(str(k), v) for k, v in values.items()]
    if isinstance(values, (tuple, list)):
        return [(f"output_{i + 1}", v) for i, v in enumerate(values)]
    return [(None, values)]


def _match_targets(y: Any, outputs: list[tuple[str | None, Any]]) -> list[Any]:
    if len(outputs) == 1 and outputs[0][0] is None:
        return [y]
    if isinstance(y, Mapping):
        missing = [name for name, _ in outputs if name not in y]
        if missing:
            raise InvalidArgumentError(f"The targets have no entry for the outputs {missing}; targets keys: {sorted(y)}.")
        return [y[name] for name, _ in outputs]
    if isinstance(y, (tuple, list)) and len(y) == len(outputs):
        return list(y)
    raise InvalidArgumentError(
        f"The model returns {len(outputs)} outputs ({', '.join(str(n) for n, _ in outputs)}) but the targets "
        f"are {type(y).__name__}: pass one target per output, as a tuple or a dict keyed by output name."
    )


def _per_output(spec: Any, names: list[str | None], what: str) -> list[Any]:
    """Spread ``spec`` (one value, a list, or a dict by output name) over the outputs."""
    if isinstance(spec, Mapping):
        unknown = set(spec) - {n for n in names if n is not None}
        if unknown:
            raise InvalidArgumentError(f"{what} names outputs {sorted(unknown)} that the model does not have "
                                       f"(outputs: {[n for n in names if n is not None]}).")
        return [spec.get(n) for n in names]
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(names):
            raise InvalidArgumentError(f"{what} has {len(spec)} entries for {len(names)} model outputs; give one per output.")
        return list(spec)
    return [spec] * len(names)


class LossesContainer:
    """The total per-sample loss ``sum_i loss_weight_i * loss_i`` over the outputs."""

    def __init__(self, loss: Any, loss_weights: Any = None):
        if loss is None:
            raise InvalidArgumentError("compile needs a loss: a name such as 'mse', a td.keras.losses object, "
                                       "a torch.nn loss or a function fn(y_true, y_pred).")
        self._spec = loss
        self._weights = loss_weights
        if isinstance(loss, Mapping):
            self._resolved: Any = {k: losses_module.get(v) for k, v in loss.items() if v is not None}
        elif isinstance(loss, (list, tuple)):
            self._resolved = [losses_module.get(v) if v is not None else None for v in loss]
        else:
            self._resolved = losses_module.get(loss)
        self.multi_output = isinstance(loss, (Mapping, list, tuple))
        resolved = self._resolved.values() if isinstance(self._resolved, Mapping) else (
            self._resolved if isinstance(self._resolved, list) else [self._resolved])
        for item in resolved:
            if item is not None and getattr(item, "reduction", "sum_over_batch_size") != "sum_over_batch_size":
                raise InvalidArgumentError(
                    f"compile got the loss {item.name!r} with reduction={item.reduction!r}: fit averages every "
                    "loss over the global batch itself (sum_over_batch_size, the same on any number of "
                    "replicas). Pass the loss with its default reduction; reduction='none' or 'sum' are for "
                    "custom training loops.")

    @property
    def output_names(self) -> list[str]:
        """Output names known from the loss spec (dict keys, or ``output_<i>`` for a list)."""
        if isinstance(self._resolved, Mapping):
            return list(self._resolved)
        if isinstance(self._resolved, list):
            return [f"output_{i + 1}" for i in range(len(self._resolved))]
        return []

    def loss_for(self, name: str | None) -> losses_module.Loss | None:
        if isinstance(self._resolved, Mapping):
            return self._resolved.get(name)
        if isinstance(self._resolved, list):
            return self._resolved[int(name.rsplit("_", 1)[1]) - 1] if name else self._resolved[0]
        return self._resolved

    def __call__(self, y: Any, y_pred: Any, sample_weight: torch.Tensor | None) -> tuple[torch.Tensor, list[tuple[str | None, torch.Tensor]]]:
        """``(total per-sample loss, [(output name, its weighted per-sample loss)])``."""
        outputs = named_outputs(y_pred)
        targets = _match_targets(y, outputs)
        names = [n for n, _ in outputs]
        weights = _per_output(self._weights, names, "loss_weights") if self._weights is not None else [1.0] * len(names)
        if isinstance(self._resolved, list) and len(self._resolved) != len(names):
            raise InvalidArgumentError(f"compile got {len(self._resolved)} losses for {len(names)} model outputs.")
        total = None
        parts: list[tuple[str | None, torch.Tensor]] = []
        for (name, prediction), target, weight in zip(outputs, targets, weights, strict=True):
            loss = self.loss_for(name)
            if loss is None:
                continue
            values = loss.per_sample(target, prediction)
            if sample_weight is not None:
                values = values * sample_weight.to(values.dtype)
            if weight is not None and weight != 1.0:
                values = values * float(weight)
            parts.append((name, values))
            total = values if total is None else total + values
        if total is None:
            raise InvalidArgumentError("No output has a loss: give at least one output a loss in compile.")
        return total, parts


class MetricsContainer:
    """The compiled metrics, each bound to one output; created in the strategy scope."""

    def __init__(self, metrics: Any, weighted_metrics: Any, losses: LossesContainer):
        self.entries: list[tuple[str | None, td_metrics.Metric, bool]] = []  # (output, metric, weighted)
        self._add(metrics, losses, weighted=False)
        self._add(weighted_metrics, losses, weighted=True)
        names = [m.name for _, m, _ in self.entries]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise InvalidArgumentError(f"Several metrics are named {duplicates}; give them distinct names (name=...).")

    def _add(self, spec: Any, losses: LossesContainer, weighted: bool) -> None:
        if spec is None:
            return
        if isinstance(spec, Mapping):
            per_output: list[tuple[str | None, Any]] = list(spec.items())
        elif isinstance(spec, Sequence) and not isinstance(spec, str) and spec and all(
                isinstance(m, (list, tuple)) or m is None for m in spec):
            per_output = [(f"output_{i + 1}", m) for i, m in enumerate(spec)]
        elif isinstance(spec, Sequence) and not isinstance(spec, str):
            per_output = [(None, list(spec))]
        else:
            raise InvalidArgumentError(f"metrics must be a list (or a list per output, or a dict by output name), got {spec!r}.")
        for output, items in per_output:
            items = [] if items is None else items
            for item in (items if isinstance(items, (list, tuple)) else [items]):
                loss = losses.loss_for(output) if output is not None or not losses.multi_output else None
                metric = metrics_module.get(item, from_logits=bool(getattr(loss, "from_logits", False)))
                if output is not None:
                    metric.name = f"{output}_{metric.name}"
                self.entries.append((output, metric, weighted))

    @property
    def metrics(self) -> list[td_metrics.Metric]:
        return [m for _, m, _ in self.entries]

    def update_state(self, y: Any, y_pred: Any, sample_weight: torch.Tensor | None) -> None:
        if not self.entries:
            return
        outputs = named_outputs(y_pred)
        targets = dict(zip([n for n, _ in outputs], _match_targets(y, outputs), strict=True))
        predictions = dict(outputs)
        for output, metric, weighted in self.entries:
            if output is None and len(outputs) > 1:
                raise InvalidArgumentError(
                    f"The model has {len(outputs)} outputs; give metrics per output: a dict "
                    "{output_name: [metrics]} or a list with one list of metrics per output."
                )
            key = outputs[0][0] if output is None else output
            if key not in predictions:
                raise InvalidArgumentError(f"Metric {metric.name!r} is for output {key!r}, which the model does not return "
                                           f"(outputs: {list(predictions)}).")
            metric.update_state(targets[key], predictions[key], sample_weight=sample_weight if weighted else None)
