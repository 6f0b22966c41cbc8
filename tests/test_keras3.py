"""Keras 3 models (KERAS_BACKEND=torch) under the strategies of one process.

TensorFlow's "Distributed training with Keras" tutorial in its Keras 3 form
(``tests/keras3_tutorial.py``) gives one device's numbers under ``MirroredStrategy`` (two
CPU replicas), ``CentralStorageStrategy`` and ``OneDeviceStrategy``: weights, history, the
learning-rate schedule, ``evaluate`` after ``load_weights``, ``predict``, and the
``model.save`` file loaded by plain Keras and in the scope. The replicas really compute, a
custom training loop with a Keras optimizer inside ``strategy.run`` is summed over the
replicas, and what cannot be served is refused with a named error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

keras3_tutorial = pytest.importorskip("keras3_tutorial", reason="needs keras (the test extra installs it)")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_distribute as td  # noqa: E402
from torch_distribute.keras3 import keras_seams, loaded  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = {
    "mirrored": lambda: td.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: td.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "one_device": lambda: td.OneDeviceStrategy("cpu"),
}


def _close(actual, expected, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64),
                               rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict:
    """The tutorial with no strategy, on the global batch of two replicas."""
    return keras3_tutorial.run(None, str(tmp_path_factory.mktemp("one_device")), num_replicas=2)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_tutorial_equals_one_device(name, one_device, tmp_path):
    strategy = STRATEGIES[name]()
    # Under MirroredStrategy the model's first layer has no input shape: it has no weights in
    # the scope and builds them at fit's first batch (before, it then trained on one device).
    input_shape = name != "mirrored"
    got = keras3_tutorial.run(strategy, str(tmp_path), num_replicas=2, input_shape=input_shape)
    assert got["built_in_scope"] is input_shape and got["served"]
    for actual, expected in zip(got["weights"], one_device["weights"], strict=True):
        _close(actual, expected, atol=1e-6)
    assert got["history"].keys() == one_device["history"].keys() == {"loss", "accuracy", "learning_rate"}
    for key, values in one_device["history"].items():
        _close(got["history"][key], values)
    assert got["learning_rates"] == one_device["learning_rates"]
    _close(got["learning_rates"], [1e-3, 1e-3, 1e-4, 1e-5])
    for key in ("evaluate", "predict", "unreplicated_evaluate", "replicated_evaluate"):
        _close(got[key], one_device[key])
    assert got["optimizer_iterations"] == one_device["optimizer_iterations"] == 4 * 4  # 4 epochs of 4 steps
    assert got["replicated_served"]  # load_model in the scope: served by the strategy again
    # The files are Keras' own: every checkpoint and the whole model, naming no torch_distribute.
    names = sorted(os.listdir(tmp_path / "training_checkpoints"))
    assert names == [f"ckpt_{epoch}.weights.h5" for epoch in range(1, 5)]
    with zipfile.ZipFile(tmp_path / "model.keras") as archive:
        config = archive.read("config.json").decode()
    assert "torch_distribute" not in config and json.loads(config)["class_name"] == "Sequential"


class _OwnTrainStep(keras.Model):
    """Keras' "customizing what happens in fit() with PyTorch" guide, with a torch module inside."""

    def __init__(self):
        super().__init__()
        self.body = keras.layers.TorchModuleWrapper(torch.nn.Linear(6, 8))
        self.head = keras.layers.Dense(2)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, x):
        return self.head(torch.relu(self.body(x)))

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        trainable = list(self.trainable_weights)
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in trainable], trainable)
        self.loss_tracker.update_state(loss)
        self.mae.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae]


def test_a_train_step_of_ones_own_and_a_torch_module_inside_equal_one_device():
    data = np.random.default_rng(4).random((30, 6), dtype=np.float32)

    def fit(strategy):
        keras.utils.set_random_seed(5)
        torch.manual_seed(5)
        with strategy.scope() if strategy is not None else _null():
            model = _OwnTrainStep()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        history = model.fit(data, data[:, :2], batch_size=10, epochs=2, shuffle=False, verbose=0)
        return history.history, model.get_weights()

    (history, weights), (one_history, one_weights) = fit(td.MirroredStrategy(["cpu:0", "cpu:1"])), fit(None)
    assert history.keys() == {"loss", "mae"}
    for key, values in one_history.items():
        _close(history[key], values)
    for actual, expected in zip(weights, one_weights, strict=True):
        _close(actual, expected, atol=1e-6)


