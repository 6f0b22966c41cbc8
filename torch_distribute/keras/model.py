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

import contextlib
import copy
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torch_distribute import context
from torch_distribute import metrics as td_metrics
from torch_distribute.checkpoint import Checkpoint
from torch_distribute.compiled_function import function as td_function
from torch_distribute.errors import (
    ContextError,
    InvalidArgumentError,
    UnmirroredStateError,
)
from torch_distribute.keras import optimizers as optimizers_module
from torch_distribute.keras import ps_loops, saving, training_loops
from torch_distribute.keras.callbacks.base import Callback
from torch_distribute.keras.callbacks.history import History
from torch_distribute.keras.compile_utils import LossesContainer, MetricsContainer
from torch_distribute.keras.mixed_precision import Policy, call_under_policy, global_policy
from torch_distribute.keras.replica_steps import ReplicaSteps
from torch_distribute.mixed_precision import LossScaleOptimizer, check_autocast
from torch_distribute.strategies import owner_of
from torch_distribute.strategies.interception import capture_module

__all__ = ["Model", "NotCompiledError"]

# What pickling drops: a pickled model is the plain, uncompiled model (see Model.__getstate__).
_TRAINING_STATE: dict[str, Any] = {
    "_strategy": None, "optimizer": None, "history": None, "compiled": False, "steps_per_execution": 1,
    "_loss_tracker": None, "_output_loss_trackers": [], "compiled_loss": None, "compiled_metrics": None,
    "_class_weight": None, "_run_eagerly": False, "_jit_compile": False, "train_function": None,
    "test_function": None, "predict_function": None, "_compile_config": None, "stop_training": False,
}


