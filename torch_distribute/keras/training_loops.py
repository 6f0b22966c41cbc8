"""The training loops of ``td.keras.Model``: ``fit``, ``evaluate`` and ``predict``.

``fit_loop``, ``evaluate_loop`` and ``predict_loop`` drive the per-replica steps of
``ReplicaSteps`` (``keras/replica_steps.py``) over the data with the model's
``train_function``/``test_function``/``predict_function`` (``strategy.run`` of a step, a
``td.function`` under ``compile(jit_compile=True)``), and run the callbacks and the backups.
The model (``keras/model.py``) checks its arguments, builds the steps from what ``compile``
made and calls these loops, which see it only through the public members listed by
``TrainableModel``: this module does not import the model.

>>> import torch, torch_distribute as td
>>> from torch_distribute.keras.replica_steps import ReplicaSteps
>>> from torch_distribute.keras.training_loops import predict_loop
>>> model = td.keras.Model(torch.nn.Linear(2, 3))
>>> outputs = predict_loop(model, model.distribute_strategy, ReplicaSteps(model), torch.ones(5, 2),
...                        batch_size=2, verbose=0)
>>> outputs.shape
torch.Size([5, 3])
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from torch_distribute import metrics as td_metrics
from torch_distribute import nest
from torch_distribute.checkpoint import Checkpoint
from torch_distribute.errors import DatasetError, FaultToleranceError, InvalidArgumentError
from torch_distribute.fault_tolerance import BackupAndRestore as _Backup
from torch_distribute.keras.callbacks.backup_and_restore import BackupAndRestore
from torch_distribute.keras.callbacks.base import Callback, CallbackList
from torch_distribute.keras.callbacks.history import History
from torch_distribute.keras.callbacks.progbar_logger import ProgbarLogger
from torch_distribute.keras.data_adapter import DataHandler, make_handler
from torch_distribute.keras.replica_steps import ReplicaSteps
from torch_distribute.mixed_precision import LossScaleOptimizer

if TYPE_CHECKING:
    from torch_distribute.strategies import Strategy
    from torch_distribute.strategies.fault_tolerant import FaultTolerantTraining

__all__ = [
    "TrainableModel",
    "check_fit_arguments",
    "check_int",
    "class_weights",
    "evaluate_loop",
    "fit_loop",
    "make_callbacks",
    "metric_logs",
    "predict_loop",
    "split_validation",
]


class TrainableModel(Protocol):
    """What the loops use of a model: ``td.keras.Model`` has all of it."""

    stop_training: bool
    history: History | None
    optimizer: torch.optim.Optimizer | LossScaleOptimizer | None
    steps_per_execution: int

    @property
    def metrics(self) -> list[td_metrics.Metric]: ...

    def reset_metrics(self) -> None: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def make_train_function(self) -> Callable[..., Any]: ...

    def make_test_function(self) -> Callable[..., Any]: ...

    def make_predict_function(self) -> Callable[..., Any]: ...


class _FitState:
    """What a backup must hold besides the objects: the shuffling seed."""

    def __init__(self, seed: int):
        self.seed = seed

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])


# -- fit -----------------------------------------------------------------------------------------
def fit_loop(
    model: TrainableModel,
    strategy: Strategy,
    steps: ReplicaSteps,
    x: Any,
    y: Any,
    sample_weight: Any = None,
    *,
    batch_size: int | None = None,
    epochs: int = 1,
    verbose: str | int = "auto",
    callbacks: Sequence[Callback] | None = None,
    validation_data: Any = None,
    shuffle: bool = True,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int = 1,
) -> History:
    """Train ``model`` for ``epochs`` epochs under ``strategy`` (the arguments already checked)."""
    ft = strategy.extended.fault_tolerance
    # Under fault tolerance no collective may run outside the steps (a worker that joins
    # would make it alone): the chief's seed reaches every worker with the first quorum.
    fit_state = _FitState(_shared_seed(strategy) if ft is None else _local_seed())
    train = make_handler(strategy, x, y, sample_weight, batch_size, shuffle, steps_per_epoch, seed=fit_state.seed)
    val = None
    if validation_data is not None:
        vx, vy, vw = _validation_parts(validation_data)
        val = make_handler(strategy, vx, vy, vw, validation_batch_size or (batch_size if vy is not None else None),
                           False, validation_steps, what="validation_data")
    callback_list, history, backup_callback = make_callbacks(
        model, callbacks, verbose, {"epochs": epochs, "steps": train.steps, "in_fit": True})
    model.history = history
    model.stop_training = False
    callback_list.on_train_begin()
    epoch_starting = (fit_in_fault_tolerant_job(ft, backup_callback, train, steps_per_epoch, fit_state)
                      if ft is not None else None)
    if ft is not None:
        _fit_optimizer_state(ft, model.optimizer)
    backup = _open_backup(model, strategy, backup_callback, train, fit_state, history, callback_list)
    if backup is not None and hasattr(train.source, "seed"):
        train.source.seed = fit_state.seed
    if backup is not None:
        train.restore_position(mid_epoch=backup.step_in_epoch > 0)
    epoch_numbers: Iterator[int] | range = (backup.epochs(epochs, initial_epoch) if backup is not None
                                            else ft.epochs(epochs, initial_epoch) if ft is not None
                                            else range(initial_epoch, epochs))
    logs: dict[str, float] = {}
    try:
        for epoch in epoch_numbers:
            resume_step = backup.step_in_epoch if backup is not None else 0
            if resume_step == 0:
                model.reset_metrics()
            callback_list.on_epoch_begin(epoch)
            if epoch_starting is not None:
                epoch_starting()
            with _dataset_key(ft, f"fit/train/{epoch}"):
                batches = train.epoch(epoch)
            ran = _train_epoch(model, steps, backup.steps(batches) if backup is not None else batches, train,
                               callback_list, resume_step)
            if ran is None:  # a stream that had nothing left
                _warn_ran_out(epoch)
                break
            logs = metric_logs(model)
            if val is not None and (epoch + 1) % validation_freq == 0:
                with _dataset_key(ft, f"fit/val/{epoch}"):
                    logs.update({f"val_{k}": v for k, v in _test_loop(model, steps, val, callback_list, epoch).items()})
            callback_list.on_epoch_end(epoch, logs)
            if train.exhausted:
                _warn_ran_out(epoch)
                model.stop_training = True
            if model.stop_training:
                break
    finally:
        if ft is not None:
            ft.unregister_state("fit")
            ft.unregister_state("fit/loss_scale")
            ft.resumes_inside_epoch = True
    if backup is not None:
        backup.finish()
    callback_list.on_train_end(logs)
    return history


def fit_in_fault_tolerant_job(ft: FaultTolerantTraining, backup_callback: BackupAndRestore | None,
                              train: DataHandler, steps_per_epoch: int | None,
                              fit_state: _FitState) -> Callable[[], None]:
    """What ``fit`` hands a worker that joins (``ft.register_state``): the shuffling seed and
    where the data's generators stood when the epoch started (the returned function takes
    note of that, before each epoch's batches are made); the data's position inside the
    epoch comes with its distributed dataset (``fit/train/<epoch>``). Refuses what cannot
    resume from a peer yet, saying what to do instead."""
    if backup_callback is not None:
        raise FaultToleranceError(
            "fit(callbacks=[BackupAndRestore(...)]) under FaultTolerance: a worker that joins takes the job's "
            "state from a live worker, not from a backup. Leave BackupAndRestore out (use ModelCheckpoint for "
            "copies on disk).")
    if steps_per_epoch is not None and train.source is not None:
        raise FaultToleranceError(
            "fit(steps_per_epoch=...) under FaultTolerance: one stream of batches across epochs cannot resume "
            "on a worker that joins yet. Leave steps_per_epoch out (one pass of the data per epoch).")

    epoch_start: list[Any] = [g.get_state() for g in train.generators()]

    def epoch_starting() -> None:
        epoch_start[:] = [g.get_state() for g in train.generators()]

    def state() -> dict[str, Any]:
        return {"seed": fit_state.seed, "generators": list(epoch_start)}

    def load(value: dict[str, Any]) -> None:
        fit_state.seed = int(value["seed"])
        if hasattr(train.source, "seed"):
            train.source.seed = fit_state.seed
        for generator, generator_state in zip(train.generators(), value["generators"], strict=False):
            generator.set_state(generator_state)

    ft.register_state("fit", state, load)
    ft.resumes_inside_epoch = False  # an epoch's batches are made once (a one-shot stream)
    return epoch_starting


def _fit_optimizer_state(ft: FaultTolerantTraining, optimizer: Any) -> None:
    """A mixed-precision model's loss scale goes to a joining worker too (the inner
    optimizer is the strategy's already)."""
    if isinstance(optimizer, LossScaleOptimizer):
        ft.register_state("fit/loss_scale", lambda: optimizer.state_dict()["loss_scale"],
                          lambda scale: optimizer.load_state_dict(
                              {"optimizer": optimizer.inner_optimizer.state_dict(), "loss_scale": scale}))


