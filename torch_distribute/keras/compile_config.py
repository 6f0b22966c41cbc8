"""``compile``'s arguments, checked once (``CompileConfig``), and the checks of what ``compile`` builds.

``Model.compile`` makes a ``CompileConfig`` (which refuses a bad value before anything is
built), then builds the optimizer, the loss and the metrics (``build_compiled``) in the
model's strategy scope. The config is what ``Model.save`` records (``saved_arguments``: every
argument but the optimizer, which is saved with its state) and what ``load_model`` compiles
with again.

>>> config = CompileConfig(optimizer="sgd", loss="mse", steps_per_execution=4)
>>> config.compiles_steps, config.steps_per_execution
(False, 4)
>>> sorted(config.saved_arguments())[:3]
['auto_scale_loss', 'jit_compile', 'loss']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from torch_distribute import metrics as td_metrics
from torch_distribute.errors import ContextError, InvalidArgumentError, UnmirroredStateError
from torch_distribute.keras import optimizers as optimizers_module
from torch_distribute.keras.compile_utils import LossesContainer, MetricsContainer
from torch_distribute.keras.mixed_precision import Policy
from torch_distribute.mixed_precision import LossScaleOptimizer, check_autocast
from torch_distribute.strategies import Strategy, owner_of

__all__ = [
    "CompileConfig", "CompiledObjects", "OptimizerArgument", "build_compiled", "check_autocast_devices",
    "check_metric_owners", "check_run_modes", "make_optimizer",
]

# What ``compile(optimizer=...)`` takes: a name, a ``td.keras.optimizers`` spec, an optimizer
# made in the scope, a ``torch.optim`` class, or a factory called with the parameters.
OptimizerArgument = (str | optimizers_module.OptimizerSpec | torch.optim.Optimizer | LossScaleOptimizer
                     | Callable[[list[nn.Parameter]], torch.optim.Optimizer])


def check_run_modes(run_eagerly: object, jit_compile: object) -> bool:
    """``jit_compile`` resolved (``"auto"`` is ``False``, as on Keras' torch backend), after
    checking both values and that they do not contradict each other.

    >>> check_run_modes(False, "auto"), check_run_modes(False, True)
    (False, True)
    """
    if not isinstance(run_eagerly, bool):
        raise InvalidArgumentError(f"run_eagerly must be True or False, got {run_eagerly!r}.")
    if not (isinstance(jit_compile, bool) or (isinstance(jit_compile, str) and jit_compile == "auto")):
        raise InvalidArgumentError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}.")
    if run_eagerly and jit_compile is True:
        raise InvalidArgumentError(
            "run_eagerly=True and jit_compile=True contradict each other: run_eagerly=True runs the "
            "steps eagerly, jit_compile=True compiles them with td.function. Pick one."
        )
    return jit_compile is True


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """``Model.compile``'s arguments as given, checked when made (``InvalidArgumentError``).

    The fields and their defaults are ``compile``'s parameters (see ``Model.compile``).
    ``compiles_steps`` is ``jit_compile`` resolved (``"auto"`` is ``False``).

    >>> CompileConfig(run_eagerly=True).compiles_steps
    False
    >>> CompileConfig(steps_per_execution=0)
    Traceback (most recent call last):
    ...
    torch_distribute.errors.InvalidArgumentError: steps_per_execution must be a positive int, got 0.
    """

    optimizer: OptimizerArgument = "rmsprop"
    loss: object = None
    metrics: object = None
    loss_weights: Sequence[float] | dict[str, float] | None = None
    weighted_metrics: object = None
    steps_per_execution: int = 1
    auto_scale_loss: bool = True
    run_eagerly: bool = False
    jit_compile: bool | str = "auto"

    def __post_init__(self) -> None:
        check_run_modes(self.run_eagerly, self.jit_compile)
        spe = self.steps_per_execution
        if isinstance(spe, bool) or not isinstance(spe, int) or spe < 1:
            raise InvalidArgumentError(f"steps_per_execution must be a positive int, got {spe!r}.")
        if not isinstance(self.auto_scale_loss, bool):
            raise InvalidArgumentError(f"auto_scale_loss must be True or False, got {self.auto_scale_loss!r}.")

    @property
    def compiles_steps(self) -> bool:
        """Whether the train, test and predict steps run as ``td.function`` (``jit_compile=True``)."""
        return self.jit_compile is True

    def saved_arguments(self) -> dict[str, object]:
        """Every argument but the optimizer, by name: what ``Model.save`` records (the
        optimizer is saved with its state) and ``load_model`` passes back to ``compile``."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if field.name != "optimizer"}


@dataclasses.dataclass(frozen=True)
class CompiledObjects:
    """What ``compile`` builds from a ``CompileConfig``: the optimizer, the loss and the metrics,
    and the loss's trackers (the total, then one per output when there are several)."""

    optimizer: torch.optim.Optimizer | LossScaleOptimizer
    loss: LossesContainer
    metrics: MetricsContainer
    loss_tracker: td_metrics.Mean
    output_loss_trackers: list[td_metrics.Mean]


def build_compiled(config: CompileConfig, params: list[nn.Parameter], policy: Policy, strategy: Strategy,
                   model_name: str) -> CompiledObjects:
    """Build what ``config`` names, for a model with trainable ``params`` and dtype ``policy``
    (call it in the strategy's scope: the objects are made there). Under a policy that needs
    loss scaling, ``auto_scale_loss`` wraps the optimizer in a ``LossScaleOptimizer``."""
    optimizer = make_optimizer(config.optimizer, params, strategy, model_name)
    if config.auto_scale_loss and policy.needs_loss_scaling and not isinstance(optimizer, LossScaleOptimizer):
        optimizer = LossScaleOptimizer(optimizer)
    loss = LossesContainer(config.loss, config.loss_weights)
    loss_tracker = td_metrics.Mean(name="loss")
    output_loss_trackers = ([td_metrics.Mean(name=f"{name}_loss") for name in loss.output_names]
                            if loss.multi_output and len(loss.output_names) > 1 else [])
    metrics = MetricsContainer(config.metrics, config.weighted_metrics, loss)
    return CompiledObjects(optimizer, loss, metrics, loss_tracker, output_loss_trackers)


def make_optimizer(argument: OptimizerArgument, params: list[nn.Parameter], strategy: Strategy,
                   model_name: str) -> torch.optim.Optimizer | LossScaleOptimizer:
    """The optimizer ``compile(optimizer=argument)`` trains ``params`` with (call it in the
    strategy's scope); a ready optimizer must have been made in that scope."""
    if isinstance(argument, (torch.optim.Optimizer, LossScaleOptimizer)):
        inner = argument.inner_optimizer if isinstance(argument, LossScaleOptimizer) else argument
        if not strategy.is_default and owner_of(inner) is not strategy:
            raise UnmirroredStateError(
                f"The {type(argument).__name__} given to compile was created outside "
                f"{type(strategy).__name__}.scope(): gradients would not be summed across replicas. Create it "
                "inside the scope, or pass a name ('adam') or td.keras.optimizers.Adam(...) and compile "
                "creates it there."
            )
        return argument
    if not params:
        raise InvalidArgumentError(f"{model_name} has no trainable parameters to optimize.")
    if isinstance(argument, (str, optimizers_module.OptimizerSpec)) or not callable(argument):
        return optimizers_module.get(argument).build(params)  # raises with the valid names if not one
    built: object = argument(params)  # a torch.optim class, or a factory
    if not isinstance(built, torch.optim.Optimizer):
        raise InvalidArgumentError(f"The optimizer factory returned {type(built).__name__}, not a torch.optim optimizer.")
    return built


def check_autocast_devices(policy: Policy, strategy: Strategy, tensors: Iterable[torch.Tensor]) -> None:
    """Refuse a compute dtype the model's devices cannot autocast to (its replicas' devices
    under a strategy, else where its ``tensors`` are)."""
    dtype = policy.autocast_dtype
    if dtype is None:
        return
    if strategy.is_default:
        devices = {t.device.type for t in tensors} or {"cpu"}
    else:
        devices = {d.type for d in strategy.extended.replica_devices}
    for device_type in sorted(devices):
        check_autocast(device_type, dtype)


def check_metric_owners(metrics: Iterable[td_metrics.Metric], strategy: Strategy) -> None:
    """Refuse a metric made outside the model's strategy scope (one made under no strategy is
    fine only when the model's strategy is the default one)."""
    for metric in metrics:
        owner = owner_of(metric)
        if owner is not strategy and not (owner is None and strategy.is_default):
            raise ContextError(
                f"Metric {metric.name!r} was created outside the model's strategy scope; create it inside "
                f"`with strategy.scope():` or pass its name (e.g. 'accuracy') and compile makes it there."
            )
