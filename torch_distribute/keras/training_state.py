"""What ``compile`` and ``fit`` give a ``td.keras.Model``, declared once (``TrainingState``).

A model holds one ``TrainingState`` (``model.training_state``): made fresh by the model's
constructor, replaced by a fresh one when the model is pickled (a pickled model is the plain,
uncompiled model), and deep-copied with it. The Keras attributes (``model.optimizer``,
``model.history``, ``model.stop_training``...) read and write its fields through
``TrainingField``.

>>> state = TrainingState()
>>> state.compiled, state.steps_per_execution, state.output_loss_trackers
(False, 1, [])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, overload

import torch

from torch_distribute import metrics as td_metrics
from torch_distribute.keras.callbacks.history import History
from torch_distribute.keras.compile_config import CompileConfig, CompiledObjects, check_run_modes
from torch_distribute.keras.compile_utils import LossesContainer, MetricsContainer
from torch_distribute.keras.replica_steps import ReplicaSteps, StepFunction
from torch_distribute.mixed_precision import LossScaleOptimizer

__all__ = ["TrainingField", "TrainingState"]

Value = TypeVar("Value")


@dataclasses.dataclass
class TrainingState:
    """Everything a model gains from ``compile`` and ``fit``, with the values of a new model.

    ``compile_config`` is ``compile``'s checked arguments (what ``save`` records);
    ``run_eagerly``/``jit_compile`` start from them and follow the model's setters;
    ``class_weight`` is ``fit``'s table of weights by class id; the ``*_function`` fields are
    what ``fit``/``evaluate``/``predict`` call for each batch (made on first use, dropped by
    ``compile`` and by a change of run mode).

    >>> TrainingState(steps_per_execution=4).steps_per_execution
    4
    """

    optimizer: torch.optim.Optimizer | LossScaleOptimizer | None = None
    compiled: bool = False
    compile_config: CompileConfig | None = None
    compiled_loss: LossesContainer | None = None
    compiled_metrics: MetricsContainer | None = None
    loss_tracker: td_metrics.Mean | None = None
    output_loss_trackers: list[td_metrics.Mean] = dataclasses.field(default_factory=list)
    steps_per_execution: int = 1
    run_eagerly: bool = False
    jit_compile: bool = False
    class_weight: torch.Tensor | None = None
    history: History | None = None
    stop_training: bool = False
    train_function: StepFunction | None = None
    test_function: StepFunction | None = None
    predict_function: StepFunction | None = None

    @property
    def metrics(self) -> list[td_metrics.Metric]:
        """The loss tracker(s) then the compiled metrics; none before ``compile``."""
        if not self.compiled or self.loss_tracker is None or self.compiled_metrics is None:
            return []
        return [self.loss_tracker, *self.output_loss_trackers, *self.compiled_metrics.metrics]

    def replica_steps(self, model: Callable[..., object]) -> ReplicaSteps:
        """The steps ``strategy.run`` distributes: ``model`` with what ``compile`` and ``fit`` set."""
        return ReplicaSteps(model, self.optimizer, self.compiled_loss, self.compiled_metrics, self.loss_tracker,
                            self.output_loss_trackers, self.class_weight)

    def take_compiled(self, config: CompileConfig, built: CompiledObjects) -> None:
        """Hold what ``compile`` built from ``config``, in the run modes it asks for."""
        self.optimizer, self.compiled_loss, self.compiled_metrics = built.optimizer, built.loss, built.metrics
        self.loss_tracker, self.output_loss_trackers = built.loss_tracker, built.output_loss_trackers
        self.steps_per_execution = config.steps_per_execution
        self.set_run_modes(config.run_eagerly, config.jit_compile)
        self.compile_config, self.compiled = config, True

    def set_run_modes(self, run_eagerly: bool, jit_compile: bool | str) -> None:
        """Set ``run_eagerly`` and ``jit_compile`` (``"auto"`` is ``False``) once checked
        (``check_run_modes``), and drop the step functions made for the old ones."""
        self.jit_compile = check_run_modes(run_eagerly, jit_compile)
        self.run_eagerly = run_eagerly
        self.drop_step_functions()

    def drop_step_functions(self) -> None:
        """Forget the step functions: the next ``fit``/``evaluate``/``predict`` makes them anew."""
        self.train_function = self.test_function = self.predict_function = None


_FIELDS = frozenset(field.name for field in dataclasses.fields(TrainingState))


class HoldsTrainingState(Protocol):
    """An object with a ``training_state`` (``td.keras.Model``)."""

    training_state: TrainingState


class TrainingField(Generic[Value]):
    """A class attribute that reads and writes the ``TrainingState`` field of the same name.

    >>> class Holder:
    ...     steps_per_execution = TrainingField[int]()
    ...     def __init__(self):
    ...         self.training_state = TrainingState()
    >>> holder = Holder()
    >>> holder.steps_per_execution = 8
    >>> holder.training_state.steps_per_execution
    8
    """

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in _FIELDS:
            raise TypeError(f"{owner.__name__}.{name}: TrainingState has no field {name!r}.")
        self.name = name

    @overload
    def __get__(self, holder: None, owner: type) -> TrainingField[Value]: ...

    @overload
    def __get__(self, holder: HoldsTrainingState, owner: type) -> Value: ...

    def __get__(self, holder: HoldsTrainingState | None, owner: type) -> TrainingField[Value] | Value:
        if holder is None:
            return self
        value: Value = getattr(holder.training_state, self.name)
        return value

    def __set__(self, holder: HoldsTrainingState, value: Value) -> None:
        setattr(holder.training_state, self.name, value)
