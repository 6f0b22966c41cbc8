"""td.keras callbacks do what they say: files, early stop, CSV rows, event files, resumption."""

from __future__ import annotations

import csv
import os

import pytest
import torch

import torch_distribute as td
from torch_distribute.keras import callbacks as cbs

pytestmark = pytest.mark.timeout(120)


def _data(n: int = 40):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3


def _model(strategy=None, lr: float = 0.05) -> td.keras.Model:
    torch.manual_seed(0)
    if strategy is None:
        model = td.keras.Model(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    else:
        with strategy.scope():
            model = td.keras.Model(torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    model.compile(td.keras.optimizers.SGD(learning_rate=lr, momentum=0.5), "mse", metrics=["mae"])
    return model


def _fake_val(values):
    """A callback that puts ``val_score`` = values[epoch] in the logs (before the others see them)."""
    return cbs.LambdaCallback(on_epoch_end=lambda epoch, logs: logs.__setitem__("val_score", values[epoch]))


def test_model_checkpoint_every_epoch_with_formatted_names(tmp_path):
    x, y = _data()
    model = _model()
    path = str(tmp_path / "ckpt-{epoch:02d}-{val_loss:.3f}.pt")
    history = model.fit(x, y, batch_size=8, epochs=3, validation_data=(x, y), verbose=0,
                        callbacks=[cbs.ModelCheckpoint(path, monitor="val_loss")])
    names = sorted(os.listdir(tmp_path))
    assert names == [f"ckpt-{e + 1:02d}-{v:.3f}.pt" for e, v in enumerate(history.history["val_loss"])]
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    td.Checkpoint(model=fresh).read(tmp_path / names[-1])  # loads into the bare module
    torch.testing.assert_close(fresh[0].weight, model.module[0].weight)


def test_model_checkpoint_save_best_only_and_load_weights(tmp_path):
    x, y = _data()
    model = _model()
    saved_states = {}
    keep = cbs.LambdaCallback(on_epoch_end=lambda e, logs: saved_states.__setitem__(e, {
        k: v.clone() for k, v in model.module.state_dict().items()}))
    best = cbs.ModelCheckpoint(str(tmp_path / "best-{epoch}.pt"), monitor="val_score", mode="max", save_best_only=True)
    model.fit(x, y, batch_size=8, epochs=5, verbose=0, callbacks=[_fake_val([0.1, 0.5, 0.3, 0.7, 0.6]), keep, best])
    assert sorted(os.listdir(tmp_path)) == ["best-1.pt", "best-2.pt", "best-4.pt"]
    assert best.best == 0.7
    model.load_weights(str(tmp_path / "best-4.pt"))
    torch.testing.assert_close(model.module.state_dict(), saved_states[3])


def test_early_stopping_epoch_and_restore_best_weights():
    x, y = _data()
    model = _model()
    states = {}
    keep = cbs.LambdaCallback(on_epoch_end=lambda e, logs: states.__setitem__(e, {
        k: v.clone() for k, v in model.state_dict().items()}))
    stop = cbs.EarlyStopping(monitor="val_score", patience=2, restore_best_weights=True)
    history = model.fit(x, y, batch_size=8, epochs=10, verbose=0,
                        callbacks=[_fake_val([1.0, 0.5, 0.6, 0.4, 0.45, 0.41, 0.3, 0.2, 0.1, 0.0]), keep, stop])
    # best 0.4 at epoch 3; epochs 4 and 5 do not improve -> stop at epoch 5 (index)
    assert stop.stopped_epoch == 5 and history.epoch == [0, 1, 2, 3, 4, 5]
    assert stop.best_epoch == 3
    torch.testing.assert_close(model.state_dict(), states[3])


def test_csv_logger_rows_and_append(tmp_path):
    x, y = _data()
    model = _model()
    path = tmp_path / "log.csv"
    history = model.fit(x, y, batch_size=8, epochs=2, validation_data=(x, y), verbose=0,
                        callbacks=[cbs.CSVLogger(str(path))])
    model.fit(x, y, batch_size=8, epochs=1, validation_data=(x, y), verbose=0,
              callbacks=[cbs.CSVLogger(str(path), append=True)])
    rows = list(csv.reader(open(path)))
    assert rows[0] == ["epoch", "loss", "mae", "val_loss", "val_mae"]
    assert [r[0] for r in rows[1:]] == ["0", "1", "0"]
    assert float(rows[2][1]) == pytest.approx(history.history["loss"][1])


def test_tensorboard_writes_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=8, epochs=2, validation_data=(x, y), verbose=0,
              callbacks=[cbs.TensorBoard(log_dir=str(tmp_path), update_freq=2)])
    train = EventAccumulator(str(tmp_path / "train"))
    train.Reload()
    validation = EventAccumulator(str(tmp_path / "validation"))
    validation.Reload()
    assert {"epoch_loss", "epoch_mae", "batch_loss"} <= set(train.Tags()["scalars"])
    assert [e.step for e in train.Scalars("epoch_loss")] == [0, 1]
    assert [e.step for e in train.Scalars("batch_loss")] == [2, 4, 6, 8, 10]
    assert {"epoch_loss", "epoch_mae"} <= set(validation.Tags()["scalars"])


def test_learning_rate_scheduler_and_lambda_hooks():
    x, y = _data()
    model = _model()
    events = []
    hooks = cbs.LambdaCallback(on_train_begin=lambda logs: events.append("train_begin"),
                               on_epoch_begin=lambda e, logs: events.append(f"epoch_begin {e}"),
                               on_train_end=lambda logs: events.append("train_end"))
    schedule = cbs.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[schedule, hooks])
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
    assert events == ["train_begin", "epoch_begin 0", "epoch_begin 1", "epoch_begin 2", "train_end"]


