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
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from torch_distribute import context, nest
from torch_distribute import metrics as td_metrics
from torch_distribute.checkpoint import Checkpoint
from torch_distribute.errors import (
    ContextError,
    DatasetError,
    InvalidArgumentError,
    UnmirroredStateError,
)
from torch_distribute.fault_tolerance import BackupAndRestore as _Backup
from torch_distribute.keras import optimizers as optimizers_module
from torch_distribute.keras.callbacks.backup_and_restore import BackupAndRestore
from torch_distribute.keras.callbacks.base import Callback, CallbackList
from torch_distribute.keras.callbacks.progbar_logger import ProgbarLogger
from torch_distribute.keras.compile_utils import LossesContainer, MetricsContainer
from torch_distribute.keras.data_adapter import DataHandler, make_handler, unpack
from torch_distribute.keras.history import History
from torch_distribute.strategies import owner_of

__all__ = ["Model", "NotCompiledError"]


class NotCompiledError(ContextError):
    """``fit``/``evaluate`` before ``compile``."""


class _FitState:
    """What a backup must hold besides the objects: the shuffling seed."""

    def __init__(self, seed: int):
        self.seed = seed

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])


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

    def __init__(self, module: nn.Module | None = None, name: str | None = None):
        super().__init__()
        if module is not None and not isinstance(module, nn.Module):
            raise InvalidArgumentError(f"td.keras.Model wraps a torch.nn.Module, got {type(module).__name__}.")
        self.module = module
        self.name = name or (type(module).__name__ if module is not None else type(self).__name__)
        # The scope we are made in; the parameters' owner wins when they say otherwise.
        self._strategy = (owner_of(module) if module is not None else None) or context.get_strategy()
        self.stop_training = False
        self.optimizer: torch.optim.Optimizer | None = None
        self.history: History | None = None
        self.compiled = False
        self.steps_per_execution = 1
        self._loss_tracker: td_metrics.Mean | None = None
        self._output_loss_trackers: list[td_metrics.Mean] = []
        self.compiled_loss: LossesContainer | None = None
        self.compiled_metrics: MetricsContainer | None = None
        self._class_weight: torch.Tensor | None = None

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
        if owner is not None and strategy._is_default:
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
                "inside `with strategy.scope():`."
            )
        if context.has_strategy() and context.get_strategy() is not strategy:
            raise ContextError(
                f"{self.name} belongs to {type(strategy).__name__} but compile/fit was called in the scope of "
                f"{type(context.get_strategy()).__name__}; call it in the model's own scope or outside any scope."
            )
        return strategy

    def _scope(self) -> Any:
        strategy = self._strategy
        return contextlib.nullcontext() if strategy._is_default else strategy.scope()

    # -- compile ---------------------------------------------------------------------------------
    def compile(
        self,
        optimizer: str | optimizers_module.OptimizerSpec | torch.optim.Optimizer | Callable[..., Any] = "rmsprop",
        loss: Any = None,
        metrics: Any = None,
        loss_weights: Sequence[float] | dict[str, float] | None = None,
        weighted_metrics: Any = None,
        steps_per_execution: int = 1,
        **unused: Any,
    ) -> None:
        """Choose the optimizer, the loss and the metrics (strings, objects or functions).

        Objects are made in the model's strategy scope (the scope is re-entered here), so an
        ``optimizer="adam"`` sums gradients across replicas. ``steps_per_execution``: run that
        many steps between two calls of the batch callbacks. ``run_eagerly`` and
        ``jit_compile`` are accepted and ignored (PyTorch runs eagerly).
        """
        ignored = set(unused) - {"run_eagerly", "jit_compile", "auto_scale_loss"}
        if ignored:
            raise TypeError(f"compile() got unexpected keyword arguments {sorted(ignored)}.")
        if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, int) or steps_per_execution < 1:
            raise InvalidArgumentError(f"steps_per_execution must be a positive int, got {steps_per_execution!r}.")
        strategy = self._resolve_strategy()
        with self._scope():
            self.optimizer = self._make_optimizer(optimizer, strategy)
            self.compiled_loss = LossesContainer(loss, loss_weights)
            self._loss_tracker = td_metrics.Mean(name="loss")
            self._output_loss_trackers = (
                [td_metrics.Mean(name=f"{name}_loss") for name in self.compiled_loss.output_names]
                if self.compiled_loss.multi_output and len(self.compiled_loss.output_names) > 1 else []
            )
            self.compiled_metrics = MetricsContainer(metrics, weighted_metrics, self.compiled_loss)
        for metric in self.compiled_metrics.metrics:
            owner = getattr(metric, "_strategy", None)
            if owner is not None and owner is not strategy and not (owner._is_default and strategy._is_default):
                raise ContextError(
                    f"Metric {metric.name!r} was created outside the model's strategy scope; create it inside "
                    f"`with strategy.scope():` or pass its name (e.g. 'accuracy') and compile makes it there."
                )
        self.steps_per_execution = steps_per_execution
        self.compiled = True

    def _make_optimizer(self, optimizer: Any, strategy: Any) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if isinstance(optimizer, torch.optim.Optimizer):
            owner = getattr(optimizer, "_td_strategy", None)
            if not strategy._is_default and owner is not strategy:
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

    def _logs(self) -> dict[str, float]:
        """Every metric's global value (a reduction across replicas and workers each)."""
        return {m.name: float(m.result()) for m in self.metrics}

    # -- the per-replica steps -----------------------------------------------------------------------
    def _call(self, x: Any) -> Any:
        return self(*x) if isinstance(x, (tuple, list)) else self(x)

    def _weights_for(self, y: Any, sample_weight: Any) -> torch.Tensor | None:
        weight = None if sample_weight is None else torch.as_tensor(sample_weight).reshape(-1).float()
        if self._class_weight is not None and y is not None and isinstance(y, torch.Tensor):
            labels = y.argmax(-1) if y.dim() > 1 and y.shape[-1] > 1 else y.reshape(-1)
            per_class = self._class_weight.to(labels.device)[labels.long()]
            weight = per_class if weight is None else weight * per_class.to(weight.device)
        return weight

    def _update_trackers(self, total: torch.Tensor, parts: list[tuple[Any, torch.Tensor]], y: Any, y_pred: Any,
                         sample_weight: torch.Tensor | None) -> None:
        self._loss_tracker.update_state(total.detach())
        for tracker, (_, values) in zip(self._output_loss_trackers, parts, strict=False):
            tracker.update_state(values.detach())
        self.compiled_metrics.update_state(y, nest.map_structure(torch.Tensor.detach, y_pred), sample_weight)

    def _train_step(self, batch: Any, global_rows: int) -> None:
        x, y, sample_weight = unpack(batch)
        if y is None:
            raise InvalidArgumentError("fit needs targets: pass y=, or batches of (x, y).")
        y_pred = self._call(x)
        weight = self._weights_for(y, sample_weight)
        total, parts = self.compiled_loss(y, y_pred, weight)
        # This replica's share of the mean over the global batch: gradients are summed over replicas.
        loss = total.sum() / global_rows if global_rows else total.sum() * 0.0
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self._update_trackers(total, parts, y, y_pred, weight)

    def _test_step(self, batch: Any) -> None:
        x, y, sample_weight = unpack(batch)
        if y is None:
            raise InvalidArgumentError("evaluate needs targets: pass y=, or batches of (x, y).")
        with torch.no_grad():
            y_pred = self._call(x)
            weight = self._weights_for(y, sample_weight)
            total, parts = self.compiled_loss(y, y_pred, weight)
            self._update_trackers(total, parts, y, y_pred, weight)

    def _predict_step(self, batch: Any) -> Any:
        x, _, _ = unpack(batch)
        with torch.no_grad():
            return self._call(x)

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
        """
        self._assert_compiled("fit")
        strategy = self._resolve_strategy()
        _check_int("epochs", epochs, minimum=0)
        _check_int("initial_epoch", initial_epoch, minimum=0)
        _check_int("validation_freq", validation_freq, minimum=1)
        if validation_split and validation_data is None:
            x, y, sample_weight, validation_data = _split(x, y, sample_weight, validation_split)
        self._class_weight = _class_weights(class_weight)
        fit_state = _FitState(self._shared_seed(strategy))
        train = make_handler(strategy, x, y, sample_weight, batch_size, shuffle, steps_per_epoch, seed=fit_state.seed)
        val = None
        if validation_data is not None:
            vx, vy, vw = _validation_parts(validation_data)
            val = make_handler(strategy, vx, vy, vw, validation_batch_size or (batch_size if vy is not None else None),
                               False, validation_steps, what="validation_data")
        callback_list, history, backup_callback = self._callbacks(
            callbacks, verbose, {"epochs": epochs, "steps": train.steps, "in_fit": True})
        self.history = history
        self.stop_training = False
        callback_list.on_train_begin()
        backup = self._open_backup(backup_callback, train, fit_state, history, callback_list)
        if backup is not None and hasattr(train.source, "seed"):
            train.source.seed = fit_state.seed
        epoch_numbers: Iterator[int] | range = backup.epochs(epochs, initial_epoch) if backup is not None else range(initial_epoch, epochs)
        logs: dict[str, float] = {}
        for epoch in epoch_numbers:
            resume_step = backup.step_in_epoch if backup is not None else 0
            if resume_step == 0:
                self.reset_metrics()
            callback_list.on_epoch_begin(epoch)
            batches = train.epoch(epoch)
            ran = self._train_epoch(backup.steps(batches) if backup is not None else batches, train,
                                    callback_list, resume_step)
            if ran is None:  # a stream that had nothing left
                _warn_ran_out(epoch)
                break
            logs = self._logs()
            if val is not None and (epoch + 1) % validation_freq == 0:
                logs.update({f"val_{k}": v for k, v in self._evaluate_loop(val, callback_list, epoch).items()})
            callback_list.on_epoch_end(epoch, logs)
            if train.exhausted:
                _warn_ran_out(epoch)
                self.stop_training = True
            if self.stop_training:
                break
        if backup is not None:
            backup.finish()
        callback_list.on_train_end(logs)
        return history

    def _train_epoch(self, batches: Any, handler: DataHandler, callback_list: CallbackList, first_step: int) -> int | None:
        """Train on one epoch's batches; the steps run, ``None`` if there were none to run."""
        strategy = self._strategy
        per_execution = self.steps_per_execution
        wants_logs = callback_list.wants_batch_logs("train")
        step = first_step
        pending = 0
        self.train()
        try:
            for batch in batches:
                if pending == 0:
                    callback_list.on_train_batch_begin(step)
                strategy.run(self._train_step, args=(batch, handler.global_rows(batch)))
                step += 1
                pending += 1
                if pending == per_execution:
                    pending = 0
                    callback_list.on_train_batch_end(step - 1, self._logs() if wants_logs else {})
                    if self.stop_training:
                        break
        except DatasetError:
            if step == first_step and handler.exhausted:
                return None
            raise
        if pending:
            callback_list.on_train_batch_end(step - 1, self._logs() if wants_logs else {})
        return step - first_step

    # -- evaluate --------------------------------------------------------------------------------------
    def _evaluate_loop(self, handler: DataHandler, callback_list: CallbackList, epoch: int = 0) -> dict[str, float]:
        strategy = self._strategy
        wants_logs = callback_list.wants_batch_logs("test")
        self.reset_metrics()
        self.eval()
        callback_list.on_test_begin()
        step = 0
        for batch in handler.epoch(epoch):
            callback_list.on_test_batch_begin(step)
            strategy.run(self._test_step, args=(batch,))
            callback_list.on_test_batch_end(step, self._logs() if wants_logs else {})
            step += 1
        logs = self._logs()
        callback_list.on_test_end(logs)
        return logs

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

        >>> import torch, torch_distribute as td
        >>> model = td.keras.Model(torch.nn.Linear(1, 1))
        >>> model.compile("sgd", "mse", metrics=["mae"])
        >>> sorted(model.evaluate(torch.ones(8, 1), torch.ones(8, 1), verbose=0, return_dict=True))
        ['loss', 'mae']
        """
        self._assert_compiled("evaluate")
        strategy = self._resolve_strategy()
        handler = make_handler(strategy, x, y, sample_weight, batch_size, False, steps)
        callback_list, _, _ = self._callbacks(callbacks, verbose, {"steps": handler.steps, "in_fit": False},
                                              history=False)
        logs = self._evaluate_loop(handler, callback_list)
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
        worker (ragged last batches included), so every worker gets the whole result.
        """
        strategy = self._resolve_strategy()
        handler = make_handler(strategy, x, None, None, batch_size, False, steps, what="x")
        callback_list, _, _ = self._callbacks(callbacks, verbose, {"steps": handler.steps}, history=False)
        self.eval()
        callback_list.on_predict_begin()
        pieces: list[Any] = []
        for step, batch in enumerate(handler.epoch(0)):
            callback_list.on_predict_batch_begin(step)
            outputs = strategy.run(self._predict_step, args=(batch,))
            gathered = nest.map_structure(lambda v: v.cpu(), strategy.gather(outputs, axis=0))
            pieces.append(gathered)
            callback_list.on_predict_batch_end(step, {"outputs": gathered})
        callback_list.on_predict_end()
        if not pieces:
            raise DatasetError("predict got no batches.")
        leaves = [nest.flatten(p)[0] for p in pieces]
        spec = nest.flatten(pieces[0])[1]
        return nest.unflatten([torch.cat([lv[i] for lv in leaves]) for i in range(len(leaves[0]))], spec)

    # -- weights -----------------------------------------------------------------------------------------
    def _weights_module(self) -> nn.Module:
        return self.module if self.module is not None else self

    def save_weights(self, filepath: str, include_optimizer: bool = False) -> str:
        """Write the weights (and the optimizer state) to ``filepath`` as a ``td.Checkpoint`` file.

        Call it on every worker; only the chief writes.
        """
        objects: dict[str, Any] = {"model": self._weights_module()}
        if include_optimizer and self.optimizer is not None:
            objects["optimizer"] = self.optimizer
        return Checkpoint(**objects).write(filepath)

    def load_weights(self, filepath: str) -> None:
        """Load weights written by ``save_weights`` or ``ModelCheckpoint`` (any strategy wrote them)."""
        objects: dict[str, Any] = {"model": self._weights_module()}
        Checkpoint(**objects).read(filepath)

    def summary(self, print_fn: Callable[[str], Any] = print) -> None:
        """Print each top-level layer with its parameter count, and the totals."""
        module = self._weights_module()
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

    # -- helpers -------------------------------------------------------------------------------------------
    def _callbacks(self, callbacks: Sequence[Callback] | None, verbose: str | int, params: dict[str, Any],
                   history: bool = True) -> tuple[CallbackList, History, BackupAndRestore | None]:
        callbacks = list(callbacks or [])
        for callback in callbacks:
            if not isinstance(callback, Callback):
                raise InvalidArgumentError(
                    f"callbacks must be td.keras.callbacks.Callback objects, got {type(callback).__name__}.")
        if verbose == "auto":
            verbose = 1
        if verbose not in (0, 1, 2):
            raise InvalidArgumentError(f"verbose must be 'auto', 0, 1 or 2, got {verbose!r}.")
        backups = [c for c in callbacks if isinstance(c, BackupAndRestore)]
        if len(backups) > 1:
            raise InvalidArgumentError("Give fit at most one BackupAndRestore callback.")
        record = History()
        ordered: list[Callback] = []
        if verbose and not any(isinstance(c, ProgbarLogger) for c in callbacks):
            ordered.append(ProgbarLogger(verbose))
        ordered += callbacks
        if history:
            ordered.append(record)
        return CallbackList(ordered, self, {"verbose": verbose, **params}), record, (backups[0] if backups else None)

    def _open_backup(self, callback: BackupAndRestore | None, handler: DataHandler, fit_state: _FitState,
                     history: History, callback_list: CallbackList) -> _Backup | None:
        if callback is None:
            return None
        metrics = Checkpoint(**{f"metric_{i}": m for i, m in enumerate(self.metrics)})
        stateful = [c for c in callback_list.callbacks if c is not history and callable(getattr(c, "state_dict", None))]
        states = Checkpoint(**{f"callback_{i}": c for i, c in enumerate(stateful)})
        checkpoint = Checkpoint(model=self, optimizer=self.optimizer, metrics=metrics, history=history,
                                callbacks=states, fit=fit_state)
        backup = _Backup(checkpoint, callback.backup_dir, save_freq=callback.save_freq,
                         delete_checkpoint=callback.delete_checkpoint, generators=handler.generators(),
                         strategy=self._strategy)
        return backup

    @staticmethod
    def _shared_seed(strategy: Any) -> int:
        """A shuffling seed from the torch RNG, the chief's on every worker."""
        local = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
        if strategy.num_replicas_in_sync == strategy.extended.num_local_replicas:
            return int(local[0])
        return int(strategy.gather(local, axis=0)[0])