def _dataset_key(ft: FaultTolerantTraining | None, key: str) -> contextlib.AbstractContextManager[None]:
    return ft.dataset_key(key) if ft is not None else contextlib.nullcontext()


def _train_epoch(model: TrainableModel, steps: ReplicaSteps, batches: Any, handler: DataHandler,
                 callback_list: CallbackList, first_step: int) -> int | None:
    """Train on one epoch's batches; the steps run, ``None`` if there were none to run."""
    per_execution = model.steps_per_execution
    train_function = model.make_train_function()
    wants_logs = callback_list.wants_batch_logs("train")
    step = first_step
    pending = 0
    model.train()
    try:
        for batch in batches:
            if pending == 0:
                callback_list.on_train_batch_begin(step)
            train_function(steps, batch, handler.global_rows(batch))
            step += 1
            pending += 1
            if pending == per_execution:
                pending = 0
                callback_list.on_train_batch_end(step - 1, metric_logs(model) if wants_logs else {})
                if model.stop_training:
                    break
    except DatasetError:
        if step == first_step and handler.exhausted:
            return None
        raise
    if pending:
        callback_list.on_train_batch_end(step - 1, metric_logs(model) if wants_logs else {})
    return step - first_step


# -- evaluate --------------------------------------------------------------------------------------
def evaluate_loop(
    model: TrainableModel,
    strategy: Strategy,
    steps: ReplicaSteps,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: int | None = None,
    verbose: str | int = "auto",
    num_steps: int | None = None,
    callbacks: Sequence[Callback] | None = None,
) -> dict[str, float]:
    """Every metric's value over the data (``num_steps`` batches at most), by name."""
    handler = make_handler(strategy, x, y, sample_weight, batch_size, False, num_steps)
    callback_list, _, _ = make_callbacks(model, callbacks, verbose, {"steps": handler.steps, "in_fit": False},
                                     history=False)
    return _test_loop(model, steps, handler, callback_list)


