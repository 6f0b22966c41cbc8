"""Keras losses, as per-sample functions, and the strings ``compile(loss=...)`` accepts.

Each loss gives one value per sample (Keras reduces the last axis, then any other non-batch
axes are averaged here), so ``fit`` can divide the sum over a replica's rows by the *global*
batch size: the same number on one device and on any number of replicas.

Probabilities versus logits follow Keras: ``"sparse_categorical_crossentropy"`` expects
probabilities (a softmax output, as ``MobileNetV2(classifier_activation="softmax")``
produces); a PyTorch module that returns logits wants
``SparseCategoricalCrossentropy(from_logits=True)``. A ``torch.nn`` loss module
(``nn.CrossEntropyLoss()``, ``nn.MSELoss()``) is accepted as it is, called as
``loss(y_pred, y_true)`` with ``reduction="none"``.

>>> import torch, torch_distribute as td
>>> mse = td.keras.losses.get("mse")
>>> mse(torch.tensor([[1.0], [3.0]]), torch.tensor([[2.0], [3.0]]))
tensor(0.5000)
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torch_distribute.errors import InvalidArgumentError
from torch_distribute.keras.probability_check import ProbabilityCheck

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "KLDivergence",
    "Loss",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredError",
    "MeanSquaredLogarithmicError",
    "Poisson",
    "ProbabilityLoss",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "TorchLoss",
    "align_ranks",
    "get",
    "per_sample",
]

EPSILON = 1e-7  # Keras' backend.epsilon(): probabilities are clipped to [eps, 1 - eps]


# -- shapes ------------------------------------------------------------------------------------
def align_ranks(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keras' ``squeeze_or_expand_to_same_rank``, and ``y_true`` cast to ``y_pred``'s dtype."""
    y_true = torch.as_tensor(y_true, device=y_pred.device)
    if y_true.dim() == y_pred.dim() + 1 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    elif y_pred.dim() == y_true.dim() + 1:  # Keras: (B,) targets of (B, k) predictions broadcast
        y_true = y_true.unsqueeze(-1)
    return y_true.to(y_pred.dtype), y_pred


def per_sample(values: torch.Tensor) -> torch.Tensor:
    """Mean over every non-batch axis: one value per row (a 1-D tensor stays as it is)."""
    if values.dim() <= 1:
        return values
    return values.flatten(1).mean(1)  # also for a replica with 0 rows


# -- the loss functions (per element, last axis reduced as in Keras) ----------------------------
def mean_squared_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    y_true, y_pred = align_ranks(y_true, y_pred)
    return torch.square(y_pred - y_true).mean(-1)


def mean_absolute_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    y_true, y_pred = align_ranks(y_true, y_pred)
    return torch.abs(y_pred - y_true).mean(-1)


def mean_absolute_percentage_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    y_true, y_pred = align_ranks(y_true, y_pred)
    return 100.0 * (torch.abs(y_true - y_pred) / torch.abs(y_true).clamp_min(EPSILON)).mean(-1)


