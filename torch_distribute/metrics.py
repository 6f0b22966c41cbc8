"""Sync-on-read metrics, as Keras metrics behave under ``tf.distribute``.

A metric made inside ``strategy.scope()`` keeps one state slot per local replica.
``update_state`` inside ``strategy.run`` touches only the calling replica's slot (no
communication per step); ``result()`` sums the slots of every replica (and every worker)
and computes the global value, so a ``Mean`` over ``range(10)`` is 4.5 for any number of
replicas. Inside ``run``, ``result()`` goes through ``merge_call``: every replica must call
it, and every replica gets the same global value.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     mean = td.metrics.Mean()
>>> _ = strategy.run(lambda x: mean.update_state(x), args=(td.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([6.0])]),))
>>> mean.result()
tensor(3.)
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch

from torch_distribute.context import get_replica_context, get_strategy, has_strategy
from torch_distribute.errors import ContextError, InvalidArgumentError

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


def _acc_dtype(device: torch.device) -> torch.dtype:
    # Accumulators are float64: a float32 count stops being exact at 2**24 (16.7M samples, one
    # ImageNet-size epoch of per-pixel accuracy), after which "+1" is lost and results drift
    # with the replica count. float64 sums of counts and of integer-valued matches are exact
    # up to 2**53, so the global totals are independent of how the data was split. MPS has
    # no float64, so it falls back to float32 there.
    return torch.float32 if device.type == "mps" else torch.float64


def _as_tensor(value: Any) -> torch.Tensor:
    """A detached tensor from a tensor, numpy array, list or Python number."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.as_tensor(value)


def _is_empty_batch(*tensors: torch.Tensor) -> bool:
    """True when any input has a zero-size leading (batch) dimension."""
    return any(t.dim() > 0 and t.shape[0] == 0 for t in tensors)


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
    weight = _as_tensor(sample_weight).to(device=values.device, dtype=values.dtype)
    if weight.dim() == values.dim() + 1 and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    while weight.dim() < values.dim():
        weight = weight.unsqueeze(-1)
    try:
        weight = torch.broadcast_to(weight, values.shape)
    except RuntimeError as error:
        raise InvalidArgumentError(
            f"sample_weight of shape {tuple(_as_tensor(sample_weight).shape)} cannot be "
            f"broadcast to values of shape {tuple(values.shape)}."
        ) from error
    return (values * weight).sum(), weight.sum()


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


