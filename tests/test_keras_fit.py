"""td.keras: compile/fit/evaluate/predict give one device's numbers under every strategy."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch

import torch_distribute as td

pytestmark = pytest.mark.timeout(120)

N, BATCH = 53, 8  # 6 global batches of 8 and a ragged one of 5 (fewer rows than 3 replicas x 2)


def _data(n: int = N):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    w = torch.rand(n, generator=g) + 0.5
    return x, y, w


def _strategy(kind: str):
    if kind == "none":
        return None
    if kind == "one":
        return td.OneDeviceStrategy("cpu")
    return td.MirroredStrategy([f"cpu:{i}" for i in range(int(kind))])


def _model(strategy, seed: int = 0) -> td.keras.Model:
    torch.manual_seed(seed)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        module = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        model = td.keras.Model(module)
    return model


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _fit(kind: str, **fit_kwargs):
    strategy = _strategy(kind)
    model = _model(strategy)
    model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=0.02),
                  loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=fit_kwargs.pop("steps_per_execution", 1))
    x, y, w = _data()
    history = model.fit(x, y, sample_weight=w, batch_size=BATCH, epochs=3, validation_data=(x[:21], y[:21]),
                        verbose=0, **fit_kwargs)
    return model, history


@pytest.fixture(scope="module")
def reference():
    return _fit("none")


@pytest.mark.parametrize("kind", ["one", "1", "2", "3"])
def test_fit_same_weights_and_history_as_one_device(kind, reference):
    ref_model, ref_history = reference
    model, history = _fit(kind)
    torch.testing.assert_close(_params(model), _params(ref_model), rtol=1e-5, atol=1e-5)
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for key, values in ref_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)
    assert history.epoch == [0, 1, 2]
    x, y, _ = _data()
    loss, accuracy = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    ref_loss, ref_accuracy = ref_model.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert loss == pytest.approx(ref_loss, rel=1e-5) and accuracy == pytest.approx(ref_accuracy)


def test_steps_per_execution_changes_nothing_but_the_callback_calls(reference):
    calls = []
    cb = td.keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: calls.append(batch))
    model, history = _fit("2", steps_per_execution=3, callbacks=[cb])
    torch.testing.assert_close(_params(model), _params(reference[0]), rtol=1e-5, atol=1e-5)
    assert calls == [2, 5, 6] * 3  # 7 steps an epoch, callbacks every 3 steps and at the end


def test_the_fit_loss_is_the_mean_over_the_global_batch_on_a_ragged_last_batch():
    """One step on 5 rows over 3 replicas (2, 2, 1): the update equals one device's."""
    x, y, _ = _data(5)
    results = []
    for kind in ("none", "3"):
        model = _model(_strategy(kind))
        model.compile(td.keras.optimizers.SGD(learning_rate=0.5), td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
        results.append(_params(model))
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)


def test_dataloader_iterable_and_distributed_dataset_inputs_match_tensors():
    x, y, _ = _data()
    strategy = _strategy("2")
    outcomes = []
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    for data in ("tensors", "loader", "list", "distributed"):
        model = _model(strategy)
        model.compile("sgd", td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["acc"])
        if data == "tensors":
            h = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        elif data == "loader":
            h = model.fit(loader, epochs=2, verbose=0)
        elif data == "list":
            h = model.fit(list(loader), epochs=2, verbose=0)
        else:
            h = model.fit(strategy.experimental_distribute_dataset(loader), epochs=2, verbose=0)
        outcomes.append((_params(model), h.history))
    for params, history in outcomes[1:]:
        torch.testing.assert_close(params, outcomes[0][0], rtol=1e-6, atol=1e-6)
        assert history.keys() == {"loss", "acc"}
        np.testing.assert_allclose(history["loss"], outcomes[0][1]["loss"], rtol=1e-6)


def test_numpy_inputs_and_validation_split():
    x, y, _ = _data()
    model = _model(_strategy("2"))
    model.compile("adam", td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x.double().numpy(), y.numpy(), batch_size=10, epochs=2, validation_split=0.2, verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    val_loss = model.evaluate(x[42:], y[42:], verbose=0, return_dict=True)["loss"]  # the last 20% (11 rows)
    assert history.history["val_loss"][-1] == pytest.approx(val_loss, rel=1e-6)


@pytest.mark.parametrize("kind", ["none", "3"])
def test_predict_returns_rows_in_order_including_a_ragged_last_batch(kind):
    x, _, _ = _data(11)
    model = _model(_strategy(kind))
    predictions = model.predict(x, batch_size=4, verbose=0)  # 4, 4, 3 rows over 3 replicas
    with torch.no_grad():
        expected = model(x)
    assert predictions.shape == (11, 3)
    torch.testing.assert_close(predictions, expected, rtol=1e-6, atol=1e-6)


def test_evaluate_returns_a_scalar_a_list_or_a_dict():
    x, y, _ = _data()
    model = _model(None)
    model.compile("sgd", td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert isinstance(model.evaluate(x, y, verbose=0), float)
    model.compile("sgd", td.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy", "sparse_top_k_categorical_accuracy"])
    values = model.evaluate(x, y, verbose=0)
    assert isinstance(values, list) and len(values) == 3 and values[2] == 1.0  # top-5 of 3 classes
    assert list(model.evaluate(x, y, verbose=0, return_dict=True)) == model.metrics_names == [
        "loss", "accuracy", "sparse_top_k_categorical_accuracy"]


class TwoHeads(td.keras.Model):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.classes = torch.nn.Linear(8, 3)
        self.value = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"classes": self.classes(h), "value": self.value(h)}


@pytest.mark.parametrize("kind", ["none", "2"])
def test_multi_output_loss_weights_and_metrics_per_output(kind):
    x, y, _ = _data()
    v = x.sum(1, keepdim=True)
    strategy = _strategy(kind)
    torch.manual_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = TwoHeads()
    model.compile("sgd", loss={"classes": td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), "value": "mse"},
                  loss_weights={"classes": 1.0, "value": 0.5}, metrics={"classes": ["accuracy"], "value": ["mae"]})
    logs = model.evaluate(x, {"classes": y, "value": v}, verbose=0, return_dict=True)
    assert list(logs) == ["loss", "classes_loss", "value_loss", "classes_accuracy", "value_mae"]
    assert logs["loss"] == pytest.approx(logs["classes_loss"] + logs["value_loss"], rel=1e-5)
    with torch.no_grad():
        out = model(x)
    mse = torch.nn.functional.mse_loss(out["value"], v).item()
    assert logs["value_loss"] == pytest.approx(0.5 * mse, rel=1e-5)
    history = model.fit(x, {"classes": y, "value": v}, batch_size=BATCH, epochs=1, verbose=0)
    assert set(history.history) == set(logs)


def test_progress_bar_is_keras_one_line_per_epoch(capsys):
    x, y, _ = _data()
    model = _model(_strategy("2"))
    model.compile("sgd", td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=BATCH, epochs=2, validation_data=(x, y))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Epoch 1/2" and out[2] == "Epoch 2/2" and len(out) == 4
    pattern = (r"^7/7 \[=+\] - \d+s \d+(ms|us|s)/step - loss: [\d.e-]+ - accuracy: [\d.]+ - "
               r"val_loss: [\d.e-]+ - val_accuracy: [\d.]+$")
    assert re.match(pattern, out[1]), out[1]
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=2)
    assert re.match(r"^7/7 - \d+s - loss: ", capsys.readouterr().out.splitlines()[1])