def mean_squared_logarithmic_error(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    y_true, y_pred = align_ranks(y_true, y_pred)
    first = torch.log(y_pred.clamp_min(EPSILON) + 1.0)
    second = torch.log(y_true.clamp_min(EPSILON) + 1.0)
    return torch.square(first - second).mean(-1)


def huber(y_true: torch.Tensor, y_pred: torch.Tensor, delta: float = 1.0) -> torch.Tensor:
    y_true, y_pred = align_ranks(y_true, y_pred)
    return F.huber_loss(y_pred, y_true, reduction="none", delta=delta).mean(-1)


def kl_divergence(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    y_true, y_pred = align_ranks(y_true, y_pred)
    y_true, y_pred = y_true.clamp(EPSILON, 1.0), y_pred.clamp(EPSILON, 1.0)
    return (y_true * torch.log(y_true / y_pred)).sum(-1)


def poisson(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    y_true, y_pred = align_ranks(y_true, y_pred)
    return (y_pred - y_true * torch.log(y_pred + EPSILON)).mean(-1)


def binary_crossentropy(
    y_true: torch.Tensor, y_pred: torch.Tensor, from_logits: bool = False, label_smoothing: float = 0.0
) -> torch.Tensor:
    y_true, y_pred = align_ranks(y_true, y_pred)
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + 0.5 * label_smoothing
    if from_logits:
        values = F.binary_cross_entropy_with_logits(y_pred, y_true, reduction="none")
    else:
        p = y_pred.clamp(EPSILON, 1.0 - EPSILON)
        values = -(y_true * torch.log(p) + (1.0 - y_true) * torch.log(1.0 - p))
    return values.mean(-1)


def _log_probabilities(y_pred: torch.Tensor, from_logits: bool) -> torch.Tensor:
    if from_logits:
        return F.log_softmax(y_pred, dim=-1)
    # Keras normalises the probabilities, then clips them away from 0 and 1.
    probabilities = y_pred / y_pred.sum(-1, keepdim=True)
    return torch.log(probabilities.clamp(EPSILON, 1.0 - EPSILON))


def categorical_crossentropy(
    y_true: torch.Tensor, y_pred: torch.Tensor, from_logits: bool = False, label_smoothing: float = 0.0
) -> torch.Tensor:
    y_true = torch.as_tensor(y_true, device=y_pred.device).to(y_pred.dtype)
    if y_true.shape != y_pred.shape:
        raise InvalidArgumentError(
            f"categorical_crossentropy needs one-hot targets of the predictions' shape "
            f"{tuple(y_pred.shape)}, got {tuple(y_true.shape)}; for integer class ids use "
            "'sparse_categorical_crossentropy'."
        )
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + label_smoothing / y_pred.shape[-1]
    return -(y_true * _log_probabilities(y_pred, from_logits)).sum(-1)


def sparse_categorical_crossentropy(
    y_true: torch.Tensor, y_pred: torch.Tensor, from_logits: bool = False, ignore_class: int | None = None
) -> torch.Tensor:
    y_true = torch.as_tensor(y_true, device=y_pred.device)
    if y_true.dim() == y_pred.dim() and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    if y_true.shape != y_pred.shape[:-1]:
        raise InvalidArgumentError(
            f"sparse_categorical_crossentropy needs integer class ids of shape "
            f"{tuple(y_pred.shape[:-1])} (or with a trailing 1) for predictions of shape "
            f"{tuple(y_pred.shape)}, got {tuple(y_true.shape)}; for one-hot targets use "
            "'categorical_crossentropy'."
        )
    labels = y_true.long()
    keep = None
    if ignore_class is not None:
        keep = labels != ignore_class
        labels = torch.where(keep, labels, torch.zeros_like(labels))
    values = -_log_probabilities(y_pred, from_logits).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return values * keep if keep is not None else values


# -- loss objects --------------------------------------------------------------------------------
class Reduction:
    """The values of a loss's ``reduction=`` (TensorFlow's ``tf.keras.losses.Reduction``)."""

    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"  # the weighted sum divided by the number of rows
    SUM = "sum"  # the weighted sum
    NONE = "none"  # one (weighted) loss per row
    AUTO = "auto"  # TensorFlow's default: sum_over_batch_size

    @classmethod
    def check(cls, reduction: Any) -> str:
        """``reduction`` as one of the three names (``"auto"`` is ``"sum_over_batch_size"``,
        ``None`` is ``"none"``, as in Keras 3), else ``InvalidArgumentError``."""
        if reduction is None:
            return cls.NONE
        if reduction == cls.AUTO:
            return cls.SUM_OVER_BATCH_SIZE
        if reduction not in (cls.SUM_OVER_BATCH_SIZE, cls.SUM, cls.NONE):
            raise InvalidArgumentError(
                f"reduction must be 'sum_over_batch_size' (the default), 'sum' or 'none', got {reduction!r}.")
        return reduction


def _takes_reduction(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` that also takes ``reduction=`` (set after the outermost constructor ran)."""

    @functools.wraps(init)
    def __init__(self: Loss, *args: Any, reduction: Any = Reduction.SUM_OVER_BATCH_SIZE, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.reduction = Reduction.check(reduction)

    return __init__


class Loss:
    """Base class: ``per_sample(y_true, y_pred)`` gives one loss per row.

    Calling the loss reduces the (weighted) rows as ``reduction=`` says, a keyword every loss
    takes: ``"sum_over_batch_size"`` (the default: the mean over the batch), ``"sum"`` or
    ``"none"`` (one value per row, for custom loops with ``td.compute_average_loss``).
    ``compile``/``fit`` average over the *global* batch themselves and need the default.

    >>> import torch, torch_distribute as td
    >>> loss = td.keras.losses.MeanSquaredError(reduction="none")
    >>> loss(torch.zeros(2, 1), torch.tensor([[1.0], [2.0]]))
    tensor([1., 4.])
    """

    name = "loss"
    from_logits = False
    reduction = Reduction.SUM_OVER_BATCH_SIZE

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            setattr(cls, "__init__", _takes_reduction(cls.__dict__["__init__"]))  # noqa: B010 (see Model)

    def per_sample(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def __call__(self, y_true: Any, y_pred: torch.Tensor, sample_weight: Any = None) -> torch.Tensor:
        values = self.per_sample(y_true, y_pred)
        if sample_weight is not None:
            values = values * torch.as_tensor(sample_weight, dtype=values.dtype, device=values.device).reshape(-1)
        if self.reduction == Reduction.NONE:
            return values
        if self.reduction == Reduction.SUM:
            return values.sum()
        return values.sum() / max(values.shape[0], 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class LossFunctionWrapper(Loss):
    """A loss from a function ``fn(y_true, y_pred, **kwargs)`` returning per-element values.

    >>> import torch, torch_distribute as td
    >>> loss = td.keras.losses.LossFunctionWrapper(lambda t, p: (p - t).abs(), name="l1")
    >>> loss.per_sample(torch.zeros(2, 3), torch.ones(2, 3))
    tensor([1., 1.])
    """

    def __init__(self, fn: Callable[..., torch.Tensor], name: str | None = None, **kwargs: Any):
        self.fn = fn
        self.name = name or str(getattr(fn, "__name__", "loss"))
        self.kwargs = kwargs
        self.from_logits = bool(kwargs.get("from_logits", False))

    def per_sample(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return per_sample(self.fn(y_true, y_pred, **self.kwargs))


class MeanSquaredError(LossFunctionWrapper):
    """Keras' ``MeanSquaredError``: the mean of ``(y_true - y_pred) ** 2`` over the last axis, per sample."""

    def __init__(self, name: str = "mean_squared_error"):
        super().__init__(mean_squared_error, name=name)


class MeanAbsoluteError(LossFunctionWrapper):
    """Keras' ``MeanAbsoluteError``: the mean of ``|y_true - y_pred|`` over the last axis, per sample."""

    def __init__(self, name: str = "mean_absolute_error"):
        super().__init__(mean_absolute_error, name=name)


class MeanAbsolutePercentageError(LossFunctionWrapper):
    """Keras' ``MeanAbsolutePercentageError``: ``100 * mean(|y_true - y_pred| / |y_true|)``, per sample."""

    def __init__(self, name: str = "mean_absolute_percentage_error"):
        super().__init__(mean_absolute_percentage_error, name=name)


class MeanSquaredLogarithmicError(LossFunctionWrapper):
    """Keras' ``MeanSquaredLogarithmicError``: the mean of ``(log1p(y_true) - log1p(y_pred)) ** 2``, per sample."""

    def __init__(self, name: str = "mean_squared_logarithmic_error"):
        super().__init__(mean_squared_logarithmic_error, name=name)


class Huber(LossFunctionWrapper):
    """Keras' ``Huber`` loss: quadratic for errors up to ``delta``, linear beyond, per sample."""

    def __init__(self, delta: float = 1.0, name: str = "huber_loss"):
        super().__init__(huber, name=name, delta=delta)


class KLDivergence(LossFunctionWrapper):
    """Keras' ``KLDivergence``: ``sum(y_true * log(y_true / y_pred))`` over the last axis, per sample."""

    def __init__(self, name: str = "kl_divergence"):
        super().__init__(kl_divergence, name=name)


class Poisson(LossFunctionWrapper):
    """Keras' ``Poisson`` loss: the mean of ``y_pred - y_true * log(y_pred)``, per sample."""

    def __init__(self, name: str = "poisson"):
        super().__init__(poisson, name=name)


class ProbabilityLoss(LossFunctionWrapper):
    """A cross-entropy whose ``from_logits=False`` form warns once when its first predictions
    are not probabilities (``probability_check.py``): they are logits, given without
    ``from_logits=True``."""

    categorical = True  # predictions sum to 1 along the class axis

    def __init__(self, fn: Callable[..., torch.Tensor], name: str, **kwargs: Any):
        super().__init__(fn, name=name, **kwargs)
        self.probability_check = ProbabilityCheck(type(self).__name__, name, self.categorical)

    def per_sample(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if not self.kwargs.get("from_logits"):
            self.probability_check(y_pred)
        return super().per_sample(y_true, y_pred)


class BinaryCrossentropy(ProbabilityLoss):
    """Binary cross-entropy; ``from_logits=True`` for raw scores (no sigmoid)."""

    categorical = False

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, name: str = "binary_crossentropy"):
        super().__init__(binary_crossentropy, name=name, from_logits=from_logits, label_smoothing=label_smoothing)


class CategoricalCrossentropy(ProbabilityLoss):
    """Cross-entropy with one-hot targets; ``from_logits=True`` for raw scores."""

    def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0, name: str = "categorical_crossentropy"):
        super().__init__(categorical_crossentropy, name=name, from_logits=from_logits, label_smoothing=label_smoothing)


class SparseCategoricalCrossentropy(ProbabilityLoss):
    """Cross-entropy with integer class ids; ``from_logits=True`` for raw scores.

    >>> import torch, torch_distribute as td
    >>> loss = td.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    >>> round(float(loss(torch.tensor([0]), torch.tensor([[0.0, 0.0]]))), 4)
    0.6931
    """

    def __init__(self, from_logits: bool = False, ignore_class: int | None = None,
                 name: str = "sparse_categorical_crossentropy"):
        super().__init__(sparse_categorical_crossentropy, name=name, from_logits=from_logits,
                         ignore_class=ignore_class)


class TorchLoss(Loss):
    """A ``torch.nn`` loss module (``nn.CrossEntropyLoss()``...), called ``(y_pred, y_true)``.

    The module is copied with ``reduction="none"`` so each row keeps its own loss.
    """

    def __init__(self, module: nn.Module):
        self.module = copy.deepcopy(module)
        # torch's losses keep `reduction` as a plain str attribute; nn.Module's stubs type
        # attributes they do not know as Tensor | Module.
        self.module.reduction = "none"  # type: ignore[assignment]
        self.name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", type(module).__name__).lower()
        self.from_logits = isinstance(module, (nn.CrossEntropyLoss, nn.BCEWithLogitsLoss))

    def per_sample(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if isinstance(self.module, (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss,
                                    nn.BCELoss, nn.BCEWithLogitsLoss)):
            y_true, y_pred = align_ranks(y_true, y_pred)
        return per_sample(self.module(y_pred, y_true))


_FACTORIES: dict[str, Callable[[], Loss]] = {
    "mean_squared_error": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mean_absolute_percentage_error": MeanAbsolutePercentageError,
    "mean_squared_logarithmic_error": MeanSquaredLogarithmicError,
    "huber": Huber,
    "kl_divergence": KLDivergence,
    "poisson": Poisson,
    "binary_crossentropy": BinaryCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
}
_ALIASES = {
    "mse": "mean_squared_error",
    "mae": "mean_absolute_error",
    "mape": "mean_absolute_percentage_error",
    "msle": "mean_squared_logarithmic_error",
    "huber_loss": "huber",
    "kld": "kl_divergence",
    "kullback_leibler_divergence": "kl_divergence",
    "bce": "binary_crossentropy",
}
_CLASS_NAMES = {cls.__name__: name for name, cls in _FACTORIES.items() if isinstance(cls, type)}


def names() -> list[str]:
    """Every string ``get`` accepts."""
    return sorted([*_FACTORIES, *_ALIASES])


def get(identifier: str | Loss | nn.Module | Callable[..., torch.Tensor]) -> Loss:
    """A loss from a string (``"mse"``, ``"sparse_categorical_crossentropy"``...), a ``Loss``,
    a ``torch.nn`` loss module, or a function ``fn(y_true, y_pred)`` of per-element values.

    >>> import torch_distribute as td
    >>> td.keras.losses.get("sparse_categorical_crossentropy")
    SparseCategoricalCrossentropy(name='sparse_categorical_crossentropy')
    """
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, nn.Module):
        if not isinstance(identifier, nn.modules.loss._Loss):
            raise InvalidArgumentError(
                f"loss={type(identifier).__name__}(...) is a module but not a torch.nn loss; pass "
                "a loss name, a td.keras.losses object, an nn loss module or a function "
                "fn(y_true, y_pred)."
            )
        return TorchLoss(identifier)
    if isinstance(identifier, str):
        key = identifier if identifier in _FACTORIES else _ALIASES.get(identifier.lower(), identifier.lower())
        key = _CLASS_NAMES.get(identifier, key)
        if key not in _FACTORIES:
            raise InvalidArgumentError(
                f"Unknown loss {identifier!r}. Valid names: {', '.join(names())}. Or pass a "
                "td.keras.losses object (e.g. SparseCategoricalCrossentropy(from_logits=True)), "
                "a torch.nn loss module or a function fn(y_true, y_pred)."
            )
        return _FACTORIES[key]()
    if isinstance(identifier, type):
        raise InvalidArgumentError(
            f"loss={identifier.__name__} is a class; pass an instance, e.g. loss={identifier.__name__}()."
        )
    if callable(identifier):
        return LossFunctionWrapper(identifier)
    raise InvalidArgumentError(
        f"loss must be a string, a td.keras.losses.Loss, a torch.nn loss or a function, got "
        f"{type(identifier).__name__}."
    )