class _Probe(keras.layers.Layer):
    """Records which replica computes it, and on how many rows."""

    seen: list = []

    def call(self, x):
        if x.device.type == "meta":  # Keras working out shapes while it builds
            return x
        replica = td.get_replica_context()
        _Probe.seen.append((None if replica is None else replica.replica_id_in_sync_group, int(x.shape[0])))
        return x


def test_every_replica_computes_its_share_of_the_batch():
    """Before the integration, fit computed the whole batch on one replica (and said nothing)."""
    seen = _Probe.seen
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), _Probe(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    seen.clear()
    model.fit(np.ones((7, 3), np.float32), np.ones((7, 1), np.float32), batch_size=7, epochs=1, verbose=0)
    assert sorted(seen) == [(0, 4), (1, 3)]
    seen.clear()
    model(np.ones((5, 3), np.float32))  # outside a step: a plain Keras call
    assert seen == [(0, 5)]


def test_custom_training_loop_with_a_keras_optimizer_equals_one_device():
    """Keras 3's own custom loop on torch (loss.backward, optimizer.apply) inside strategy.run:
    the optimizer applies the gradient summed over the replicas, once."""
    generator = np.random.default_rng(0)
    x = torch.tensor(generator.random((48, 8), dtype=np.float32))
    y = torch.tensor(generator.integers(0, 3, 48))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    global_batch = 16

    def train(strategy):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(3)])
            optimizer = keras.optimizers.SGD(0.5, momentum=0.9)

        def step(xb, yb):
            loss = loss_fn(yb, model(xb, training=True)) / global_batch
            model.zero_grad()
            loss.backward()
            variables = model.trainable_variables
            optimizer.apply([v.value.grad for v in variables], variables)
            return loss

        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
        for _ in range(2):
            for xb, yb in strategy.experimental_distribute_dataset(loader):
                strategy.run(step, args=(xb, yb))
        return model.get_weights(), int(optimizer.iterations.numpy())

    expected, expected_steps = train(td.OneDeviceStrategy("cpu"))
    got, steps = train(td.MirroredStrategy(["cpu:0", "cpu:1"]))
    assert steps == expected_steps == 6
    for actual, want in zip(got, expected, strict=True):
        _close(actual, want, atol=1e-6)
    # The DDP habit in Keras form: a loss averaged over the replica's own rows (Keras' default
    # reduction) would double the update under two replicas; it stops before the first one.
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    global_batch = 1  # the loss is used as it comes
    with pytest.raises(td.LossScalingError, match='Keras loss with reduction="sum_over_batch_size"'):
        train(td.MirroredStrategy(["cpu:0", "cpu:1"]))


def test_a_custom_loops_forward_in_each_replica():
    """Inside strategy.run: BatchNormalization's moving statistics are the mean over the
    replicas (equal halves: one device's), each replica draws its own dropout mask, and a loss
    added in the forward, which Keras keeps in one list the replica threads would share, is
    refused by name."""
    x = torch.tensor(np.random.default_rng(0).random((16, 32), dtype=np.float32)) * 3
    seen = _Recorder.seen

    def step_once(strategy, layers):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((32,)), *layers(), keras.layers.Dense(1)])
        seen.clear()
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=16)
        for (batch,) in strategy.experimental_distribute_dataset(loader):
            strategy.run(lambda b: model(b, training=True), args=(batch,))
        return model

    def normalized():
        return [keras.layers.Dense(3), keras.layers.BatchNormalization()]

    one = step_once(td.OneDeviceStrategy("cpu"), normalized).layers[1].moving_mean.numpy()
    got = step_once(td.MirroredStrategy(["cpu:0", "cpu:1"]), normalized).layers[1].moving_mean.numpy()
    assert not np.allclose(one, 0)
    _close(got, one, atol=1e-7)  # before: replica 0's statistics only

    step_once(td.MirroredStrategy(["cpu:0", "cpu:1"]), lambda: [keras.layers.Dropout(0.5, seed=3), _Recorder()])
    masks = {replica: rows != 0 for replica, rows in seen}
    assert sorted(masks) == [0, 1] and not torch.equal(masks[0], masks[1])

    with pytest.raises(td.KerasUnsupportedError, match="add_loss"):
        step_once(td.MirroredStrategy(["cpu:0", "cpu:1"]), lambda: [_AddsLoss("mean")])