# -- argument helpers ------------------------------------------------------------------------------------
def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}.")


def _warn_ran_out(epoch: int) -> None:
    warnings.warn(
        f"Your input ran out of data in epoch {epoch + 1}; interrupting training. Make sure the data can "
        "give at least steps_per_epoch * epochs batches (a generator is used up after one pass: pass a "
        "list, a DataLoader or tensors instead).",
        stacklevel=3,
    )


def _class_weights(class_weight: dict[int, float] | None) -> torch.Tensor | None:
    if class_weight is None:
        return None
    if not isinstance(class_weight, dict) or not class_weight:
        raise InvalidArgumentError(f"class_weight must be a dict {{class_id: weight}}, got {class_weight!r}.")
    table = torch.ones(max(int(k) for k in class_weight) + 1)
    for key, value in class_weight.items():
        table[int(key)] = float(value)
    return table


def _validation_parts(validation_data: Any) -> tuple[Any, Any, Any]:
    if isinstance(validation_data, tuple) and len(validation_data) in (2, 3):
        return (*validation_data, None)[:3] if len(validation_data) == 2 else validation_data
    return validation_data, None, None


def _split(x: Any, y: Any, sample_weight: Any, fraction: float) -> tuple[Any, Any, Any, Any]:
    if not 0.0 < fraction < 1.0:
        raise InvalidArgumentError(f"validation_split must be in (0, 1), got {fraction!r}.")
    leaves = nest.leaves(x)
    if not leaves or not all(hasattr(leaf, "shape") for leaf in leaves):
        raise InvalidArgumentError(
            "validation_split works with tensors or arrays only; with a DataLoader or an iterable pass "
            "validation_data=... instead."
        )
    rows = int(leaves[0].shape[0])
    cut = int(rows * (1.0 - fraction))
    if cut in (0, rows):
        raise InvalidArgumentError(f"validation_split={fraction} leaves no rows to train or to validate on ({rows} rows).")

    def head(v: Any) -> Any:
        return None if v is None else nest.map_structure(lambda t: t[:cut], v)

    def tail(v: Any) -> Any:
        return None if v is None else nest.map_structure(lambda t: t[cut:], v)

    return head(x), head(y), head(sample_weight), (tail(x), tail(y), tail(sample_weight))