def _test_loop(model: TrainableModel, steps: ReplicaSteps, handler: DataHandler,
               callback_list: CallbackList, epoch: int = 0) -> dict[str, float]:
    wants_logs = callback_list.wants_batch_logs("test")
    test_function = model.make_test_function()
    model.reset_metrics()
    model.eval()
    callback_list.on_test_begin()
    step = 0
    for batch in handler.epoch(epoch):
        callback_list.on_test_batch_begin(step)
        test_function(steps, batch)
        callback_list.on_test_batch_end(step, metric_logs(model) if wants_logs else {})
        step += 1
    logs = metric_logs(model)
    callback_list.on_test_end(logs)
    return logs


# -- predict ---------------------------------------------------------------------------------------
def predict_loop(
    model: TrainableModel,
    strategy: Strategy,
    steps: ReplicaSteps,
    x: Any,
    *,
    batch_size: int | None = None,
    verbose: str | int = "auto",
    num_steps: int | None = None,
    callbacks: Sequence[Callback] | None = None,
) -> Any:
    """The outputs on ``x`` in its order, gathered from every replica and worker, on the CPU."""
    handler = make_handler(strategy, x, None, None, batch_size, False, num_steps, what="x")
    callback_list, _, _ = make_callbacks(model, callbacks, verbose, {"steps": handler.steps}, history=False)
    predict_function = model.make_predict_function()
    model.eval()
    callback_list.on_predict_begin()
    pieces: list[Any] = []
    for step, batch in enumerate(handler.epoch(0)):
        callback_list.on_predict_batch_begin(step)
        outputs = predict_function(steps, batch)
        gathered = nest.map_structure(lambda v: v.cpu(), strategy.gather(outputs, axis=0))
        pieces.append(gathered)
        callback_list.on_predict_batch_end(step, {"outputs": gathered})
    callback_list.on_predict_end()
    if not pieces:
        raise DatasetError("predict got no batches.")
    leaves = [nest.flatten(p)[0] for p in pieces]
    spec = nest.flatten(pieces[0])[1]
    return nest.unflatten([torch.cat([lv[i] for lv in leaves]) for i in range(len(leaves[0]))], spec)