def test_what_a_forward_changes_adds_or_masks_is_one_devices():
    """BatchNormalization's moving mean is the mean over the replicas (equal halves: one
    device's); an activity regularizer's loss and a masked sequence's loss are one device's."""
    def step(strategy):
        keras.utils.set_random_seed(2)
        with strategy.scope() if strategy is not None else _null():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6), keras.layers.BatchNormalization(),
                                      keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        data = np.random.default_rng(3).random((8, 4), dtype=np.float32) * 3
        model.train_on_batch(data, np.zeros((8, 1), np.float32))
        return model.layers[1].moving_mean.numpy()

    one = step(None)
    assert not np.allclose(one, 0)
    _close(step(td.MirroredStrategy(["cpu:0", "cpu:1"])), one, atol=1e-7)  # equal halves: the same mean

    def fit(strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy is not None else _null():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
                8, activity_regularizer=keras.regularizers.L2(0.1), kernel_regularizer="l2"), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        data = np.random.default_rng(0).random((30, 6), dtype=np.float32)
        history = model.fit(data, data[:, :2], batch_size=15, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], model.get_weights()

    def fit_masked(strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy is not None else _null():
            model = keras.Sequential([keras.Input((7,)), keras.layers.Embedding(5, 4, mask_zero=True),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 5, (20, 7))
        tokens[:, 5:] = 0  # padding: masked out of the loss
        history = model.fit(tokens, rng.random((20, 7, 1), dtype=np.float32), batch_size=10, epochs=2,
                            shuffle=False, verbose=0)
        return history.history["loss"], model.get_weights()

    for run in (fit, fit_masked):
        (loss, weights), (one_loss, one_weights) = run(td.MirroredStrategy(["cpu:0", "cpu:1"])), run(None)
        _close(loss, one_loss)
        for actual, expected in zip(weights, one_weights, strict=True):
            _close(actual, expected, atol=1e-7)


def test_a_replica_without_rows_leaves_no_nan():
    """A last batch of 3 rows over 4 replicas: the empty replica's statistics over no rows
    (NaN) reach neither the moving mean, nor the weights' gradients, nor an added mean loss
    (all three were NaN after the first such batch)."""
    class AddsMean(keras.layers.Layer):
        def call(self, x):
            self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
            return x

    keras.utils.set_random_seed(0)
    with td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"]).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                                  AddsMean(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    data = np.random.default_rng(0).random((11, 4), dtype=np.float32)
    history = model.fit(data, data[:, :1], batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    for weight in model.weights:
        assert np.isfinite(weight.numpy()).all(), weight.path


def test_losses_added_by_some_replicas_only_are_refused():
    class OnReplicaZero(keras.layers.Layer):
        def call(self, x):
            replica = td.get_replica_context()
            if replica is None or replica.replica_id_in_sync_group == 0:
                self.add_loss(keras.ops.mean(x))
            return x

    with td.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), OnReplicaZero()])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(td.KerasUnsupportedError, match=r"added different numbers of losses \(the replicas'"):
        model.train_on_batch(np.ones((4, 4), np.float32), np.zeros((4, 2), np.float32))


class _Recorder(keras.layers.Layer):
    """Records what each replica's rows look like after the layer before it."""

    seen: list = []

    def call(self, x):
        if x.device.type != "meta":
            replica = td.get_replica_context()
            _Recorder.seen.append((None if replica is None else replica.replica_id_in_sync_group, x.detach().clone()))
        return x


