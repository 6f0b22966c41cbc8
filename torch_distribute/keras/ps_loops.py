"""``fit`` and ``evaluate`` of ``td.keras.Model`` under ``ParameterServerStrategy``.

As in TensorFlow (``Model.fit`` with a ``ClusterCoordinator``): the coordinator builds the
dataset on every worker (``create_per_worker_dataset`` of the ``DatasetCreator`` or dataset
function) and, each epoch, schedules ``steps_per_epoch / steps_per_execution`` functions,
each running ``steps_per_execution`` train steps on whichever worker is free, from that
worker's iterator. The coordinator itself runs no step: it runs the callbacks (the batch
callbacks once per scheduled function, ``on_epoch_end`` after ``join()``), the progress bar
and the ``History``, whose values are the metrics' global values (metrics made in scope
keep their state on the parameter servers, so every worker's updates count).

With a ``BackupAndRestore`` callback (``save_freq="epoch"``), the coordinator backs up the
model (the parameter servers' values), the optimizer, the metrics, the history and the
callbacks' state after every epoch, once every function of the epoch has ended; a coordinator
started again (after it crashed, or was preempted) restores them into the model it made and
resumes at the next epoch, as TensorFlow's parameter server training does. The workers'
datasets start again: a dataset function has no position to save.

``predict`` is not supported under this strategy, as in TensorFlow: ``check_predict`` says
what to do instead.

>>> import torch_distribute as td
>>> from torch_distribute.keras import ps_loops
>>> ps_loops.uses_coordinator(td.OneDeviceStrategy("cpu"))
False
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import data

from torch_distribute import nest
from torch_distribute.checkpoint import Checkpoint
from torch_distribute.coordinator import ClusterCoordinator
from torch_distribute.errors import DatasetError, InvalidArgumentError
from torch_distribute.fault_tolerance import BackupAndRestore as _Backup
from torch_distribute.keras.callbacks.backup_and_restore import BackupAndRestore
from torch_distribute.keras.callbacks.base import Callback, CallbackList
from torch_distribute.keras.callbacks.history import History
from torch_distribute.keras.data_adapter import unpack
from torch_distribute.keras.dataset_creator import DatasetCreator
from torch_distribute.keras.replica_steps import ReplicaSteps
from torch_distribute.keras.training_loops import (
    TrainableModel,
    check_int,
    make_callbacks,
    metric_logs,
)
from torch_distribute.strategies import ParameterServerStrategy

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy

__all__ = ["Repeated", "check_predict", "dataset_function", "evaluate_loop", "fit_loop", "run_test_steps", "run_train_steps", "uses_coordinator"]


def uses_coordinator(strategy: Strategy) -> bool:
    """Whether ``fit``/``evaluate`` under ``strategy`` schedule their steps on workers."""
    return isinstance(strategy, ParameterServerStrategy)


# -- what runs on a worker -----------------------------------------------------------------------
def _rows(batch: Any) -> int:
    x, _, _ = unpack(batch)
    leaves = [leaf for leaf in nest.leaves(x) if isinstance(leaf, torch.Tensor) and leaf.dim()]
    if not leaves:
        raise InvalidArgumentError(
            "The dataset function's batches must hold tensors with a batch dimension: yield (x, y) or "
            "(x, y, sample_weight) batches of torch tensors.")
    return int(leaves[0].shape[0])


def run_train_steps(strategy: Strategy, steps: ReplicaSteps, iterator: Any, count: int) -> None:
    """``count`` train steps on this worker's batches (a scheduled function: runs on a worker).

    Each step is one optimizer step on one batch of the worker's dataset (the loss is the
    mean over the batch); the gradients go to the parameter servers at once.
    """
    model = steps.model
    assert isinstance(model, nn.Module)  # fit under ParameterServerStrategy: a td.keras.Model
    model.train()
    for _ in range(count):
        batch = next(iterator)
        strategy.run(steps.train_step, args=(batch, _rows(batch)))


def run_test_steps(strategy: Strategy, steps: ReplicaSteps, iterator: Any, count: int) -> None:
    """``count`` test steps on this worker's batches (a scheduled function: runs on a worker)."""
    model = steps.model
    assert isinstance(model, nn.Module)  # evaluate under ParameterServerStrategy: a td.keras.Model
    model.eval()
    for _ in range(count):
        strategy.run(steps.test_step, args=(next(iterator),))


