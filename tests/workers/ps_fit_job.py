"""Keras ``fit``/``evaluate``/``predict`` under ParameterServerStrategy (tests/test_ps_fit.py).

One program (``td.ps.create_in_process_cluster``: 2 workers, 1 ps). The model counts the
train-mode forwards it runs in a buffer made in scope, one slot per worker and one for the
coordinator (buffer changes made on a worker reach the ps as deltas), and the coordinator's
``ReplicaSteps.train_step`` is replaced by one that counts its calls. Prints one JSON line
``RESULT {...}``.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from torch import nn

import torch_distribute as td
from torch_distribute.keras.replica_steps import ReplicaSteps

EPOCHS, STEPS_PER_EPOCH, STEPS_PER_EXECUTION, VAL_STEPS = 2, 8, 2, 2
COORDINATOR_SLOT = 2


class CountingRegressor(td.keras.Model):
    """A linear regression that counts its train-mode forwards by worker (slot 2: the coordinator)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 1)
        self.register_buffer("train_forwards", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            index = td.coordinator.experimental_get_current_worker_index()
            self.train_forwards[COORDINATOR_SLOT if index is None else index] += 1
        return self.dense(x)


class Recorder(td.keras.callbacks.Callback):
    def __init__(self, model: CountingRegressor) -> None:
        super().__init__()
        self.counted = model
        self.train_batches: list[tuple[int, list[str]]] = []
        self.epoch_forwards: list[list[float]] = []
        self.epochs: list[int] = []

    def on_train_batch_end(self, batch, logs=None):
        self.train_batches.append((batch, sorted(logs or {})))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)
        self.epoch_forwards.append(self.counted.state_dict()["train_forwards"].tolist())


def dataset_fn(input_context):
    """An endless stream of batches of 16 rows of y = x @ w + 1 (per worker seed)."""
    generator = torch.Generator().manual_seed(input_context.input_pipeline_id)
    w = torch.tensor([[1.0], [-2.0], [3.0], [0.5]])
    while True:
        x = torch.randn(16, 4, generator=generator)
        yield x, x @ w + 1.0


def _state(model: td.keras.Model) -> list[float]:
    """The model's parameters (read from the servers) and the optimizer's momentum buffers, flat."""
    values = [v.reshape(-1) for v in model.state_dict().values()]
    for state in model.optimizer.state_dict()["state"].values():
        values += [v.reshape(-1) for v in state.values() if isinstance(v, torch.Tensor)]
    return torch.cat(values).tolist()


