"""The Keras 3 tutorial under MultiWorkerMirroredStrategy: 2 worker processes give one
device's numbers, with a worker killed mid-training and the job restarted by the launcher.

One job (``torch-distribute launch --nproc 2 --max-restarts 1``) runs TensorFlow's
"Distributed training with Keras" tutorial in its Keras 3 form (``tests/keras3_tutorial.py``)
with ``keras.callbacks.BackupAndRestore`` added, as TensorFlow's multi-worker tutorial does,
and an ``EarlyStopping`` that stops every worker after the last epoch and restores the weights
of the epoch before (as it does on one device).
On the first attempt worker 1 kills itself (SIGKILL) when the third epoch begins; the launcher
restarts both workers, which restore the chief's backup and finish. Both workers then hold
the weights one device gets from the uninterrupted tutorial, ``evaluate`` and ``predict``
agree, the progress bar and the files are the chief's, and the chief's ``model.keras`` loads
in plain Keras. The tutorial's model has no input shape (its weights are built at ``fit``'s
first batch, in the scope). The same job also checks that each worker draws its own dropout
masks, that a Keras metric updated inside ``strategy.run`` reads every worker's rows, and that
losses layers add (a sum and a mean over the rows) and a kernel regularizer's penalty give
one device's training.

This file is also the worker script (``worker()``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys

import pytest

RESULT = "KERAS3MW "
KILL_AT_EPOCH = 2


def worker() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import keras
    import keras3_tutorial

    import torch_distribute as td
    from torch_distribute.keras3 import forward

    cuts = []  # (global rows, this worker's rows) of every spread forward
    row_ranges = forward.row_ranges

    def counted(rows, *args, **kwargs):
        start, sizes = row_ranges(rows, *args, **kwargs)
        cuts.append((rows, sum(sizes)))
        return start, sizes

    forward.row_ranges = counted
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = td.MultiWorkerMirroredStrategy(communication_options=td.CommunicationOptions(timeout_seconds=60))
    rank = strategy.extended.worker_index
    attempt = int(os.environ.get("TD_RESTART_COUNT", "0"))

    class KillWorkerOne(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if attempt == 0 and rank == 1 and epoch == KILL_AT_EPOCH:
                os.kill(os.getpid(), signal.SIGKILL)

    backup = keras.callbacks.BackupAndRestore(backup_dir=os.path.join(args.out, "backup"))
    # The model's first layer has no input shape: it builds its weights at fit's first batch.
    result = keras3_tutorial.run(strategy, args.out, num_replicas=strategy.num_replicas_in_sync,
                                 extra_callbacks=[backup, KillWorkerOne()], verbose=2, early_stopping=True,
                                 input_shape=False)
    masks = dropout_masks(keras, strategy)
    metrics = metrics_in_run(keras, strategy)
    added = fit_with_added_losses(keras, strategy)
    print(RESULT + json.dumps({"rank": rank, "attempt": attempt, "cuts": cuts, "masks": masks, "metrics": metrics,
                               "added_losses": added, **result}), flush=True)


def fit_with_added_losses(keras, strategy) -> dict:
    """A model whose layers add a sum and a mean over the batch (``add_loss``) and whose first
    layer has a kernel regularizer, fitted on batches of 9 rows (5 and 4 per worker);
    ``strategy=None``: one device."""
    import contextlib

    import numpy as np

    class AddsLoss(keras.layers.Layer):
        def __init__(self, reduce, **kwargs):
            super().__init__(**kwargs)
            self.reduce = reduce

        def call(self, x):
            self.add_loss(0.001 * getattr(keras.ops, self.reduce)(keras.ops.square(x)))
            return x

    data = np.random.default_rng(0).random((18, 4), dtype=np.float32)
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        # A kernel regularizer too: its penalty is computed on the weights, the same on every
        # worker (it counted once per worker before).
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, kernel_regularizer=keras.regularizers.L2(0.5)),
                                  AddsLoss("sum"), AddsLoss("mean"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(data, data[:, :1], batch_size=9, epochs=2, shuffle=False, verbose=0)
    return {"loss": history.history["loss"], "weights": [w.tolist() for w in model.get_weights()]}


def metrics_in_run(keras, strategy) -> list:
    """A Keras metric updated inside strategy.run on each worker's rows, read after each of
    two epochs (reset between): every worker reads the metric of every row."""
    import torch

    with strategy.scope():
        mean = keras.metrics.Mean()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(12.0)), batch_size=4)
    read = []
    for epoch in range(2):
        for (values,) in strategy.experimental_distribute_dataset(loader):
            strategy.run(lambda v, scale: mean.update_state(v * scale), args=(values, epoch + 1))
        read.append(float(mean.result()))
        mean.reset_state()
    return read


def dropout_masks(keras, strategy) -> dict:
    """This worker's dropout masks (on its rows of a batch of ones) for an unseeded and a seeded
    Dropout over two steps, and the seed generators' states afterwards."""
    import numpy as np
    import torch

    out = {}
    for name, seed in (("unseeded", None), ("seeded", 7)):
        rows: list = []

        class Recorder(keras.layers.Layer):
            def call(self, x, rows=rows):
                if x.device.type != "meta":
                    rows.append((x != 0).to(torch.int64).reshape(-1).tolist())
                return x

        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5, seed=seed), Recorder(),
                                      keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        for _ in range(2):
            model.train_on_batch(np.ones((4, 64), np.float32), np.zeros((4, 1), np.float32))
        out[name] = {"rows": rows, "states": [v.numpy().tolist() for v in model.non_trainable_variables]}
    return out