# -- checks -------------------------------------------------------------------------------------------
_INPUT_HELP = (
    "pass a DataLoader or a torch Dataset (sent to every worker and read there), or "
    "td.keras.utils.experimental.DatasetCreator(dataset_fn) (or the function dataset_fn itself), "
    "where dataset_fn(input_context) returns an iterable of (x, y[, sample_weight]) batches (typically "
    "endless): the workers build it and read it, as in TensorFlow."
)


class Repeated:
    """``source`` read again from its start each time it ends, as ``tf.data``'s ``repeat()``
    (a dataset ``fit`` sends to the workers: ``steps_per_epoch`` says where epochs end)."""

    def __init__(self, source: Any, what: str):
        self.source = source
        self.what = what

    def __iter__(self) -> Iterator[Any]:
        while True:
            empty = True
            for batch in self.source:
                empty = False
                yield batch
            if empty:
                raise DatasetError(f"{self.what} gives no batches on this worker: give it data.")


def _map_style(x: Any) -> bool:
    return isinstance(x, data.Dataset) and not isinstance(x, data.IterableDataset) and not hasattr(x, "__iter__")


def dataset_function(x: Any, what: str, options: dict[str, Any] | None = None,
                     batch_size_option: str = "batch_size", shuffle_option: str | None = None) -> Any:
    """What every worker builds its dataset from: the function of a ``DatasetCreator`` or a
    function, or a dataset sent by value (a ``DataLoader``, an iterable dataset, a map-style
    ``Dataset`` batched by ``options[batch_size_option]``, default 32, shuffled when
    ``shuffle_option`` is given and that option is not ``False``), read again when it ends; else ``InvalidArgumentError``.
    The options a map-style dataset uses are taken out of ``options``."""
    options = {} if options is None else options
    if isinstance(x, DatasetCreator):
        if x.input_options is not None:
            raise InvalidArgumentError(
                f"{what}: a DatasetCreator's input_options are not supported under ParameterServerStrategy "
                "(each worker reads its own dataset on its CPU): make it DatasetCreator(dataset_fn).")
        return x.dataset_fn
    if isinstance(x, Iterator):  # a generator, an iterator: read once, here
        raise InvalidArgumentError(
            f"Under ParameterServerStrategy {what} cannot be a {type(x).__name__}: an iterator is read where it "
            f"was made and cannot be sent to the workers. {_INPUT_HELP[0].upper()}{_INPUT_HELP[1:]} "
            "(a function that makes the generator is fine).")
    if callable(x) and not isinstance(x, (nn.Module, type)) and not hasattr(x, "__iter__"):
        return x
    if _map_style(x):
        batch_size = options.pop(batch_size_option, None)
        batch_size = 32 if batch_size is None else batch_size
        check_int(batch_size_option, batch_size, minimum=1)
        shuffle = shuffle_option is not None and options.pop(shuffle_option, None) is not False
        x = data.DataLoader(x, batch_size=batch_size, shuffle=shuffle)
    if isinstance(x, (data.DataLoader, data.IterableDataset)) or (
            hasattr(x, "__iter__") and not isinstance(x, (torch.Tensor, str, bytes, list, tuple, dict, set))
            and not hasattr(x, "__array__")):
        return Repeated(x, f"{what} ({type(x).__name__})")
    raise InvalidArgumentError(
        f"Under ParameterServerStrategy the steps run on the workers, so {what} cannot be "
        f"{type(x).__name__}: {_INPUT_HELP}")


_MAY_NOT_END = "(the workers' datasets may not end), as in TensorFlow."


def _require_steps(caller: str, argument: str, value: int | None, why: str) -> int:
    """``value`` of ``caller``'s ``argument``, given and a positive int, or raise saying why."""
    if value is None:
        raise InvalidArgumentError(f"{caller} under ParameterServerStrategy needs {argument}= {why}")
    check_int(argument, value, minimum=1)
    return value


