"""Keras-named optimizers for ``compile``: made before the model's parameters are known.

``td.keras.optimizers.SGD(learning_rate=0.01)`` is a recipe; ``compile`` turns it into a
``torch.optim`` optimizer over the model's parameters *inside the model's strategy scope*,
so the optimizer belongs to the strategy (gradients summed across replicas). Strings use
Keras' default hyper-parameters (``"sgd"``: learning rate 0.01; ``"adam"``: 0.001 with
``epsilon=1e-7``...). A ready ``torch.optim`` optimizer made in the scope is used as is.

>>> import torch, torch_distribute as td
>>> spec = td.keras.optimizers.get("adam")
>>> spec.learning_rate
0.001
>>> optimizer = spec.build(torch.nn.Linear(2, 1).parameters())
>>> type(optimizer).__name__, optimizer.param_groups[0]["eps"]
('Adam', 1e-07)
>>> optimizer.learning_rate = 0.01  # as in Keras: every parameter group's ``lr``
>>> optimizer.param_groups[0]["lr"]
0.01
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torch_distribute.errors import InvalidArgumentError

__all__ = [
    "SGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "LearningRate", "Nadam", "OptimizerSpec", "RMSprop",
    "get", "keras_optimizer_class",
]


def _check_learning_rate(learning_rate: Any) -> float:
    if not isinstance(learning_rate, (int, float)) or isinstance(learning_rate, bool) or learning_rate < 0:
        raise InvalidArgumentError(f"learning_rate must be a number >= 0, got {learning_rate!r}.")
    return float(learning_rate)


class LearningRate:
    """Mixin for a ``torch.optim`` optimizer: Keras' ``optimizer.learning_rate``.

    Reading gives the first parameter group's ``lr``; assigning sets every group's ``lr``
    (an LR scheduler attached later keeps working from the new value).
    """

    param_groups: list[dict[str, Any]]

    @property
    def learning_rate(self) -> float:
        """The learning rate (``param_groups[0]["lr"]``); assign to change it in every group."""
        return self.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        value = _check_learning_rate(value)
        for group in self.param_groups:
            group["lr"] = value


_KERAS_CLASSES: dict[type, type] = {}


def keras_optimizer_class(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` with ``learning_rate`` (what ``compile`` builds from a name or a spec): a
    subclass named like ``cls`` in errors, importable (so models pickle and save) as
    ``torch_distribute.keras.optimizers.Keras<Name>``."""
    if issubclass(cls, LearningRate):
        return cls
    found = _KERAS_CLASSES.get(cls)
    if found is None:
        qualname = f"Keras{cls.__name__}"
        found = type(cls.__name__, (LearningRate, cls), {"__module__": __name__, "__qualname__": qualname})
        if qualname in globals():
            raise InvalidArgumentError(f"Two optimizer classes named {cls.__name__}; name them apart.")
        globals()[qualname] = found
        _KERAS_CLASSES[cls] = found
    return found


class OptimizerSpec:
    """A ``torch.optim`` class and its arguments, built over parameters by ``compile``."""

    def __init__(self, cls: type[torch.optim.Optimizer], learning_rate: float, name: str, **kwargs: Any):
        self.cls = cls
        self.learning_rate = _check_learning_rate(learning_rate)
        self.name = name
        self.kwargs = kwargs

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        # Every torch.optim optimizer takes lr; their base class's __init__ (params, defaults) does not.
        return keras_optimizer_class(self.cls)(params, lr=self.learning_rate, **self.kwargs)  # type: ignore[call-arg]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}(learning_rate={self.learning_rate}{', ' + args if args else ''})"


def SGD(learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0) -> OptimizerSpec:
    """Keras' ``SGD``: ``torch.optim.SGD``."""
    return OptimizerSpec(torch.optim.SGD, learning_rate, "SGD", momentum=momentum, nesterov=nesterov,
                         weight_decay=weight_decay)


def Adam(learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7,
         amsgrad: bool = False) -> OptimizerSpec:
    """Keras' ``Adam``: ``torch.optim.Adam`` with Keras' ``epsilon=1e-7``."""
    return OptimizerSpec(torch.optim.Adam, learning_rate, "Adam", betas=(beta_1, beta_2), eps=epsilon, amsgrad=amsgrad)