@pytest.mark.timeout(240)
def test_tutorial_on_two_workers_killed_and_restarted_equals_one_device(tmp_path):
    keras3_tutorial = pytest.importorskip("keras3_tutorial", reason="needs keras (the test extra installs it)")
    import keras
    import numpy as np

    from torch_distribute.cluster.launcher import launch

    stdout, stderr = io.StringIO(), io.StringIO()
    code = launch([__file__, "--out", str(tmp_path)], nproc=2, max_restarts=1, grace_period=3, timeout=200,
                  stdout=stdout, stderr=stderr)
    out, err = stdout.getvalue(), stderr.getvalue()
    assert code == 0, (out + err)[-5000:]
    assert "restarting all workers" in err, err[-3000:]
    results = {}
    for line in out.splitlines():
        payload = line.split("] ", 1)[1] if line.startswith("[rank ") else line
        if payload.startswith(RESULT):
            data = json.loads(payload[len(RESULT):])
            results[data["rank"]] = data
    assert sorted(results) == [0, 1] and {r["attempt"] for r in results.values()} == {1}, out[-3000:]
    assert all(not r["built_in_scope"] and r["served"] for r in results.values())
    # Each worker computed the forward of its half of every global batch.
    assert len(results[0]["cuts"]) == len(results[1]["cuts"]) > 0
    for (rows, mine), (same_rows, theirs) in zip(results[0]["cuts"], results[1]["cuts"], strict=True):
        assert rows == same_rows and mine + theirs == rows and abs(mine - theirs) <= 1

    # Each worker draws its own dropout masks (they share a seed, so that they read the same
    # batches): before, worker 1's rows got worker 0's pattern.
    for name in ("unseeded", "seeded"):
        first, second = (results[rank]["masks"][name] for rank in (0, 1))
        assert len(first["rows"]) == len(second["rows"]) == 2
        for step in range(2):
            assert first["rows"][step] != second["rows"][step], name
        assert first["rows"][0] != first["rows"][1], name
        assert first["states"] == second["states"], name  # the generators stay equal on every worker

    # Losses the layers add (a sum and a mean over the rows): one device's.
    expected = fit_with_added_losses(keras, None)
    for rank in (0, 1):
        got = results[rank]["added_losses"]
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
        for actual, want in zip(got["weights"], expected["weights"], strict=True):
            np.testing.assert_allclose(actual, want, rtol=1e-5, atol=1e-6)
    # A Keras metric updated inside strategy.run: every worker reads the mean over every row.
    assert results[0]["metrics"] == results[1]["metrics"] == [5.5, 11.0]

    reference = keras3_tutorial.run(None, str(tmp_path / "one_device"), num_replicas=2, early_stopping=True)
    for rank in (0, 1):
        got = results[rank]
        for actual, expected in zip(got["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
        for key in ("evaluate", "predict"):
            np.testing.assert_allclose(got[key], reference[key], rtol=1e-5, atol=1e-6)
        # The restarted fit resumed after the two epochs the chief had backed up.
        for key, values in reference["history"].items():
            np.testing.assert_allclose(got["history"][key], values[KILL_AT_EPOCH:], rtol=1e-5, atol=1e-6)
        assert got["learning_rates"] == reference["learning_rates"][KILL_AT_EPOCH:]
        assert got["optimizer_iterations"] == reference["optimizer_iterations"]
        assert got["stopped_epoch"] == reference["stopped_epoch"] == 3  # stopped, best weights restored
    # Only the chief prints the progress bar and writes files; the backup is gone at the end.
    assert "[rank 0] Epoch 3/4" in out and "[rank 1] Epoch" not in out, out[-3000:]
    assert sorted(os.listdir(tmp_path / "training_checkpoints")) == [
        f"ckpt_{epoch}.weights.h5" for epoch in range(1, 5)]
    assert not (tmp_path / "backup").exists()
    # The chief's whole-model file, in plain Keras (outside any strategy).
    (_, _), (x_eval, y_eval) = keras3_tutorial.mnist_like()
    plain = keras.models.load_model(tmp_path / "model.keras")
    plain.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    np.testing.assert_allclose(plain.evaluate(x_eval, y_eval, batch_size=32, verbose=0),
                               reference["unreplicated_evaluate"], rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    worker()