class Metric:
    """Base class of sync-on-read metrics: one state slot per local replica.

    Subclasses list their accumulators in ``_state_names``; ``update_state`` takes
    ``index = self._local_index()`` first (it enforces the context rules), then adds with
    ``self._add(index, total=..., count=...)``; ``_compute`` turns the global totals into
    the value.

    Rules (as in TensorFlow, where metric state is ``ON_READ`` + ``SUM``):

    - create the metric inside ``strategy.scope()`` (not inside ``run``);
    - call ``update_state`` inside ``strategy.run``; with several replicas, calling it in
      cross-replica context raises ``ContextError``;
    - ``result()``, ``reset_state()``, ``state_dict()`` and ``load_state_dict()`` work in
      either context; inside ``run`` every replica must call them (they ``merge_call``).

    >>> import torch, torch_distribute as td
    >>> m = td.metrics.Mean()
    >>> m.update_state(torch.tensor([1.0, 2.0, 3.0]))
    >>> m.result()
    tensor(2.)
    """

    _state_names: tuple[str, ...] = ("total", "count")
    _default_name = "metric"

    def __init__(self, name: str | None = None):
        replica = get_replica_context()
        if replica is not None and has_strategy() and replica.num_replicas_in_sync > 1:
            raise ContextError(
                f"{type(self).__name__} was created inside strategy.run(): every replica would "
                "make its own metric. Create metrics once, inside `with strategy.scope():`, "
                "and update them inside strategy.run()."
            )
        self.name = name if name is not None else self._default_name
        self._strategy = get_strategy()
        self._devices = [d.torch_device for d in self._strategy.extended.worker_devices]
        self._slots: list[Any] = [self._new_slot(device) for device in self._devices]

    # -- state slots -----------------------------------------------------------------------
    def _new_slot(self, device: torch.device) -> Any:
        return {n: torch.zeros((), dtype=_acc_dtype(device), device=device) for n in self._state_names}

    def _add(self, index: int, **increments: torch.Tensor) -> None:
        """Add ``increments`` to slot ``index`` (the calling replica's, from ``_local_index``)."""
        slot = self._slots[index]
        for key, inc in increments.items():
            current = slot[key]
            if current.device != inc.device:  # follow the data (e.g. default strategy + GPU)
                current = current.to(inc.device)
            slot[key] = current + inc.to(current.dtype)

    def _local_index(self) -> int:
        """Index of the slot the caller may update; enforces TF's context rules."""
        replica = self._replica_context()
        if replica is not None:
            return replica.local_replica_id
        if self._strategy.num_replicas_in_sync > 1:
            raise ContextError(
                f"{type(self).__name__}.update_state() was called in cross-replica context on a "
                f"metric of a strategy with {self._strategy.num_replicas_in_sync} replicas. As in "
                "TensorFlow (a SUM sync-on-read variable cannot be updated in cross-replica "
                "context), update metrics inside strategy.run(): call update_state() in the "
                "step function."
            )
        return 0

    def _replica_context(self) -> Any:
        """This metric's replica context if we are in one, ``None`` in cross-replica context."""
        replica = get_replica_context()
        if replica is None:
            return None  # a strategy's scope outside run, or inside merge_call
        if replica.strategy is self._strategy:
            return replica
        if not has_strategy():
            return None  # the user's loop, outside any scope: cross-replica for this metric
        raise ContextError(
            f"{type(self).__name__} {self.name!r} was created under "
            f"{type(self._strategy).__name__} but is used inside strategy.run() of "
            f"{type(replica.strategy).__name__}. Create the metric inside "
            "`with strategy.scope():` of the strategy that runs it."
        )

    def _cross_replica_call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once in cross-replica context; inside ``run``, through ``merge_call``."""
        replica = self._replica_context()
        if replica is not None and self._strategy.num_replicas_in_sync > 1:
            return replica.merge_call(lambda _strategy: fn())
        return fn()

    def _totals(self) -> dict[str, torch.Tensor]:
        """Global totals (float64, CPU): every local slot, summed across workers too."""
        local = torch.stack(
            [
                torch.stack([slot[n].detach().to("cpu", torch.float64) for n in self._state_names])
                for slot in self._slots
            ]
        ).sum(0)
        extended = self._strategy.extended
        total = extended._reduce_across_workers(local.to(self._devices[0])).to("cpu", torch.float64)
        return dict(zip(self._state_names, total, strict=True))

    def _compute(self, totals: dict[str, torch.Tensor]) -> torch.Tensor:
        """Default: ``total / count``, 0 when nothing was counted (Keras' divide_no_nan)."""
        count = totals["count"]
        return totals["total"] / count if count != 0 else torch.zeros((), dtype=torch.float64)

    # -- public API ------------------------------------------------------------------------
    def update_state(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        """The global value over every replica and worker, as a 0-dim float32 CPU tensor."""
        return self._cross_replica_call(self._result)

    def _result(self) -> Any:
        return self._compute(self._totals()).to("cpu", torch.float32)

    def reset_state(self) -> None:
        """Zero the state of every replica."""
        self._cross_replica_call(self._reset)

    reset_states = reset_state

    def _reset(self) -> None:
        self._slots = [self._new_slot(device) for device in self._devices]

    def state_dict(self) -> dict[str, Any]:
        """The aggregated totals: one logical copy, independent of the replica count."""
        return self._cross_replica_call(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        return {k: v.clone() for k, v in self._totals().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load totals saved by ``state_dict`` under any number of replicas or workers.

        The totals go to the first replica of the first worker and every other slot is
        zeroed, so the global totals (hence ``result()``) are exactly the saved ones.
        """
        self._cross_replica_call(lambda: self._load_state_dict(dict(state_dict)))

    def _holds_replica_zero(self) -> bool:
        return getattr(self._strategy.extended, "_replica_id_offset", 0) == 0

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _check_keys(type(self).__name__, state_dict, set(self._state_names))
        self._reset()
        if self._holds_replica_zero():
            slot = self._slots[0]
            for key in self._state_names:
                value = _as_tensor(state_dict[key])
                if value.numel() != 1:
                    raise InvalidArgumentError(
                        f"{type(self).__name__}.load_state_dict: {key!r} must be a scalar, got "
                        f"shape {tuple(value.shape)}."
                    )
                slot[key] = value.reshape(()).to(device=slot[key].device, dtype=slot[key].dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``update_state(*args, **kwargs)`` then ``result()`` (like a Keras metric)."""
        self.update_state(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, replicas={len(self._slots)})"


def _check_keys(owner: str, state_dict: dict[str, Any], expected: set[str]) -> None:
    keys = set(state_dict)
    if keys != expected:
        missing, unexpected = sorted(expected - keys), sorted(keys - expected)
        raise InvalidArgumentError(
            f"{owner}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}."
        )


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
        values = _as_tensor(values)
        if _is_empty_batch(values):
            return
        with torch.no_grad():
            values = values.to(_acc_dtype(values.device))
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
        values = _as_tensor(values)
        if _is_empty_batch(values):
            return
        with torch.no_grad():
            total, _ = _weighted_sums(values.to(_acc_dtype(values.device)), sample_weight)
        self._add(index, total=total)

    def _compute(self, totals: dict[str, torch.Tensor]) -> torch.Tensor:
        return totals["total"]


class _MeanMetricWrapper(Mean):
    """A ``Mean`` of per-sample values ``self._values(y_true, y_pred)`` (Keras' wrapper)."""

    def _values(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - abstract

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Add this batch's per-sample values, weighted by ``sample_weight``."""
        index = self._local_index()
        y_true, y_pred = _as_tensor(y_true), _as_tensor(y_pred)
        if _is_empty_batch(y_true, y_pred):
            return
        with torch.no_grad():
            if y_true.device != y_pred.device:
                y_true = y_true.to(y_pred.device)
            values = self._values(y_true, y_pred).to(_acc_dtype(y_pred.device))
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
    dtype = _acc_dtype(y_pred.device)
    error = penalty(y_pred.to(dtype) - y_true.to(dtype))
    return error.mean(-1) if error.dim() >= 2 else error


# -- torchmetrics adapter ------------------------------------------------------------------------


def _import_torchmetrics() -> Any:
    try:
        import torchmetrics
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "td.metrics.TorchMetric needs torchmetrics: `pip install torchmetrics`."
        ) from error
    return torchmetrics


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


class TorchMetric(Metric):
    """Make any ``torchmetrics.Metric`` sync-on-read: one copy per local replica.

    ``update_state(*args, **kwargs)`` calls the local copy's ``update``; ``result()`` merges
    every copy's state (each state with its own ``dist_reduce_fx``, exactly as torchmetrics
    merges the states of several processes) and calls ``compute``. Under a multi-worker
    strategy the merged metric then syncs across processes with torchmetrics' own
    ``torch.distributed`` sync, so ``result()`` must be called on every worker.

    >>> import torch, torchmetrics, torch_distribute as td
    >>> mse = td.metrics.TorchMetric(torchmetrics.MeanSquaredError())
    >>> mse.update_state(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    >>> mse.result()
    tensor(2.)
    """

    def __init__(self, metric: Any, name: str | None = None):
        torchmetrics = _import_torchmetrics()
        if not isinstance(metric, torchmetrics.Metric):
            raise InvalidArgumentError(
                f"TorchMetric wraps a torchmetrics.Metric, got {type(metric).__name__}."
            )
        self._template = metric
        super().__init__(name if name is not None else _snake_case(type(metric).__name__))

    def _new_slot(self, device: torch.device) -> Any:
        replica_copy = copy.deepcopy(self._template).to(device)
        replica_copy.reset()
        return replica_copy

    @property
    def _multi_worker(self) -> bool:
        return self._strategy.num_replicas_in_sync > len(self._devices)

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """``update(*args, **kwargs)`` on this replica's copy; empty batches are skipped."""
        replica_copy = self._slots[self._local_index()]
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if _is_empty_batch(*tensors):
            return
        device = replica_copy.device
        replica_copy.update(
            *(_to_device(a, device) for a in args),
            **{k: _to_device(v, device) for k, v in kwargs.items()},
        )

    def _merged(self) -> Any:
        """One metric holding the merged state of every local copy."""
        torchmetrics = _import_torchmetrics()
        device = self._slots[0].device
        updated = [m for m in self._slots if m._update_count > 0]
        if type(self._template).merge_state is not torchmetrics.Metric.merge_state and updated:
            # The metric defines its own merge: trust it.
            merged = copy.deepcopy(updated[0]).to(device)
            for other in updated[1:]:
                merged.merge_state(copy.deepcopy(other).to(device))
            merged._update_count = sum(m._update_count for m in updated)
        else:
            merged = copy.deepcopy(self._slots[0])
            # The metric and any metrics inside it (wrappers such as ClasswiseWrapper).
            for path, part in _metric_parts(merged):
                _merge_states(part, [m.get_submodule(path) for m in self._slots], device)
        for _, part in _metric_parts(merged):
            part._computed = None
            part._to_sync = self._multi_worker  # sync across processes only if we span several
        return merged

    def _result(self) -> Any:
        return _to_cpu(self._merged().compute())

    def _reset(self) -> None:
        for replica_copy in self._slots:
            replica_copy.reset()

    def _state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for path, part in _metric_parts(self._merged()):
            if self._multi_worker:
                part.sync(should_sync=True)
            prefix = f"{path}." if path else ""
            for attr in part._defaults:
                state[prefix + attr] = _to_cpu(copy.copy(getattr(part, attr)))
            state[prefix + "_update_count"] = torch.tensor(part._update_count)
        return state

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parts = _metric_parts(self._slots[0])
        expected = {
            (f"{path}." if path else "") + key
            for path, part in parts
            for key in (*part._defaults, "_update_count")
        }
        _check_keys(type(self).__name__, state_dict, expected)
        self._reset()
        if self._holds_replica_zero():
            for path, part in parts:
                prefix = f"{path}." if path else ""
                for attr in part._defaults:
                    setattr(part, attr, _to_device(copy.copy(state_dict[prefix + attr]), part.device))
                part._update_count = int(state_dict[prefix + "_update_count"])

    def __repr__(self) -> str:
        return f"TorchMetric({self._template!r}, name={self.name!r}, replicas={len(self._slots)})"


def _metric_parts(metric: Any) -> list[tuple[str, Any]]:
    """``(path, metric)`` for the metric and every torchmetrics metric nested inside it."""
    from torchmetrics import Metric as TorchmetricsMetric

    return [(p, m) for p, m in metric.named_modules() if isinstance(m, TorchmetricsMetric)]


def _merge_states(target: Any, copies: list[Any], device: torch.device) -> None:
    """Set ``target``'s own states to the merge of ``copies``' (copies never updated skipped)."""
    updated = [m for m in copies if m._update_count > 0]
    for attr, reduce_fn in target._reductions.items():
        if updated:
            value = _reduce_state([getattr(m, attr) for m in updated], reduce_fn, device)
        else:
            default = target._defaults[attr]
            value = default.detach().clone().to(device) if isinstance(default, torch.Tensor) else []
        setattr(target, attr, value)
    target._update_count = sum(m._update_count for m in copies)


def _reduce_state(states: list[Any], reduce_fn: Any, device: torch.device) -> Any:
    """Combine one state of several copies the way torchmetrics combines processes' states.

    ``sum``/``mean``/``min``/``max`` and custom callables reduce the stacked states along the
    new leading dim (as ``Metric._sync_dist``); ``cat`` concatenates (list states: joined
    lists); ``None`` stacks tensors or joins lists.
    """
    from torchmetrics.utilities.data import dim_zero_cat

    if isinstance(states[0], list):
        return [_to_device(t, device) for state in states for t in state]
    tensors = [s.to(device) for s in states]
    if reduce_fn is dim_zero_cat:
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in tensors])
    stacked = torch.stack(tensors)
    return reduce_fn(stacked) if reduce_fn is not None else stacked


SyncOnReadMetric = TorchMetric