def AdamW(learning_rate: float = 0.001, weight_decay: float = 0.004, beta_1: float = 0.9, beta_2: float = 0.999,
          epsilon: float = 1e-7, amsgrad: bool = False) -> OptimizerSpec:
    """Keras' ``AdamW`` (decoupled weight decay 0.004 by default)."""
    return OptimizerSpec(torch.optim.AdamW, learning_rate, "AdamW", weight_decay=weight_decay,
                         betas=(beta_1, beta_2), eps=epsilon, amsgrad=amsgrad)


def Adamax(learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7) -> OptimizerSpec:
    """Keras' ``Adamax``: ``torch.optim.Adamax`` with Keras' defaults."""
    return OptimizerSpec(torch.optim.Adamax, learning_rate, "Adamax", betas=(beta_1, beta_2), eps=epsilon)


def Nadam(learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7) -> OptimizerSpec:
    """Keras' ``Nadam``: ``torch.optim.NAdam`` with Keras' defaults."""
    return OptimizerSpec(torch.optim.NAdam, learning_rate, "Nadam", betas=(beta_1, beta_2), eps=epsilon)


def RMSprop(learning_rate: float = 0.001, rho: float = 0.9, momentum: float = 0.0, epsilon: float = 1e-7,
            centered: bool = False) -> OptimizerSpec:
    """Keras' ``RMSprop`` (``rho`` is torch's ``alpha``)."""
    return OptimizerSpec(torch.optim.RMSprop, learning_rate, "RMSprop", alpha=rho, momentum=momentum, eps=epsilon,
                         centered=centered)


def Adagrad(learning_rate: float = 0.001, initial_accumulator_value: float = 0.1, epsilon: float = 1e-7) -> OptimizerSpec:
    """Keras' ``Adagrad``: ``torch.optim.Adagrad`` with Keras' defaults."""
    return OptimizerSpec(torch.optim.Adagrad, learning_rate, "Adagrad",
                         initial_accumulator_value=initial_accumulator_value, eps=epsilon)


def Adadelta(learning_rate: float = 0.001, rho: float = 0.95, epsilon: float = 1e-7) -> OptimizerSpec:
    """Keras' ``Adadelta``: ``torch.optim.Adadelta`` with Keras' defaults."""
    return OptimizerSpec(torch.optim.Adadelta, learning_rate, "Adadelta", rho=rho, eps=epsilon)


_FACTORIES: dict[str, Callable[..., OptimizerSpec]] = {
    "sgd": SGD,
    "adam": Adam,
    "adamw": AdamW,
    "adamax": Adamax,
    "nadam": Nadam,
    "rmsprop": RMSprop,
    "adagrad": Adagrad,
    "adadelta": Adadelta,
}


for _cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
             torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta):
    keras_optimizer_class(_cls)  # defined at import, so unpickling finds them


def names() -> list[str]:
    return sorted(_FACTORIES)


def get(identifier: str | OptimizerSpec, learning_rate: float | None = None) -> OptimizerSpec:
    """An ``OptimizerSpec`` from a name (any case) or a spec; ``learning_rate`` overrides the default.

    >>> import torch_distribute as td
    >>> td.keras.optimizers.get("SGD", learning_rate=0.2)
    SGD(learning_rate=0.2, momentum=0.0, nesterov=False, weight_decay=0.0)
    """
    if isinstance(identifier, OptimizerSpec):
        return identifier
    if not isinstance(identifier, str):
        raise InvalidArgumentError(
            f"optimizer must be a name, a td.keras.optimizers spec, a torch.optim optimizer made in "
            f"the strategy scope, or a function params -> optimizer; got {type(identifier).__name__}."
        )
    factory = _FACTORIES.get(identifier.lower())
    if factory is None:
        raise InvalidArgumentError(
            f"Unknown optimizer {identifier!r}. Valid names: {', '.join(names())}; or pass "
            "td.keras.optimizers.Adam(learning_rate=...) or a torch.optim optimizer."
        )
    return factory() if learning_rate is None else factory(learning_rate=learning_rate)