# -- helpers -------------------------------------------------------------------------------------------
def metric_logs(model: TrainableModel) -> dict[str, float]:
    """Every metric's global value (a reduction across replicas and workers each), by name."""
    return {m.name: float(m.result()) for m in model.metrics}


def make_callbacks(model: TrainableModel, callbacks: Sequence[Callback] | None, verbose: str | int,
               params: dict[str, Any], history: bool = True) -> tuple[CallbackList, History, BackupAndRestore | None]:
    """The callbacks a loop runs (a progress bar for ``verbose`` 1 or 2, then ``callbacks``,
    then a new ``History`` when ``history``), that ``History``, and the ``BackupAndRestore``
    among ``callbacks`` if any; ``InvalidArgumentError`` for what is not a callback."""
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
    return CallbackList(ordered, model, {"verbose": verbose, **params}), record, (backups[0] if backups else None)


def _open_backup(model: TrainableModel, strategy: Strategy, callback: BackupAndRestore | None, handler: DataHandler,
                 fit_state: _FitState, history: History, callback_list: CallbackList) -> _Backup | None:
    if callback is None:
        return None
    metrics = Checkpoint(**{f"metric_{i}": m for i, m in enumerate(model.metrics)})
    stateful = [c for c in callback_list.callbacks if c is not history and callable(getattr(c, "state_dict", None))]
    states = Checkpoint(**{f"callback_{i}": c for i, c in enumerate(stateful)})
    checkpoint = Checkpoint(model=model, optimizer=model.optimizer, metrics=metrics, history=history,
                            callbacks=states, fit=fit_state, data=handler)
    return _Backup(checkpoint, callback.backup_dir, save_freq=callback.save_freq,
                   delete_checkpoint=callback.delete_checkpoint, generators=handler.generators(), strategy=strategy)


def _local_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)[0])


def _shared_seed(strategy: Strategy) -> int:
    """A shuffling seed from the torch RNG, the chief's on every worker."""
    local = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    if strategy.num_replicas_in_sync == strategy.extended.num_local_replicas:
        return int(local[0])
    return int(strategy.gather(local, axis=0)[0])


# -- argument helpers ------------------------------------------------------------------------------------
def check_int(name: str, value: Any, minimum: int) -> None:
    """Raise ``InvalidArgumentError`` unless ``value`` is an ``int`` (not a ``bool``) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}.")


def check_fit_arguments(epochs: object, initial_epoch: object, validation_freq: object) -> None:
    """``check_int`` on ``fit``'s counts, whatever the strategy."""
    check_int("epochs", epochs, minimum=0)
    check_int("initial_epoch", initial_epoch, minimum=0)
    check_int("validation_freq", validation_freq, minimum=1)


def _warn_ran_out(epoch: int) -> None:
    warnings.warn(
        f"Your input ran out of data in epoch {epoch + 1}; interrupting training. Make sure the data can "
        "give at least steps_per_epoch * epochs batches (a generator is used up after one pass: pass a "
        "list, a DataLoader or tensors instead).",
        stacklevel=4,
    )


def class_weights(class_weight: dict[int, float] | None) -> torch.Tensor | None:
    """``fit``'s ``class_weight`` dict as a table indexed by class id (missing ids weigh 1)."""
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


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float) -> tuple[Any, Any, Any, Any]:
    """``(x, y, sample_weight, validation_data)``: the last ``fraction`` of the rows held out."""
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