def _refuse(**given: Any) -> None:
    for name, value in given.items():
        if value is not None:
            shown = repr(value) if isinstance(value, (int, float, str)) else f"a {type(value).__name__}"
            raise InvalidArgumentError(
                f"{name} is not supported with fit/evaluate under ParameterServerStrategy (got {shown}): "
                f"the workers' batches come from the dataset function, so leave {name} unset and {_INPUT_HELP}")


def _check_model(model: TrainableModel, callbacks: Sequence[Callback] | None, jit_compile: bool) -> None:
    if jit_compile:
        raise InvalidArgumentError(
            "compile(jit_compile=True) is not supported under ParameterServerStrategy: the workers run "
            "the steps eagerly. Compile with jit_compile=False (or 'auto').")
    for callback in callbacks or ():
        if isinstance(callback, BackupAndRestore) and callback.save_freq != "epoch":
            raise InvalidArgumentError(
                f"BackupAndRestore(save_freq={callback.save_freq!r}) under ParameterServerStrategy: the "
                "coordinator backs up after each epoch only (the steps run on the workers, whose datasets "
                "have no position to save mid-epoch), as in TensorFlow. Use save_freq='epoch'.")


def check_predict(strategy: Strategy) -> None:
    """Raise ``InvalidArgumentError``: ``predict`` is not supported under ``ParameterServerStrategy``."""
    if uses_coordinator(strategy):
        raise InvalidArgumentError(
            "predict is not supported under ParameterServerStrategy (nor in TensorFlow). Predict on the "
            "coordinator with the model itself (with torch.no_grad(): model(x); it reads the parameter "
            "servers' current values), or save it (model.save(path)) and call predict on "
            "td.keras.models.load_model(path) loaded outside the strategy's scope.")


def _verbose(verbose: str | int) -> str | int:
    return 2 if verbose == "auto" else verbose  # TensorFlow's 'auto' under ParameterServerStrategy


def _executions(total: int, per_execution: int) -> list[int]:
    """The step counts of the scheduled functions: ``per_execution`` each, the rest last."""
    full, rest = divmod(total, per_execution)
    return [per_execution] * full + ([rest] if rest else [])


# -- fit -------------------------------------------------------------------------------------------------
def fit_loop(
    model: TrainableModel,
    strategy: Strategy,
    steps: ReplicaSteps,
    x: Any,
    *,
    jit_compile: bool = False,
    epochs: int = 1,
    verbose: str | int = "auto",
    callbacks: Sequence[Callback] | None = None,
    validation_data: Any = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_freq: int = 1,
    **unsupported: Any,
) -> History:
    """Train with the steps scheduled on the workers (``fit``'s arguments already checked).

    ``unsupported`` are ``fit``'s arguments that make no sense here (``y``, ``batch_size``,
    ``sample_weight``, ``class_weight``, ``validation_batch_size``...): any of them not
    ``None`` raises ``InvalidArgumentError``.
    """
    train_fn = dataset_function(x, "x", unsupported, shuffle_option="shuffle")
    val_fn = None
    if validation_data is not None:
        val_fn = dataset_function(validation_data, "validation_data", unsupported, "validation_batch_size")
    _refuse(**unsupported)
    steps_per_epoch = _require_steps("fit", "steps_per_epoch", steps_per_epoch, _MAY_NOT_END)
    _check_model(model, callbacks, jit_compile)
    if validation_data is not None:
        validation_steps = _require_steps("validation_data", "validation_steps", validation_steps,
                                          "(the number of test steps the workers run at each validation).")
    coordinator = ClusterCoordinator(strategy)
    train_iterator = iter(coordinator.create_per_worker_dataset(train_fn))
    val_iterator = iter(coordinator.create_per_worker_dataset(val_fn)) if val_fn is not None else None
    callback_list, history, backup_callback = make_callbacks(
        model, callbacks, _verbose(verbose), {"epochs": epochs, "steps": steps_per_epoch, "in_fit": True})
    model.history = history
    model.stop_training = False
    callback_list.on_train_begin()
    backup = _open_backup(model, strategy, backup_callback, history, callback_list)
    logs: dict[str, float] = {}
    epoch_numbers: Iterator[int] = (backup.epochs(epochs, initial_epoch) if backup is not None
                                    else iter(range(initial_epoch, epochs)))
    for epoch in epoch_numbers:
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        _train_epoch(model, strategy, steps, coordinator, train_iterator, steps_per_epoch, callback_list)
        logs = metric_logs(model)
        # validation_steps is checked given with validation_data, which val_iterator comes from
        if val_iterator is not None and validation_steps is not None and (epoch + 1) % validation_freq == 0:
            val_logs = _test(model, strategy, steps, coordinator, val_iterator, validation_steps, callback_list)
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    if backup is not None:
        backup.finish()
    callback_list.on_train_end(logs)
    return history