def _records_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` that first records the arguments of the outermost constructor call."""

    @functools.wraps(init)
    def __init__(self: Model, *args: Any, **kwargs: Any) -> None:
        if "_constructor_arguments" not in self.__dict__:
            object.__setattr__(self, "_constructor_arguments", (args, kwargs))
        init(self, *args, **kwargs)

    return __init__


class NotCompiledError(ContextError):
    """``fit``/``evaluate`` before ``compile``."""


class Model(nn.Module):
    """An ``nn.Module`` with Keras' training API; wrap a module or subclass and define ``forward``.

    ``Model(module)`` calls ``module`` in ``forward``; the model belongs to the strategy whose
    scope its parameters were made in (``distribute_strategy``). ``self.module`` is the
    wrapped module: its ``state_dict`` is what ``save_weights`` writes, so the files load
    into the bare module.

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:  # record what save() needs to rebuild the model
            setattr(cls, "__init__", _records_arguments(cls.__dict__["__init__"]))  # noqa: B010 (no literal ".__init__ =": that is how torch patching is spotted)

    def __init__(self, module: nn.Module | None = None, name: str | None = None, dtype: Policy | str | None = None):
        if "_constructor_arguments" not in self.__dict__:
            object.__setattr__(self, "_constructor_arguments", ((module,), {"name": name, "dtype": dtype}))
        super().__init__()
        self.dtype_policy = global_policy() if dtype is None else Policy(dtype)
        if module is not None:
            _adopt(module)
        self.module = module
        self.name = name or (type(module).__name__ if module is not None else type(self).__name__)
        # The scope we are made in; the parameters' owner wins when they say otherwise.
        self._strategy = (owner_of(module) if module is not None else None) or context.get_strategy()
        self.stop_training = False
        self.optimizer: torch.optim.Optimizer | LossScaleOptimizer | None = None
        self.history: History | None = None
        self.compiled = False
        self.steps_per_execution = 1
        self._loss_tracker: td_metrics.Mean | None = None
        self._output_loss_trackers: list[td_metrics.Mean] = []
        self.compiled_loss: LossesContainer | None = None
        self.compiled_metrics: MetricsContainer | None = None
        self._class_weight: torch.Tensor | None = None
        self._run_eagerly = False
        self._jit_compile = False
        # What fit/evaluate/predict call for each batch (made on first use, dropped by compile).
        self.train_function: Callable[..., Any] | None = None
        self.test_function: Callable[..., Any] | None = None
        self.predict_function: Callable[..., Any] | None = None
        self._compile_config: dict[str, Any] | None = None  # compile's arguments, for save()

    @property
    def constructor_arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of the constructor call that made this model (what ``save``
        records to rebuild it; a class's ``get_config()`` takes precedence)."""
        return self._constructor_arguments

    # -- pickling -----------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Pickling (``torch.save(model)``, ``pickle``) keeps the plain model: its architecture,
        its weights (under a strategy, the values the user holds: replica 0's, the same on
        every replica) and its dtype policy; not the strategy, nor ``compile``'s state (the
        optimizer, losses, metrics), nor the ``history``. ``model.save`` keeps those."""
        return {**self.__dict__, **copy.deepcopy(_TRAINING_STATE)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled inside ``strategy.scope()``, the model is mirrored there as if made there."""
        super().__setstate__(state)
        capture_module(self)
        self._strategy = context.get_strategy()

    def __deepcopy__(self, memo: dict[int, Any]) -> Model:
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
    def distribute_strategy(self) -> Any:
        """The strategy the model belongs to (its parameters were made in its scope)."""
        return self._strategy

    def _resolve_strategy(self) -> Any:
        first = next(iter([*self.parameters(), *self.buffers()]), None)
        owner = owner_of(first) if first is not None else None
        strategy = self._strategy
        if owner is not None and strategy.is_default:
            strategy = self._strategy = owner
        elif owner is not None and owner is not strategy:
            raise ContextError(
                f"{self.name}'s parameters belong to {type(owner).__name__} but the model was wrapped under "
                f"{type(strategy).__name__}; create the module and the td.keras.Model in the same scope."
            )
        if first is not None and owner is None and strategy.num_replicas_in_sync > 1:
            raise UnmirroredStateError(
                f"{self.name} was created outside strategy.scope() but is used with "
                f"{type(strategy).__name__} ({strategy.num_replicas_in_sync} replicas): create the module "
                "inside `with strategy.scope():`, or wrap a module made or loaded elsewhere (torch.load, "
                "load_model, copy.deepcopy) inside the scope: `with strategy.scope(): model = "
                "td.keras.Model(module)` hands it to the strategy. A TorchScript module (torch.jit.load) "
                "cannot be handed over: build the module in the scope and load its weights "
                "(module.load_state_dict(scripted.state_dict()))."
            )
        if context.has_strategy() and context.get_strategy() is not strategy:
            raise ContextError(
                f"{self.name} belongs to {type(strategy).__name__} but compile/fit was called in the scope of "
                f"{type(context.get_strategy()).__name__}; call it in the model's own scope or outside any scope."
            )
        return strategy

    def _scope(self) -> Any:
        strategy = self._strategy
        return contextlib.nullcontext() if strategy.is_default else strategy.scope()

    # -- compile ---------------------------------------------------------------------------------
    def compile(
        self,
        optimizer: str | optimizers_module.OptimizerSpec | torch.optim.Optimizer | LossScaleOptimizer
        | Callable[..., Any] = "rmsprop",
        loss: Any = None,
        metrics: Any = None,
        loss_weights: Sequence[float] | dict[str, float] | None = None,
        weighted_metrics: Any = None,
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
        jit_compile = _check_run_modes(run_eagerly, jit_compile)
        if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, int) or steps_per_execution < 1:
            raise InvalidArgumentError(f"steps_per_execution must be a positive int, got {steps_per_execution!r}.")
        if not isinstance(auto_scale_loss, bool):
            raise InvalidArgumentError(f"auto_scale_loss must be True or False, got {auto_scale_loss!r}.")
        strategy = self._resolve_strategy()
        self._check_policy(strategy)
        with self._scope():
            self.optimizer = self._make_optimizer(optimizer, strategy)
            if (auto_scale_loss and self.dtype_policy.needs_loss_scaling
                    and not isinstance(self.optimizer, LossScaleOptimizer)):
                self.optimizer = LossScaleOptimizer(self.optimizer)
            self.compiled_loss = LossesContainer(loss, loss_weights)
            self._loss_tracker = td_metrics.Mean(name="loss")
            self._output_loss_trackers = (
                [td_metrics.Mean(name=f"{name}_loss") for name in self.compiled_loss.output_names]
                if self.compiled_loss.multi_output and len(self.compiled_loss.output_names) > 1 else []
            )
            self.compiled_metrics = MetricsContainer(metrics, weighted_metrics, self.compiled_loss)
        for metric in self.compiled_metrics.metrics:
            # A metric made under a default strategy has no owner: fine only if the model's is default too.
            owner = owner_of(metric)
            if owner is not strategy and not (owner is None and strategy.is_default):
                raise ContextError(
                    f"Metric {metric.name!r} was created outside the model's strategy scope; create it inside "
                    f"`with strategy.scope():` or pass its name (e.g. 'accuracy') and compile makes it there."
                )
        self.steps_per_execution = steps_per_execution
        self._run_eagerly, self._jit_compile = run_eagerly, jit_compile
        self._reset_step_functions()
        self._compile_config = {
            "loss": loss, "metrics": metrics, "loss_weights": loss_weights, "weighted_metrics": weighted_metrics,
            "steps_per_execution": steps_per_execution, "auto_scale_loss": auto_scale_loss,
            "run_eagerly": run_eagerly, "jit_compile": jit_compile,
        }
        self.compiled = True

    @property
    def run_eagerly(self) -> bool:
        """``True``: the steps never run compiled (``compile(run_eagerly=...)``; settable)."""
        return self._run_eagerly

    @run_eagerly.setter
    def run_eagerly(self, value: bool) -> None:
        _check_run_modes(value, self._jit_compile)
        self._run_eagerly = value
        self._reset_step_functions()

    @property
    def jit_compile(self) -> bool:
        """``True``: the steps run as ``td.function`` (``compile(jit_compile=...)``; settable, the
        next ``fit``/``evaluate``/``predict`` follows it)."""
        return self._jit_compile

    @jit_compile.setter
    def jit_compile(self, value: bool | str) -> None:
        self._jit_compile = _check_run_modes(self._run_eagerly, value)
        self._reset_step_functions()

    def _check_policy(self, strategy: Any) -> None:
        """Refuse a compute dtype the model's devices cannot autocast to."""
        dtype = self.dtype_policy.autocast_dtype
        if dtype is None:
            return
        if strategy.is_default:
            devices = {t.device.type for t in [*self.parameters(), *self.buffers()]} or {"cpu"}
        else:
            devices = {d.type for d in strategy.extended.replica_devices}
        for device_type in sorted(devices):
            check_autocast(device_type, dtype)

    def _make_optimizer(self, optimizer: Any, strategy: Any) -> torch.optim.Optimizer | LossScaleOptimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if isinstance(optimizer, (torch.optim.Optimizer, LossScaleOptimizer)):
            inner = optimizer.inner_optimizer if isinstance(optimizer, LossScaleOptimizer) else optimizer
            if not strategy.is_default and owner_of(inner) is not strategy:
                raise UnmirroredStateError(
                    f"The {type(optimizer).__name__} given to compile was created outside "
                    f"{type(strategy).__name__}.scope(): gradients would not be summed across replicas. Create it "
                    "inside the scope, or pass a name ('adam') or td.keras.optimizers.Adam(...) and compile "
                    "creates it there."
                )
            return optimizer
        if not params:
            raise InvalidArgumentError(f"{self.name} has no trainable parameters to optimize.")
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            return optimizer(params)
        if isinstance(optimizer, (str, optimizers_module.OptimizerSpec)):
            return optimizers_module.get(optimizer).build(params)
        if callable(optimizer):
            built = optimizer(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise InvalidArgumentError(f"The optimizer factory returned {type(built).__name__}, not a torch.optim optimizer.")
            return built
        return optimizers_module.get(optimizer).build(params)  # raises with the valid names

    def _assert_compiled(self, method: str) -> None:
        if not self.compiled:
            raise NotCompiledError(
                f"You must call model.compile(optimizer, loss, metrics) before model.{method}()."
            )

    # -- metrics -----------------------------------------------------------------------------------
    @property
    def metrics(self) -> list[td_metrics.Metric]:
        """The loss tracker(s) then the compiled metrics (all sync-on-read)."""
        if not self.compiled:
            return []
        return [self._loss_tracker, *self._output_loss_trackers, *self.compiled_metrics.metrics]

    @property
    def metrics_names(self) -> list[str]:
        return [m.name for m in self.metrics]

    def reset_metrics(self) -> None:
        for metric in self.metrics:
            metric.reset_state()

    # -- the per-replica steps -----------------------------------------------------------------------
    def _replica_steps(self) -> ReplicaSteps:
        """The steps ``strategy.run`` distributes, for what ``compile`` (and ``fit``) set."""
        return ReplicaSteps(self, self.optimizer, self.compiled_loss, self.compiled_metrics,
                            self._loss_tracker, self._output_loss_trackers, self._class_weight)

    # -- the functions run for each batch ---------------------------------------------------------------
    def _reset_step_functions(self) -> None:
        self.train_function = self.test_function = self.predict_function = None

    def _step_function(self, step: str) -> Callable[..., Any]:
        """``f(steps, *args)``: ``strategy.run(steps.<step>, args)``, a ``td.function`` under
        ``jit_compile`` (the replicas' steps compiled once per replica)."""
        model = self

        def run_step(steps: ReplicaSteps, *args: Any) -> Any:
            return model.distribute_strategy.run(getattr(steps, step), args=args)

        run_step.__name__ = run_step.__qualname__ = step.replace("_step", "_function")
        return td_function(run_step) if self._jit_compile else run_step

    def make_train_function(self, force: bool = False) -> Callable[..., Any]:
        """``train_function(steps, batch, global_rows)``, what ``fit`` calls for each batch: made
        once (``force``: anew) and kept until ``compile`` or a change of ``jit_compile``."""
        if self.train_function is None or force:
            self.train_function = self._step_function("train_step")
        return self.train_function

    def make_test_function(self, force: bool = False) -> Callable[..., Any]:
        """``test_function(steps, batch)``, what ``evaluate`` (and validation) call for each batch."""
        if self.test_function is None or force:
            self.test_function = self._step_function("test_step")
        return self.test_function

    def make_predict_function(self, force: bool = False) -> Callable[..., Any]:
        """``predict_function(steps, batch)``, what ``predict`` calls for each batch: the
        per-replica outputs."""
        if self.predict_function is None or force:
            self.predict_function = self._step_function("predict_step")
        return self.predict_function

    # -- fit -----------------------------------------------------------------------------------------
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
        training_loops.check_int("epochs", epochs, minimum=0)
        training_loops.check_int("initial_epoch", initial_epoch, minimum=0)
        training_loops.check_int("validation_freq", validation_freq, minimum=1)
        self._class_weight = training_loops.class_weights(class_weight)
        if ps_loops.uses_coordinator(strategy):
            return ps_loops.fit_loop(
                self, strategy, self._replica_steps(), x, jit_compile=self._jit_compile, epochs=epochs,
                verbose=verbose, callbacks=callbacks, validation_data=validation_data, initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch, validation_steps=validation_steps, validation_freq=validation_freq,
                y=y, batch_size=batch_size, sample_weight=sample_weight, validation_batch_size=validation_batch_size,
                validation_split=validation_split or None, shuffle=None if shuffle is True else shuffle)
        if validation_split and validation_data is None:
            x, y, sample_weight, validation_data = training_loops.split_validation(x, y, sample_weight, validation_split)
        return training_loops.fit_loop(
            self, strategy, self._replica_steps(), x, y, sample_weight, batch_size=batch_size, epochs=epochs,
            verbose=verbose, callbacks=callbacks, validation_data=validation_data, shuffle=shuffle,
            initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq)

    # -- evaluate --------------------------------------------------------------------------------------
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
        strategy = self._resolve_strategy()
        if ps_loops.uses_coordinator(strategy):
            logs = ps_loops.evaluate_loop(self, strategy, self._replica_steps(), x, jit_compile=self._jit_compile,
                                          verbose=verbose, num_steps=steps, callbacks=callbacks, y=y,
                                          batch_size=batch_size, sample_weight=sample_weight)
        else:
            logs = training_loops.evaluate_loop(self, strategy, self._replica_steps(), x, y, sample_weight,
                                                batch_size=batch_size, verbose=verbose, num_steps=steps,
                                                callbacks=callbacks)
        if return_dict:
            return logs
        values = [logs[name] for name in self.metrics_names]
        return values[0] if len(values) == 1 else values

    # -- predict ---------------------------------------------------------------------------------------
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
        strategy = self._resolve_strategy()
        ps_loops.check_predict(strategy)
        return training_loops.predict_loop(self, strategy, self._replica_steps(), x, batch_size=batch_size,
                                           verbose=verbose, num_steps=steps, callbacks=callbacks)

    # -- weights -----------------------------------------------------------------------------------------
    @property
    def weights_module(self) -> nn.Module:
        """The module whose ``state_dict`` ``save_weights`` writes: ``module``, or the model itself."""
        return self.module if self.module is not None else self

    def _weight_names(self) -> list[list[str]]:
        """The state_dict's names, one list per tensor (tied weights are one tensor), in order."""
        groups: dict[int, list[str]] = {}
        for name, value in self.weights_module.state_dict(keep_vars=True).items():
            groups.setdefault(id(value), []).append(name)
        return list(groups.values())

    def get_weights(self) -> list[Any]:
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
        state = self.weights_module.state_dict()
        arrays = []
        for names in self._weight_names():
            tensor = state[names[0]]
            full = getattr(tensor, "full_tensor", None)
            arrays.append((full() if callable(full) else tensor).detach().cpu().numpy().copy())  # not a view
        return arrays

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Set every weight from arrays (or tensors) in ``get_weights``' order and shapes; under a
        strategy every replica (or shard) gets them, as ``load_weights`` does."""
        groups = self._weight_names()
        if isinstance(weights, (str, bytes)) or len(weights) != len(groups):
            raise InvalidArgumentError(
                f"set_weights expects {len(groups)} arrays (get_weights' order), got "
                f"{len(weights) if not isinstance(weights, (str, bytes)) else type(weights).__name__}.")
        state = self.weights_module.state_dict()
        values: dict[str, Any] = {}
        for names, array in zip(groups, weights, strict=True):
            current = state[names[0]]
            value = torch.as_tensor(array).to(dtype=current.dtype)
            if tuple(value.shape) != tuple(current.shape):
                raise InvalidArgumentError(
                    f"set_weights: {names[0]} has shape {tuple(current.shape)}, got an array of shape "
                    f"{tuple(value.shape)}.")
            values.update(dict.fromkeys(names, value))
        Checkpoint(model=self.weights_module).load_state_dict({"save_counter": 0, "objects": {"model": values}})

    def save_weights(self, filepath: str, include_optimizer: bool = False) -> str:
        """Write the weights (and the optimizer state) to ``filepath`` as a ``td.Checkpoint`` file.

        Call it on every worker: the chief writes, and every worker returns once the file is
        complete, so ``load_weights(filepath)`` right after reads it on every worker. A
        non-chief that gives another path writes its own copy there; under
        ``FullyShardedStrategy`` each worker writes its shards into the directory
        ``filepath``. Returns ``filepath``. Raises ``CheckpointError`` on every worker if the
        chief's write fails.
        """
        objects: dict[str, Any] = {"model": self.weights_module}
        if include_optimizer and self.optimizer is not None:
            objects["optimizer"] = self.optimizer
        return Checkpoint(**objects).write(filepath)

    def load_weights(self, filepath: str) -> None:
        """Load weights written by ``save_weights``, ``ModelCheckpoint`` or ``save`` (any strategy
        wrote them), and the optimizer state when the file holds it and the model is compiled.

        The file's checksum is checked first: a damaged or truncated file raises
        ``CheckpointError`` naming it. The optimizer state loads only into an optimizer with
        the same parameter groups and parameters (else ``CheckpointError``).
        """
        objects: dict[str, Any] = {"model": self.weights_module}
        if self.optimizer is not None:
            objects["optimizer"] = self.optimizer  # left as it is when the file has no optimizer
        Checkpoint(**objects).read(filepath)

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
        if not overwrite and os.path.exists(filepath):
            raise InvalidArgumentError(f"{filepath!r} exists and overwrite=False: pass overwrite=True or another path.")
        record: dict[str, Any] = {"model": saving.encode(self, f"the model {type(self).__qualname__}"),
                                  "compile": None, "optimizer": None}
        objects: dict[str, Any] = {"model": self.weights_module}
        if include_optimizer and self.compiled:
            try:
                record["compile"] = saving.encode(self._compile_config, "compile()'s arguments")
                record["optimizer"] = saving.optimizer_record(self.optimizer, self.named_parameters())
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    f"{exc} Or save with include_optimizer=False: the weights and the architecture only "
                    "(compile again after loading)."
                ) from exc
            objects["optimizer"] = self.optimizer
        objects["keras_model"] = saving.ConfigRecord(record)
        return Checkpoint(**objects).write(filepath)

    def summary(self, print_fn: Callable[[str], Any] = print) -> None:
        """Print each top-level layer with its parameter count, and the totals."""
        module = self.weights_module
        rows = [(name or "(model)", type(child).__name__, sum(p.numel() for p in child.parameters()))
                for name, child in (module.named_children() if list(module.children()) else [("", module)])]
        total = sum(p.numel() for p in module.parameters())
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        width = max([len(f"{n} ({t})") for n, t, _ in rows] + [20])
        lines = [f'Model: "{self.name}"', "-" * (width + 16), f"{'Layer (type)':<{width}}  {'Param #':>12}",
                 "=" * (width + 16)]
        lines += [f"{f'{n} ({t})':<{width}}  {c:>12,}" for n, t, c in rows]
        lines += ["=" * (width + 16), f"Total params: {total:,}", f"Trainable params: {trainable:,}",
                  f"Non-trainable params: {total - trainable:,}"]
        for line in lines:
            print_fn(line)


def _adopt(module: Any) -> None:
    """Check that ``module`` can train, and hand it to the strategy whose scope we are in when
    it was made elsewhere (``torch.load`` of a whole module, ``load_model`` outside the scope)."""
    if isinstance(module, torch.export.ExportedProgram) or (isinstance(module, nn.Module) and not _trains(module)):
        raise InvalidArgumentError(
            f"td.keras.Model cannot train a {type(module).__name__} (an ExportedProgram, or its .module(), is a "
            "graph for inference: it does not support train()). To fine-tune, rebuild the module and load the "
            "weights into it: module.load_state_dict(torch.export.load(path).module().state_dict()), or save "
            "the model with model.save(path) and load it with td.keras.models.load_model(path).")
    if not isinstance(module, nn.Module):
        raise InvalidArgumentError(f"td.keras.Model wraps a torch.nn.Module, got {type(module).__name__}.")
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    if first is not None and owner_of(first) is None and not isinstance(module, torch.jit.ScriptModule):
        capture_module(module)  # nothing outside every scope


def _trains(module: nn.Module) -> bool:
    """Whether ``module.train()`` works (an exported program's module raises)."""
    try:
        module.train(module.training)
    except NotImplementedError:
        return False
    return True


def _check_run_modes(run_eagerly: Any, jit_compile: Any) -> bool:
    """``jit_compile`` resolved (``"auto"`` is ``False``, as on Keras' torch backend), after
    checking both values and that they do not contradict each other."""
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