@pytest.mark.parametrize("layer", ["Dropout(seed)", "Dropout", "GaussianNoise(seed)"])
def test_every_replica_draws_its_own_random_numbers(layer):
    """Dropout masks (and Keras' other random layers) differ between replicas, as they differ
    between one device's rows: replica 0 draws what one device draws for its rows (from a
    seeded generator), replica 1 other numbers; the seed generators advance as one device's."""
    make = {"Dropout(seed)": lambda: keras.layers.Dropout(0.5, seed=7), "Dropout": lambda: keras.layers.Dropout(0.5),
            "GaussianNoise(seed)": lambda: keras.layers.GaussianNoise(1.0, seed=7)}[layer]

    def draws(strategy):
        keras.utils.set_random_seed(3)
        with strategy.scope() if strategy is not None else _null():
            model = keras.Sequential([keras.Input((256,)), make(), _Recorder(), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        _Recorder.seen.clear()
        for _ in range(3):
            model.train_on_batch(np.ones((8, 256), np.float32), np.zeros((8, 1), np.float32))
        seen = {}
        for replica, rows in _Recorder.seen:
            seen.setdefault(replica, []).append(rows)
        states = [v.numpy().tolist() for v in model.non_trainable_variables]
        return seen, states

    one, one_states = draws(None)
    got, states = draws(td.MirroredStrategy(["cpu:0", "cpu:1"]))
    assert sorted(got) == [0, 1] and all(len(steps) == 3 for steps in got.values())
    for step in range(3):
        first, second = got[0][step], got[1][step]
        assert not torch.equal(first, second)  # before: the same pattern on both replicas' rows
        assert not torch.equal(first, got[0][step - 1])  # and another one at every step
        if layer != "Dropout":  # a seeded generator: replica 0 continues one device's stream
            assert torch.equal(first, one[0][step][:4])
    if layer != "Dropout":
        assert states == one_states  # the generators' [seed, counter]: advanced as one device's
    both = torch.cat([rows for steps in got.values() for rows in steps])
    if layer.startswith("Dropout"):
        assert abs(float((both == 0).float().mean()) - 0.5) < 0.03  # rate 0.5 over 6144 draws


def test_a_model_with_dropout_trains_as_one_device_does():
    """Not bitwise (no data-parallel run draws one device's masks), but as well: the same
    accuracy, the loss within 10%."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    y = (x @ rng.normal(size=8) > 0).astype(np.int64)

    def fit(strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy is not None else _null():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dropout(0.3), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=64, epochs=8, shuffle=False, verbose=0)
        return model.evaluate(x, y, batch_size=128, verbose=0)

    (loss, accuracy), (one_loss, one_accuracy) = fit(td.MirroredStrategy(["cpu:0", "cpu:1"])), fit(None)
    assert one_accuracy > 0.95 and abs(accuracy - one_accuracy) < 0.02
    assert abs(loss - one_loss) < 0.1 * one_loss


def test_keras_metrics_updated_inside_run_are_every_replicas():
    """TensorFlow's custom-loop tutorial with Keras metrics: updated by every replica inside
    strategy.run, read outside; the results are one device's, epoch after epoch."""
    generator = np.random.default_rng(1)
    x = torch.tensor(generator.random((40, 5), dtype=np.float32))
    y = torch.tensor(generator.integers(0, 3, 40))
    logits = torch.tensor(generator.normal(size=(40, 3)).astype(np.float32))

    def read(strategy):
        with strategy.scope():
            accuracy = keras.metrics.SparseCategoricalAccuracy()
            loss = keras.metrics.Mean()
            auc = keras.metrics.AUC(num_thresholds=20)  # a metric of many variables

        def step(xb, yb, lb):
            accuracy.update_state(yb, lb)
            loss.update_state(xb.sum(axis=1))
            auc.update_state(yb == 1, torch.softmax(lb, dim=1)[:, 1])
            return accuracy.result()  # inside run: this replica's own view

        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, logits), batch_size=8)
        results = []
        for _ in range(2):  # epochs
            for batch in strategy.experimental_distribute_dataset(loader):
                strategy.run(step, args=batch)
            results.append([float(m.result()) for m in (accuracy, loss, auc)])
            for metric in (accuracy, loss, auc):
                metric.reset_state()
        return results

    expected = read(td.OneDeviceStrategy("cpu"))
    got = read(td.MirroredStrategy(["cpu:0", "cpu:1"]))
    assert expected[0] == expected[1] and expected[0][0] not in (0.0, 1.0)
    _close(got, expected, rtol=1e-6)

    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        metric = keras.metrics.Mean()
    with pytest.raises(td.KerasUnsupportedError, match="outside run"):
        strategy.run(lambda: metric.reset_state())
    # A metric made before the integration could serve it: refused at its first update in run.
    keras_seams.uninstall()
    early = keras.metrics.Mean()
    with strategy.scope():
        pass
    assert keras_seams.installed()
    with pytest.raises(td.KerasUnsupportedError, match="made before any strategy's scope"):
        strategy.run(lambda: early.update_state(torch.ones(2)))
    early.update_state(torch.ones(2))  # outside run: Keras' own
    assert float(early.result()) == 1.0


