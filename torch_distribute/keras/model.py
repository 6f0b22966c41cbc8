"""``td.keras.Model``: Keras' ``compile``/``fit``/``evaluate``/``predict`` for any ``nn.Module``.

Create the model in a strategy's scope and ``fit`` distributes by itself: each global batch
is cut over the replicas (and workers), every replica's loss is its rows' share of the mean
over the *global* batch, gradients are summed in ``optimizer.step()``, metrics are
sync-on-read, validation runs on every replica, and only the chief prints and writes. The
numbers are those of one device, whatever the strategy.

>>> import torch, torch_distribute as td
>>> strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
>>> with strategy.scope():
...     model = td.keras.Model(torch.nn.Linear(1, 1))
>>> model.compile(optimizer="sgd", loss="mse")
>>> x = torch.ones(100, 1)
>>> history = model.fit(x, x, batch_size=10, epochs=2, verbose=0)
>>> sorted(history.history), len(history.history["loss"])
(['loss'], 2)
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from torch_distribute import context
from torch_distribute import metrics as td_metrics
from torch_distribute.errors import ContextError, InvalidArgumentError
from torch_distribute.keras import model_saving, model_summary, ps_loops, training_loops
from torch_distribute.keras.callbacks.base import Callback
from torch_distribute.keras.callbacks.history import History
from torch_distribute.keras.compile_config import (
    CompileConfig,
    OptimizerArgument,
    build_compiled,
    check_autocast_devices,
    check_metric_owners,
)
from torch_distribute.keras.compile_utils import LossesContainer, MetricsContainer
from torch_distribute.keras.mixed_precision import Policy, call_under_policy, global_policy
from torch_distribute.keras.model_strategy import (
    adopt,
    check_called_in_scope,
    owning_strategy,
    scope_of,
)
from torch_distribute.keras.replica_steps import StepFunction, step_function
from torch_distribute.keras.training_state import TrainingField, TrainingState
from torch_distribute.mixed_precision import LossScaleOptimizer
from torch_distribute.strategies import Strategy, owner_of
from torch_distribute.strategies.interception import capture_module

__all__ = ["Model", "NotCompiledError"]

_M = TypeVar("_M", bound="Model")


class NotCompiledError(ContextError):
    """``fit``/``evaluate`` before ``compile``."""


class Model(nn.Module):
    """An ``nn.Module`` with Keras' training API; wrap a module or subclass and define ``forward``.

    ``Model(module)`` calls ``module`` in ``forward``; the model belongs to the strategy whose
    scope its parameters were made in (``distribute_strategy``). ``self.module`` is the
    wrapped module: its ``state_dict`` is what ``save_weights`` writes, so the files load
    into the bare module. What ``compile`` and ``fit`` set is one ``TrainingState``
    (``training_state``); ``optimizer``, ``history``, ``stop_training``... are its fields.

    >>> import torch, torch_distribute as td
    >>> class TwoLayers(td.keras.Model):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.hidden, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
    ...     def forward(self, x):
    ...         return self.out(torch.relu(self.hidden(x)))
    >>> model = TwoLayers()
    >>> model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=0.01),
    ...               loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ...               metrics=["accuracy"])
    >>> model.metrics_names
    ['loss', 'accuracy']
    """

    _constructor_arguments: tuple[tuple[object, ...], dict[str, object]]
    optimizer = TrainingField[torch.optim.Optimizer | LossScaleOptimizer | None]()
    compiled = TrainingField[bool]()
    compiled_loss = TrainingField[LossesContainer | None]()
    compiled_metrics = TrainingField[MetricsContainer | None]()
    steps_per_execution = TrainingField[int]()
    history = TrainingField[History | None]()
    stop_training = TrainingField[bool]()
    train_function = TrainingField[StepFunction | None]()
    test_function = TrainingField[StepFunction | None]()
    predict_function = TrainingField[StepFunction | None]()

    def __new__(cls: type[_M], *args: object, **kwargs: object) -> _M:
        # What save() rebuilds the model from: the outermost constructor call's arguments.
        self = super().__new__(cls)
        self._constructor_arguments = (args, kwargs)
        return self

    def __init__(self, module: nn.Module | None = None, name: str | None = None, dtype: Policy | str | None = None):
        super().__init__()
        self.dtype_policy = global_policy() if dtype is None else Policy(dtype)
        if module is not None:
            adopt(module)
        self.module = module
        self.name = name or (type(module).__name__ if module is not None else type(self).__name__)
        # The scope we are made in; the parameters' owner wins when they say otherwise.
        self._strategy = cast(Strategy, (owner_of(module) if module is not None else None) or context.get_strategy())
        self.training_state = TrainingState()

    @property
    def constructor_arguments(self) -> tuple[tuple[object, ...], dict[str, object]]:
        """``(args, kwargs)`` of the constructor call that made this model (what ``save``
        records to rebuild it; a class's ``get_config()`` takes precedence)."""
        return self._constructor_arguments

    # -- pickling -----------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, object]:
        """Pickling (``torch.save(model)``, ``pickle``) keeps the plain model: its architecture,
        its weights (under a strategy, the values the user holds: replica 0's, the same on
        every replica) and its dtype policy; not the strategy, nor ``compile``'s state (the
        optimizer, losses, metrics), nor the ``history``. ``model.save`` keeps those."""
        return {**self.__dict__, "_strategy": None, "training_state": TrainingState()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled inside ``strategy.scope()``, the model is mirrored there as if made there."""
        super().__setstate__(state)
        capture_module(self)
        self._strategy = cast(Strategy, context.get_strategy())

    def __deepcopy__(self: _M, memo: dict[int, object]) -> _M:
        # A deep copy is an ordinary one (not a pickle round trip): it shares the strategy.
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        memo.setdefault(id(self._strategy), self._strategy)
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_under_policy(self.dtype_policy, super().__call__, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no forward(): subclass td.keras.Model and define forward, "
                "or wrap a module: td.keras.Model(module)."
            )
        return self.module(*args, **kwargs)

    # -- the strategy --------------------------------------------------------------------------
    @property
    def distribute_strategy(self) -> Strategy:
        """The strategy the model belongs to (its parameters were made in its scope)."""
        return self._strategy

    def _resolve_strategy(self) -> Strategy:
        """The model's strategy, checked for this call (see ``keras.model_strategy``)."""
        strategy = self._strategy = owning_strategy(self.name, self._strategy, [*self.parameters(), *self.buffers()])
        check_called_in_scope(self.name, strategy)
        return strategy

    # -- compile ---------------------------------------------------------------------------------
    def compile(
        self,
        optimizer: OptimizerArgument = "rmsprop",
        loss: object = None,
        metrics: object = None,
        loss_weights: Sequence[float] | dict[str, float] | None = None,
        weighted_metrics: object = None,
        steps_per_execution: int = 1,
        auto_scale_loss: bool = True,
        run_eagerly: bool = False,
        jit_compile: bool | str = "auto",
    ) -> None:
        """Choose the optimizer, the loss and the metrics (strings, objects or functions).

        Objects are made in the model's strategy scope (the scope is re-entered here), so an
        ``optimizer="adam"`` sums gradients across replicas. ``steps_per_execution``: run that
        many steps between two calls of the batch callbacks (under ``ParameterServerStrategy``,
        the steps of one scheduled function). ``auto_scale_loss``: under the
        ``"mixed_float16"`` policy, wrap the optimizer in a ``LossScaleOptimizer`` (as Keras
        does).

        ``jit_compile``: ``True`` compiles the train, test and predict steps: the function that
        calls ``strategy.run`` for a batch is a ``td.function`` (``model.train_function``,
        ``test_function``, ``predict_function``), so each replica's step is compiled once per
        replica, with graph breaks around ``optimizer.step()``; ``"auto"`` (the default) is
        ``False`` as on Keras' torch backend: the steps run eagerly. ``run_eagerly=True`` forbids
        compiling; with ``jit_compile=True`` it raises (pick one).
        """
        config = CompileConfig(optimizer, loss, metrics, loss_weights, weighted_metrics, steps_per_execution,
                               auto_scale_loss, run_eagerly, jit_compile)
        strategy = self._resolve_strategy()
        check_autocast_devices(self.dtype_policy, strategy, [*self.parameters(), *self.buffers()])
        with scope_of(strategy):
            built = build_compiled(config, [p for p in self.parameters() if p.requires_grad], self.dtype_policy,
                                   strategy, self.name)
        check_metric_owners(built.metrics.metrics, strategy)
        self.training_state.take_compiled(config, built)

    @property
    def run_eagerly(self) -> bool:
        """``True``: the steps never run compiled (``compile(run_eagerly=...)``; settable)."""
        return self.training_state.run_eagerly

    @run_eagerly.setter
    def run_eagerly(self, value: bool) -> None:
        self.training_state.set_run_modes(value, self.training_state.jit_compile)

    @property
    def jit_compile(self) -> bool:
        """``True``: the steps run as ``td.function`` (``compile(jit_compile=...)``; settable, the
        next ``fit``/``evaluate``/``predict`` follows it)."""
        return self.training_state.jit_compile

    @jit_compile.setter
    def jit_compile(self, value: bool | str) -> None:
        self.training_state.set_run_modes(self.training_state.run_eagerly, value)

    def _assert_compiled(self, method: str) -> None:
        if not self.compiled:
            raise NotCompiledError(
                f"You must call model.compile(optimizer, loss, metrics) before model.{method}()."
            )

    # -- metrics -----------------------------------------------------------------------------------
    @property
    def metrics(self) -> list[td_metrics.Metric]:
        """The loss tracker(s) then the compiled metrics (all sync-on-read)."""
        return self.training_state.metrics

    @property
    def metrics_names(self) -> list[str]:
        """The names of ``metrics``, as ``evaluate`` orders its values."""
        return [m.name for m in self.metrics]

    def reset_metrics(self) -> None:
        """Reset every metric's state (``fit`` does at each epoch, ``evaluate`` at its start)."""
        for metric in self.metrics:
            metric.reset_state()

    # -- the functions run for each batch, and the loops ------------------------------------------------
    def make_train_function(self, force: bool = False) -> StepFunction:
        """``train_function(steps, batch, global_rows)``, what ``fit`` calls for each batch: made
        once (``force``: anew) and kept until ``compile`` or a change of ``jit_compile``."""
        if self.train_function is None or force:
            self.train_function = step_function(self, "train_step", self.jit_compile)
        return self.train_function

    def make_test_function(self, force: bool = False) -> StepFunction:
        """``test_function(steps, batch)``, what ``evaluate`` (and validation) call for each batch."""
        if self.test_function is None or force:
            self.test_function = step_function(self, "test_step", self.jit_compile)
        return self.test_function

    def make_predict_function(self, force: bool = False) -> StepFunction:
        """``predict_function(steps, batch)``, what ``predict`` calls for each batch: the
        per-replica outputs."""
        if self.predict_function is None or force:
            self.predict_function = step_function(self, "predict_step", self.jit_compile)
        return self.predict_function

    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: str | int = "auto",
        callbacks: Sequence[Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: dict[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int = 1,
    ) -> History:
        """Train for ``epochs`` epochs; returns the ``History`` (``history.history["loss"]``...).

        ``x``/``y``: tensors or arrays with ``batch_size`` (the global batch, default 32),
        a ``DataLoader`` or iterable of ``(x, y[, sample_weight])`` batches, or a distributed
        dataset. ``validation_data``: the same kinds, or ``validation_split`` of arrays
        (the last rows, before shuffling). ``verbose``: ``"auto"`` (1 on the chief), 0, 1, 2.
        A ``td.keras.utils.experimental.DatasetCreator`` needs ``steps_per_epoch``.

        Under ``ParameterServerStrategy`` (as in TensorFlow) ``x`` is a dataset sent to every
        worker by value and read there (a ``DataLoader``, an iterable dataset, or a map-style
        ``Dataset`` batched by ``batch_size``; read again from its start when it ends, as
        ``tf.data``'s ``repeat()``), a ``DatasetCreator`` or a dataset function;
        ``steps_per_epoch`` is required, and the steps run on the workers:
        each scheduled function runs ``steps_per_execution`` of them; the callbacks, the
        progress bar (``"auto"`` is 2 there) and the ``History`` run on the coordinator
        (``validation_data``: the same kinds, with ``validation_steps``).
        """
        self._assert_compiled("fit")
        strategy = self._resolve_strategy()
        training_loops.check_fit_arguments(epochs, initial_epoch, validation_freq)
        self.training_state.class_weight = training_loops.class_weights(class_weight)
        replica_steps = self.training_state.replica_steps(self)
        if ps_loops.uses_coordinator(strategy):
            return ps_loops.fit_loop(
                self, strategy, replica_steps, x, jit_compile=self.jit_compile, epochs=epochs,
                verbose=verbose, callbacks=callbacks, validation_data=validation_data, initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch, validation_steps=validation_steps, validation_freq=validation_freq,
                y=y, batch_size=batch_size, sample_weight=sample_weight, validation_batch_size=validation_batch_size,
                validation_split=validation_split or None, shuffle=None if shuffle is True else shuffle)
        if validation_split and validation_data is None:
            x, y, sample_weight, validation_data = training_loops.split_validation(x, y, sample_weight, validation_split)
        return training_loops.fit_loop(
            self, strategy, replica_steps, x, y, sample_weight, batch_size=batch_size, epochs=epochs,
            verbose=verbose, callbacks=callbacks, validation_data=validation_data, shuffle=shuffle,
            initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq)

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: str | int = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """The loss (and metrics) on the data: a float, ``[loss, *metrics]``, or a dict.

        Under ``ParameterServerStrategy`` ``x`` is a dataset (as in ``fit``), a
        ``DatasetCreator`` or a dataset function and ``steps`` is required: the test steps run on the workers and the result is the
        metrics' global values.

        >>> import torch, torch_distribute as td
        >>> model = td.keras.Model(torch.nn.Linear(1, 1))
        >>> model.compile("sgd", "mse", metrics=["mae"])
        >>> sorted(model.evaluate(torch.ones(8, 1), torch.ones(8, 1), verbose=0, return_dict=True))
        ['loss', 'mae']
        """
        self._assert_compiled("evaluate")
        strategy, replica_steps = self._resolve_strategy(), self.training_state.replica_steps(self)
        if ps_loops.uses_coordinator(strategy):
            logs = ps_loops.evaluate_loop(self, strategy, replica_steps, x, jit_compile=self.jit_compile,
                                          verbose=verbose, num_steps=steps, callbacks=callbacks, y=y,
                                          batch_size=batch_size, sample_weight=sample_weight)
        else:
            logs = training_loops.evaluate_loop(self, strategy, replica_steps, x, y, sample_weight,
                                                batch_size=batch_size, verbose=verbose, num_steps=steps,
                                                callbacks=callbacks)
        if return_dict:
            return logs
        values = [logs[name] for name in self.metrics_names]
        return values[0] if len(values) == 1 else values

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: str | int = "auto",
        steps: int | None = None,
        callbacks: Sequence[Callback] | None = None,
    ) -> Any:
        """The model's outputs on ``x``, in the order of ``x``, as CPU tensors (same nest as the outputs).

        Each replica predicts its rows; the pieces are gathered from every replica and
        worker (ragged last batches included), so every worker gets the whole result. Not
        supported under ``ParameterServerStrategy`` (``InvalidArgumentError``, as in TensorFlow).
        """
        strategy, replica_steps = self._resolve_strategy(), self.training_state.replica_steps(self)
        ps_loops.check_predict(strategy)
        return training_loops.predict_loop(self, strategy, replica_steps, x, batch_size=batch_size,
                                           verbose=verbose, num_steps=steps, callbacks=callbacks)

    # -- weights -----------------------------------------------------------------------------------------
    @property
    def weights_module(self) -> nn.Module:
        """The module whose ``state_dict`` ``save_weights`` writes: ``module``, or the model itself."""
        return self.module if self.module is not None else self

    def get_weights(self) -> list[np.ndarray]:
        """Every weight as a numpy array, in Keras' order: each layer's parameters then its
        buffers (``state_dict`` order; tied weights once). Under ``FullyShardedStrategy`` the
        whole arrays (call it on every worker: it gathers the shards).

        >>> import torch, torch_distribute as td
        >>> model = td.keras.Model(torch.nn.Linear(2, 1))
        >>> [w.shape for w in model.get_weights()]
        [(1, 2), (1,)]
        >>> model.set_weights([w * 0 for w in model.get_weights()])
        >>> float(model.module.weight.sum())
        0.0
        """
        return model_saving.get_weights(self.weights_module)

    def set_weights(self, weights: Sequence[npt.ArrayLike]) -> None:
        """Set every weight from arrays (or tensors) in ``get_weights``' order and shapes; under a
        strategy every replica (or shard) gets them, as ``load_weights`` does."""
        model_saving.set_weights(self.weights_module, weights)

    def save_weights(self, filepath: str, include_optimizer: bool = False) -> str:
        """Write the weights (and the optimizer state) to ``filepath`` as a ``td.Checkpoint`` file.

        Call it on every worker: the chief writes, and every worker returns once the file is
        complete, so ``load_weights(filepath)`` right after reads it on every worker. A
        non-chief that gives another path writes its own copy there; under
        ``FullyShardedStrategy`` each worker writes its shards into the directory
        ``filepath``. Returns ``filepath``. Raises ``CheckpointError`` on every worker if the
        chief's write fails.
        """
        return model_saving.save_weights(self.weights_module, self.optimizer if include_optimizer else None, filepath)

    def load_weights(self, filepath: str) -> None:
        """Load weights written by ``save_weights``, ``ModelCheckpoint`` or ``save`` (any strategy
        wrote them), and the optimizer state when the file holds it and the model is compiled.

        The file's checksum is checked first: a damaged or truncated file raises
        ``CheckpointError`` naming it. The optimizer state loads only into an optimizer with
        the same parameter groups and parameters (else ``CheckpointError``).
        """
        model_saving.load_weights(self.weights_module, self.optimizer, filepath)

    def save(self, filepath: str | os.PathLike[str], overwrite: bool = True, include_optimizer: bool = True) -> str:
        """Save the whole model to the file ``filepath``: ``td.keras.models.load_model`` rebuilds it.

        The file is a ``td.Checkpoint`` file (SHA-256 checked on load, loaded with
        ``weights_only=True``): the architecture by import path (the model's class and the
        arguments it was made with, or its ``get_config()``), the weights (as
        ``save_weights`` writes them, so ``load_weights`` reads this file too), and with
        ``include_optimizer`` (when compiled) the optimizer, its state and ``compile``'s
        arguments. A class or function that cannot be imported by name (defined in
        ``__main__``, a lambda) raises ``InvalidArgumentError`` before anything is written.
        Call it on every worker, as ``save_weights`` (under ``FullyShardedStrategy`` each
        worker writes its shards into the directory ``filepath``). Returns ``filepath``.

        >>> import torch_distribute as td
        >>> from my_models import Regressor  # a td.keras.Model subclass in my_models.py  # doctest: +SKIP
        >>> model = Regressor(features=4)  # doctest: +SKIP
        >>> model.compile(optimizer="adam", loss="mse")  # doctest: +SKIP
        >>> model.save("regressor.pt")  # doctest: +SKIP
        'regressor.pt'
        >>> with td.MirroredStrategy(["cpu:0", "cpu:1"]).scope():  # doctest: +SKIP
        ...     model = td.keras.models.load_model("regressor.pt")  # mirrored, compiled, ready to fit
        """
        filepath = os.fspath(filepath)
        if not isinstance(overwrite, bool) or not isinstance(include_optimizer, bool):
            raise InvalidArgumentError("overwrite and include_optimizer must be True or False.")
        state = self.training_state
        compile_config = state.compile_config if include_optimizer and state.compiled else None
        return model_saving.save_model(self, self.weights_module, filepath, overwrite=overwrite,
                                       optimizer=state.optimizer, compile_config=compile_config)

    def summary(self, print_fn: Callable[[str], Any] = print) -> None:
        """Print each top-level layer with its parameter count, and the totals."""
        for line in model_summary.summary_lines(self.name, self.weights_module):
            print_fn(line)