class Snapshots(td.keras.callbacks.Callback):
    """The epochs begun, and the state at each epoch's beginning and end."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        super().__init__()
        self.interrupt_at = interrupt_at
        self.begun: list[int] = []
        self.at_begin: dict[int, list[float]] = {}
        self.at_end: dict[int, list[float]] = {}

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.interrupt_at:
            raise RuntimeError("the coordinator stops here")
        self.begun.append(epoch)
        self.at_begin[epoch] = _state(self.model)

    def on_epoch_end(self, epoch, logs=None):
        self.at_end[epoch] = _state(self.model)


def backup_and_restore_across_a_restart(strategy, creator) -> dict:
    """TensorFlow's parameter server tutorial: fit with BackupAndRestore stops after two epochs;
    a new model and optimizer (what a restarted coordinator makes) resume from the backup."""
    backup_dir = tempfile.mkdtemp()

    def fit(interrupt_at):
        torch.manual_seed(len(os.listdir(backup_dir)) + 11)  # each "coordinator" starts elsewhere
        with strategy.scope():
            model = td.keras.Model(nn.Linear(4, 1))
        model.compile(optimizer=td.keras.optimizers.SGD(learning_rate=0.02, momentum=0.9), loss="mse")
        snapshots = Snapshots(interrupt_at)
        callbacks = [td.keras.callbacks.BackupAndRestore(backup_dir=backup_dir), snapshots]
        try:
            history = model.fit(creator, epochs=4, steps_per_epoch=3, callbacks=callbacks, verbose=0)
        except RuntimeError:
            history = None
        return snapshots, history

    first, _ = fit(interrupt_at=2)
    files_after_crash = sorted(os.listdir(backup_dir))
    second, history = fit(interrupt_at=None)
    return {"first_begun": first.begun, "second_begun": second.begun,
            "restored_equal": second.at_begin[2] == first.at_end[1],
            "history": history.history, "files_after_crash": files_after_crash,
            "files_at_end": sorted(os.listdir(backup_dir)),
            "save_freq_error": error_of(lambda: history.model.fit(
                creator, epochs=1, steps_per_epoch=1, verbose=0,
                callbacks=[td.keras.callbacks.BackupAndRestore(backup_dir, save_freq=2)]))}


def keras3_model_refused(strategy) -> str:
    """A Keras 3 model made in ParameterServerStrategy.scope(): the error it gets (a
    td.KerasUnsupportedError when it is made), or why nothing was tried."""
    os.environ["KERAS_BACKEND"] = "torch"
    try:
        import keras
    except ImportError:
        return "keras is not installed"

    def make():
        with strategy.scope():
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])

    try:
        make()
    except td.KerasUnsupportedError as error:
        return f"KerasUnsupportedError: {error}"
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {error}"
    return "no error"


def error_of(call) -> str:
    try:
        call()
    except td.InvalidArgumentError as error:
        return f"InvalidArgumentError: {error}"
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {error}"
    return "no error"


if __name__ == "__main__":
    cluster_resolver = td.ps.create_in_process_cluster(num_workers=2, num_ps=1)
    strategy = td.ParameterServerStrategy(cluster_resolver, startup_timeout=60)
    torch.manual_seed(0)
    with strategy.scope():
        model = CountingRegressor()
    model.compile(optimizer=td.keras.optimizers.SGD(learning_rate=0.05), loss="mse", metrics=["mae"],
                  steps_per_execution=STEPS_PER_EXECUTION)

    coordinator_train_steps = []
    original_train_step = ReplicaSteps.train_step

    def counting_train_step(self, *args, **kwargs):
        coordinator_train_steps.append(1)
        return original_train_step(self, *args, **kwargs)

    ReplicaSteps.train_step = counting_train_step  # on the coordinator only: workers import their own

    recorder = Recorder(model)
    creator = td.keras.utils.experimental.DatasetCreator(dataset_fn)
    history = model.fit(creator, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, callbacks=[recorder],
                        validation_data=creator, validation_steps=VAL_STEPS)  # verbose "auto": 2 here
    evaluation = model.evaluate(dataset_fn, steps=4, return_dict=True, verbose=0)
    coordinator = td.coordinator.ClusterCoordinator(strategy)
    stats_before_loader = dict(coordinator.worker_stats)

    # TensorFlow's form: fit on a dataset (here a DataLoader over a TensorDataset with a repeating
    # random sampler), sent to every worker by value and read there.
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4, generator=generator)
    rows = torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 1.0)
    loader = torch.utils.data.DataLoader(rows, batch_size=16, sampler=torch.utils.data.RandomSampler(
        rows, replacement=True, num_samples=10_000))
    with strategy.scope():
        loader_model = td.keras.Model(nn.Linear(4, 1))
    loader_model.compile(optimizer=td.keras.optimizers.SGD(learning_rate=0.05), loss="mse", steps_per_execution=4)
    loader_history = loader_model.fit(loader, epochs=3, steps_per_epoch=8, verbose=0,
                                      validation_data=rows, validation_steps=2, validation_batch_size=32)
    loader_evaluation = loader_model.evaluate(rows, batch_size=64, steps=4, return_dict=True, verbose=0)
    per_worker = coordinator.create_per_worker_dataset(loader)
    first_batch = coordinator.schedule(lambda it: next(it)[0].shape[0], args=(iter(per_worker),)).fetch()
    loader_functions = sum(coordinator.worker_stats.values()) - sum(stats_before_loader.values())
    backup = backup_and_restore_across_a_restart(strategy, creator)
    keras3_error = keras3_model_refused(strategy)
    result = {
        "history": history.history,
        "train_batches": recorder.train_batches,
        "epochs": recorder.epochs,
        "epoch_forwards": recorder.epoch_forwards,
        "final_forwards": model.state_dict()["train_forwards"].tolist(),
        "coordinator_train_steps": len(coordinator_train_steps),
        "worker_stats": stats_before_loader,
        "evaluate": evaluation,
        "loader_history": loader_history.history,
        "loader_evaluate": loader_evaluation,
        "loader_functions": loader_functions,
        "first_batch": first_batch,
        "backup": backup,
        "keras3_error": keras3_error,
        "errors": {
            "generator": error_of(lambda: loader_model.fit((b for b in loader), epochs=1, steps_per_epoch=1,
                                                           verbose=0)),
            "per_worker_generator": error_of(lambda: coordinator.create_per_worker_dataset(b for b in loader)),
            "loader_batch_size": error_of(lambda: loader_model.fit(loader, batch_size=8, epochs=1, steps_per_epoch=1,
                                                                   verbose=0)),
            "tensors": error_of(lambda: model.fit(torch.ones(8, 4), torch.ones(8, 1), epochs=1, verbose=0)),
            "no_steps": error_of(lambda: model.fit(creator, epochs=1, verbose=0)),
            "evaluate_tensors": error_of(lambda: model.evaluate(torch.ones(8, 4), torch.ones(8, 1), verbose=0)),
            "predict": error_of(lambda: model.predict(torch.ones(8, 4), verbose=0)),
            "shuffle": error_of(lambda: model.fit(creator, shuffle=False, epochs=1, steps_per_epoch=1, verbose=0)),
            "validation_tuple": error_of(lambda: model.fit(creator, epochs=1, steps_per_epoch=1, verbose=0,
                                                           validation_data=(torch.ones(8, 4), torch.ones(8, 1)))),
            "no_validation_steps": error_of(lambda: model.fit(creator, epochs=1, steps_per_epoch=1, verbose=0,
                                                              validation_data=creator)),
            "batch_size": error_of(lambda: model.fit(creator, batch_size=8, epochs=1, steps_per_epoch=1,
                                                     verbose=0)),
        },
    }
    print("RESULT " + json.dumps(result), flush=True)
