"""td.keras: string shortcuts resolve as in Keras; bad arguments get errors that say what to change."""

from __future__ import annotations

import pytest
import torch

import torch_distribute as td
from torch_distribute.keras import losses, metrics, optimizers
from torch_distribute.strategies import owner_of

pytestmark = pytest.mark.timeout(60)


def test_loss_strings_resolve_and_compute_keras_values():
    y_true, y_pred = torch.tensor([[0.0], [1.0]]), torch.tensor([[1.0], [3.0]])
    assert losses.get("mse")(y_true, y_pred).item() == pytest.approx(2.5)
    assert losses.get("mean_absolute_error")(y_true, y_pred).item() == pytest.approx(1.5)
    probs = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    expected = -(torch.log(torch.tensor(0.75)) + torch.log(torch.tensor(0.5))) / 2
    assert losses.get("sparse_categorical_crossentropy")(torch.tensor([1, 0]), probs).item() == pytest.approx(expected.item())
    assert losses.get("categorical_crossentropy")(torch.tensor([[0, 1], [1, 0]]), probs).item() == pytest.approx(expected.item())
    logits = torch.tensor([[0.3, -1.0], [2.0, 0.5]])
    ce = losses.SparseCategoricalCrossentropy(from_logits=True)(torch.tensor([1, 0]), logits)
    assert ce.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, torch.tensor([1, 0])).item())
    nn_loss = losses.get(torch.nn.CrossEntropyLoss())
    assert nn_loss(torch.tensor([1, 0]), logits).item() == pytest.approx(ce.item())
    assert isinstance(losses.get("BinaryCrossentropy"), losses.BinaryCrossentropy)


def test_unknown_loss_lists_the_valid_names():
    with pytest.raises(td.InvalidArgumentError, match=r"Unknown loss 'msq'.*mean_squared_error.*sparse_categorical_crossentropy"):
        losses.get("msq")
    model = td.keras.Model(torch.nn.Linear(2, 1))
    with pytest.raises(td.InvalidArgumentError, match="Valid names"):
        model.compile("sgd", loss="cross_entropyy")


def test_metric_strings_and_accuracy_inference():
    acc = metrics.get("accuracy")
    acc.update_state(torch.tensor([1, 0]), torch.tensor([[0.1, 0.9], [0.2, 0.8]]))  # sparse
    assert acc.result().item() == pytest.approx(0.5)
    acc = metrics.get("acc")
    acc.update_state(torch.tensor([[1.0], [0.0]]), torch.tensor([[0.7], [0.6]]))  # binary at 0.5
    assert acc.name == "acc" and acc.result().item() == pytest.approx(0.5)
    acc = metrics.get("accuracy", from_logits=True)
    acc.update_state(torch.tensor([1.0, 0.0]), torch.tensor([0.3, -0.2]))  # logits: threshold 0
    assert acc.result().item() == 1.0
    acc = metrics.get("accuracy")
    acc.update_state(torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0.1, 0.9], [0.2, 0.8]]))  # categorical
    assert acc.result().item() == pytest.approx(0.5)
    assert isinstance(metrics.get("sparse_categorical_accuracy"), td.metrics.SparseCategoricalAccuracy)
    assert metrics.get("mse").name == "mse" and metrics.get("mean_absolute_error").name == "mean_absolute_error"
    rmse = metrics.get("rmse")
    rmse.update_state(torch.tensor([0.0, 0.0]), torch.tensor([3.0, 4.0]))
    assert rmse.result().item() == pytest.approx((12.5) ** 0.5)
    ce = metrics.get("binary_crossentropy")  # any loss name is a metric
    ce.update_state(torch.tensor([1.0]), torch.tensor([0.5]))
    assert ce.result().item() == pytest.approx(0.6931, abs=1e-4)
    with pytest.raises(td.InvalidArgumentError, match="Unknown metric 'acuracy'.*accuracy"):
        metrics.get("acuracy")


def test_optimizer_strings_use_keras_defaults_and_learning_rate():
    params = list(torch.nn.Linear(2, 1).parameters())
    sgd = optimizers.get("sgd").build(params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["lr"] == 0.01
    adam = optimizers.Adam(learning_rate=0.1).build(params)
    assert adam.param_groups[0]["lr"] == 0.1 and adam.param_groups[0]["eps"] == 1e-7
    assert optimizers.get("RMSprop", learning_rate=0.5).learning_rate == 0.5
    with pytest.raises(td.InvalidArgumentError, match="Unknown optimizer 'adamm'.*adam"):
        optimizers.get("adamm")


def test_compile_makes_the_optimizer_and_metrics_in_the_models_scope():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = td.keras.Model(torch.nn.Linear(2, 1))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])  # outside the scope
    assert owner_of(model.optimizer) is strategy
    assert all(owner_of(m) is strategy for m in model.metrics)
    assert model.distribute_strategy is strategy


def test_errors_say_what_to_change():
    x, y = torch.ones(10, 2), torch.ones(10, 1)
    model = td.keras.Model(torch.nn.Linear(2, 1))
    with pytest.raises(td.keras.NotCompiledError, match=r"call model.compile\(optimizer, loss, metrics\) before model.fit"):
        model.fit(x, y)
    assert isinstance(td.keras.NotCompiledError("x"), td.DistributeError)
    model.compile("sgd", "mse")
    with pytest.raises(td.InvalidArgumentError, match="x has 10 rows, y has 9 rows"):
        model.fit(x, y[:9], verbose=0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    with pytest.raises(td.InvalidArgumentError, match=r"batch_size=5 was given with a DataLoader.*batch_size=None"):
        model.fit(loader, batch_size=5, verbose=0)
    with pytest.raises(td.InvalidArgumentError, match="y was given with a DataLoader"):
        model.fit(loader, y, verbose=0)
    with pytest.raises(td.InvalidArgumentError, match="map-style TensorDataset"):
        model.fit(torch.utils.data.TensorDataset(x, y), verbose=0)
    with pytest.raises(td.InvalidArgumentError, match="batch_size must be a positive int"):
        model.fit(x, y, batch_size=0, verbose=0)
    with pytest.raises(td.InvalidArgumentError, match="a td.keras.losses object"):
        model.compile("sgd", loss=None)


def test_objects_made_outside_the_scope_are_refused():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    outside = torch.nn.Linear(2, 1)
    with strategy.scope():  # a module made elsewhere, wrapped in the scope, is handed to the strategy
        wrapper = td.keras.Model(outside)
    wrapper.compile("sgd", "mse")
    assert len(strategy.experimental_local_results(outside.weight)) == 2
    with strategy.scope():
        model = td.keras.Model(torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(td.UnmirroredStateError, match="created outside MirroredStrategy.scope"):
        model.compile(optimizer, "mse")
    with pytest.raises(td.ContextError, match="outside the model's strategy scope"):
        model.compile("sgd", "mse", metrics=[td.metrics.MeanSquaredError()])