class _AddsLoss(keras.layers.Layer):
    """A layer that adds a loss of one kind on its input: a sum over the rows, a mean, a
    penalty on its own weight (no rows), or a maximum (no split of the batch gives it)."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        reduce = {"sum": keras.ops.sum, "mean": keras.ops.mean, "max": keras.ops.max}.get(self.kind)
        self.add_loss(0.01 * keras.ops.square(self.scale) if reduce is None
                      else 0.001 * reduce(keras.ops.square(x * self.scale)))
        return x * self.scale


def test_losses_added_in_the_forward_are_one_devices():
    """A sum over the batch's rows is summed over the replicas, a mean (and a penalty on the
    weights) weighted by each replica's share, on a ragged split (8 and 7 rows): one device's
    numbers. A loss that is neither is refused by name at the first step."""
    data = np.random.default_rng(0).random((30, 6), dtype=np.float32)

    def fit(strategy, kinds):
        keras.utils.set_random_seed(0)
        with strategy.scope() if strategy is not None else _null():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), *[_AddsLoss(k) for k in kinds],
                                      keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(data, data[:, :2], batch_size=15, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], model.get_weights(), model.evaluate(data, data[:, :2], batch_size=15, verbose=0)

    kinds = ("sum", "mean", "weights")
    (loss, weights, evaluated), (one_loss, one_weights, one_evaluated) = (
        fit(td.MirroredStrategy(["cpu:0", "cpu:1"]), kinds), fit(None, kinds))
    _close(loss, one_loss)
    _close(evaluated, one_evaluated)
    for actual, expected in zip(weights, one_weights, strict=True):
        _close(actual, expected, atol=1e-7)
    with pytest.raises(td.KerasUnsupportedError, match="neither a mean over the batch's rows nor a sum"):
        fit(td.MirroredStrategy(["cpu:0", "cpu:1"]), ("max",))


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_what_cannot_be_served_is_refused_by_name():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(td.KerasUnsupportedError, match="jit_compile=False"):
        model.fit(np.ones((4, 3), np.float32), np.ones((4, 1), np.float32), verbose=0)

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=["cpu:0"]))
    try:
        with pytest.raises(td.KerasUnsupportedError, match="set_distribution"):
            with strategy.scope():
                pass
    finally:
        keras.distribution.set_distribution(None)

    sharded = td.FullyShardedStrategy()
    try:
        for layers in ([keras.Input((3,)), keras.layers.Dense(1)], [keras.layers.Dense(1)]):  # built or not
            with pytest.raises(td.KerasUnsupportedError, match="FullyShardedStrategy.scope.*holds its own whole"):
                with sharded.scope():
                    keras.Sequential(layers)
    finally:
        sharded.extended.worker_group.close()
    # Parameter servers hold the variables remotely: the same refusal (no cluster needed to see it).
    from torch_distribute.strategies.parameter_server import ParameterServerStrategyExtended
    from torch_distribute.strategies.parameter_server_worker import ParameterServerWorkerExtended
    for extended in (ParameterServerStrategyExtended, ParameterServerWorkerExtended):
        assert extended.keeps_captured_tensors is td.StrategyExtended.keeps_captured_tensors


def test_keras_is_optional_and_must_use_the_torch_backend(monkeypatch):
    """Without Keras the package imports and a scope works; a Keras on another backend (its
    models would not be torch modules) is refused at the scope."""
    without = ("import sys; sys.modules['keras'] = None\n"
               "import torch_distribute as td\n"
               "with td.MirroredStrategy(['cpu:0', 'cpu:1']).scope():\n    pass\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", without], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
    # No other backend is installed here (each needs TensorFlow or JAX): Keras reports one.
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(td.KerasBackendError, match="KERAS_BACKEND=torch"):
        with td.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
            pass


class _NoLayers(keras.Model):
    """A subclassed model that registers nothing in torch when made."""

    def call(self, x):
        return x


def test_the_keras_seams_are_the_ones_checked():
    """What the integration relies on in Keras has the call shape recorded for the tested
    versions: a Keras release that changes it fails here first."""
    assert loaded.TESTED_KERAS[0] <= tuple(int(p) for p in keras.__version__.split(".")[:2]) <= loaded.TESTED_KERAS[1]
    for dotted, shape in keras_seams.KERAS_TARGETS.items():
        assert keras_seams.call_shape(keras, dotted) == shape, dotted
    with td.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        pass
    assert keras_seams.installed()  # by the first scope entered with Keras imported
    for name in ("Optimizer", "LossScaleOptimizer", "MultiOptimizer"):
        assert getattr(getattr(keras.optimizers, name).apply, "__torch_distribute_wrapped__", False), name
    assert getattr(keras.Model.__init__, "__torch_distribute_wrapped__", False)
    # A seed generator's state, as replica_random.py moves each replica's seed.
    from torch_distribute.keras3 import replica_random
    generator = keras.random.SeedGenerator(11)
    assert replica_random.is_seed_state(generator.state) and generator.state.numpy().tolist() == [11, 0]
    assert generator.next().numpy().tolist() == [11, 0] and generator.state.numpy().tolist() == [11, 1]
    # Every model class Keras has, and a subclass, goes through keras.Model.__init__ (how a model
    # with no weights yet is found in a scope): a Keras release that stops calling it fails here.
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        made = [keras.Sequential([keras.layers.Dense(2)]), keras.Sequential(), _NoLayers()]
    assert [td.keras3.served_by(model) is strategy for model in made] == [True, True, True]