def _open_backup(model: TrainableModel, strategy: Strategy, callback: BackupAndRestore | None, history: History,
                 callback_list: CallbackList) -> _Backup | None:
    """The coordinator's backup of everything ``fit`` changes (restored now, if there is one)."""
    if callback is None:
        return None
    metrics = Checkpoint(**{f"metric_{i}": m for i, m in enumerate(model.metrics)})
    stateful = [c for c in callback_list.callbacks if c is not history and callable(getattr(c, "state_dict", None))]
    states = Checkpoint(**{f"callback_{i}": c for i, c in enumerate(stateful)})
    checkpoint = Checkpoint(model=model, optimizer=model.optimizer, metrics=metrics, history=history, callbacks=states)
    return _Backup(checkpoint, callback.backup_dir, save_freq="epoch", delete_checkpoint=callback.delete_checkpoint,
                   handle_preemption=False, strategy=strategy)


def _train_epoch(model: TrainableModel, strategy: Strategy, steps: ReplicaSteps, coordinator: ClusterCoordinator,
                 iterator: Any, steps_per_epoch: int, callback_list: CallbackList) -> None:
    wants_logs = callback_list.wants_batch_logs("train")
    step = 0
    for count in _executions(steps_per_epoch, model.steps_per_execution):
        callback_list.on_train_batch_begin(step)
        coordinator.schedule(run_train_steps, args=(strategy, steps, iterator, count))
        step += count
        # The metrics' values so far: every function that has ended counts.
        callback_list.on_train_batch_end(step - 1, metric_logs(model) if wants_logs else {})
        if model.stop_training:
            break
    coordinator.join()


def _test(model: TrainableModel, strategy: Strategy, steps: ReplicaSteps, coordinator: ClusterCoordinator,
          iterator: Any, num_steps: int, callback_list: CallbackList) -> dict[str, float]:
    wants_logs = callback_list.wants_batch_logs("test")
    model.reset_metrics()
    callback_list.on_test_begin()
    step = 0
    for count in _executions(num_steps, model.steps_per_execution):
        callback_list.on_test_batch_begin(step)
        coordinator.schedule(run_test_steps, args=(strategy, steps, iterator, count))
        step += count
        callback_list.on_test_batch_end(step - 1, metric_logs(model) if wants_logs else {})
    coordinator.join()
    logs = metric_logs(model)
    callback_list.on_test_end(logs)
    return logs


# -- evaluate --------------------------------------------------------------------------------------------
def evaluate_loop(
    model: TrainableModel,
    strategy: Strategy,
    steps: ReplicaSteps,
    x: Any,
    *,
    jit_compile: bool = False,
    verbose: str | int = "auto",
    num_steps: int | None = None,
    callbacks: Sequence[Callback] | None = None,
    **unsupported: Any,
) -> dict[str, float]:
    """Every metric's global value over ``num_steps`` test steps scheduled on the workers."""
    fn = dataset_function(x, "x", unsupported)
    _refuse(**unsupported)
    num_steps = _require_steps("evaluate", "steps", num_steps, _MAY_NOT_END)
    _check_model(model, callbacks, jit_compile)
    coordinator = ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(fn))
    callback_list, _, _ = make_callbacks(model, callbacks, _verbose(verbose), {"steps": num_steps, "in_fit": False},
                                         history=False)
    return _test(model, strategy, steps, coordinator, iterator, num_steps, callback_list)