def test_reduce_lr_on_plateau_and_terminate_on_nan():
    x, y = _data()
    model = _model()
    plateau = cbs.ReduceLROnPlateau(monitor="val_score", factor=0.5, patience=1, min_delta=0.0)
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[_fake_val([1.0, 1.0, 1.0, 0.5]), plateau])
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)
    y_bad = y.clone()
    y_bad[9] = float("nan")
    history = model.fit(x, y_bad, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[cbs.TerminateOnNaN()])
    assert history.epoch == [0]  # stopped in the first epoch


class Crash(cbs.Callback):
    """Simulates a crash (the process dying) after ``at`` training batches in all."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt("simulated crash")


@pytest.mark.parametrize("save_freq", ["epoch", 3])
def test_backup_and_restore_resumes_bitwise(tmp_path, save_freq):
    x, y = _data(44)  # 6 batches of 8 an epoch, the last of 4 rows
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])

    def run(backup_dir, crash_at=None):
        model = _model(strategy)
        callbacks = [cbs.BackupAndRestore(str(backup_dir), save_freq=save_freq),
                     cbs.EarlyStopping(monitor="val_loss", patience=10)]
        if crash_at:
            callbacks.append(Crash(crash_at))
        history = model.fit(x, y, batch_size=8, epochs=4, validation_data=(x[:12], y[:12]), verbose=0,
                            callbacks=callbacks)
        return model, history

    reference, ref_history = run(tmp_path / "reference")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "backup", crash_at=16)  # epoch 2 (index), 4th batch
    assert td.latest_checkpoint(tmp_path / "backup") is not None
    resumed, history = run(tmp_path / "backup")
    for a, b in zip(resumed.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    assert history.history == ref_history.history and history.epoch == [0, 1, 2, 3]
    assert torch.equal(resumed.optimizer.state_dict()["state"][0]["momentum_buffer"],
                       reference.optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert td.latest_checkpoint(tmp_path / "backup") is None  # deleted once training finished
