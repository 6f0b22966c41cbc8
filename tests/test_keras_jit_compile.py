"""td.keras: ``compile(jit_compile=True)`` runs fit/evaluate/predict as ``td.function`` steps with
eager's numbers, compiles nothing new after the first epoch, and ``run_eagerly``/``jit_compile``
refuse bad values and each other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_distribute as td

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # compiling is slow on 2 CPU cores

N, BATCH = 64, 24  # batches of 24, 24 and a ragged 16
STRATEGIES = {
    "one": lambda: td.OneDeviceStrategy("cpu"),
    "mirrored2": lambda: td.MirroredStrategy(["cpu:0", "cpu:1"]),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)


def _model(strategy, **compile_kwargs) -> td.keras.Model:
    torch.manual_seed(0)
    with strategy.scope():
        model = td.keras.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    model.compile(td.keras.optimizers.SGD(learning_rate=0.1), "mse", metrics=["mae"], **compile_kwargs)
    return model


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(model, counts=None):
    """fit (2 epochs, validation on the same batches), evaluate and predict; ``counts`` gets the
    train graphs after each epoch and the test graphs after fit and after evaluate."""
    x, y = _data()
    callbacks = [] if counts is None else [td.keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: counts.append(model.train_function.experimental_get_tracing_count()))]
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, validation_data=(x, y), verbose=0,
                        callbacks=callbacks)
    if counts is not None:
        counts.append(model.test_function.experimental_get_tracing_count())
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    if counts is not None:
        counts.append(model.test_function.experimental_get_tracing_count())
    return history.history, evaluated, model.predict(x, batch_size=BATCH, verbose=0)


@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_compiled_fit_evaluate_predict_equal_eager_and_compile_once(kind):
    eager = _model(STRATEGIES[kind]())
    eager_history, eager_evaluated, eager_predicted = _run(eager)
    assert eager.jit_compile is False and not isinstance(eager.train_function, td.Function)

    model = _model(STRATEGIES[kind](), jit_compile=True)
    assert model.jit_compile is True and model.run_eagerly is False
    counts: list[int] = []
    history, evaluated, predicted = _run(model, counts)
    train_function, test_function = model.train_function, model.test_function
    assert isinstance(train_function, td.Function) and isinstance(test_function, td.Function)
    assert isinstance(model.predict_function, td.Function)

    torch.testing.assert_close(_params(model), _params(eager), rtol=1e-5, atol=1e-5)
    assert sorted(history) == ["loss", "mae", "val_loss", "val_mae"]
    for key, values in eager_history.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5, atol=1e-6)
    assert evaluated == pytest.approx(eager_evaluated, rel=1e-5)
    torch.testing.assert_close(predicted, eager_predicted, rtol=1e-5, atol=1e-5)

    # Epoch 1 compiled the step (the ragged batch included); epoch 2 nothing.
    train_graphs, _, test_graphs, test_graphs_after_evaluate = counts
    assert train_graphs >= 1 and counts[1] == train_graphs
    # evaluate ran the validation's graphs (the same batches); predict compiled its own.
    assert test_graphs >= 1 and test_graphs_after_evaluate == test_graphs
    assert model.predict_function.experimental_get_tracing_count() >= 1
    # Another fit keeps the functions and compiles nothing.
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, validation_data=(x, y), verbose=0)
    assert model.train_function is train_function and train_function.experimental_get_tracing_count() == train_graphs
    assert model.test_function is test_function and test_function.experimental_get_tracing_count() == test_graphs


def test_run_eagerly_and_jit_compile_values():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    x, y = _data()
    model = _model(strategy)
    assert (model.run_eagerly, model.jit_compile) == (False, False)  # "auto" is eager on torch, as in Keras
    model = _model(strategy, run_eagerly=True)
    assert (model.run_eagerly, model.jit_compile) == (True, False)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert callable(model.train_function) and not isinstance(model.train_function, td.Function)
    assert (model.run_eagerly, model.jit_compile) == (True, False)

    with pytest.raises(td.InvalidArgumentError, match=r"run_eagerly=True and jit_compile=True.*Pick one"):
        _model(strategy, run_eagerly=True, jit_compile=True)
    with pytest.raises(td.InvalidArgumentError, match=r"run_eagerly=True and jit_compile=True.*Pick one"):
        model.jit_compile = True  # the model runs eagerly
    assert model.jit_compile is False
    for bad in ("yes", 1, None, "True"):
        with pytest.raises(td.InvalidArgumentError, match="jit_compile must be True, False or 'auto'"):
            _model(strategy, jit_compile=bad)
    for bad in ("auto", 1, None):
        with pytest.raises(td.InvalidArgumentError, match="run_eagerly must be True or False"):
            _model(strategy, run_eagerly=bad)
    with pytest.raises(TypeError):
        _model(strategy, jit_compiled=True)

    fresh = td.keras.Model(torch.nn.Linear(4, 1))
    with pytest.raises(td.InvalidArgumentError):
        fresh.compile("sgd", "mse", jit_compile="xla")
    assert not fresh.compiled  # checked before anything is made

    # The setters take effect on the next fit/evaluate/predict; compile drops the functions too.
    model.run_eagerly = False
    model.jit_compile = True
    assert model.train_function is None and model.jit_compile is True
    with pytest.raises(td.InvalidArgumentError, match="Pick one"):
        model.run_eagerly = True
    assert isinstance(model.make_predict_function(), td.Function)
    model.compile("sgd", "mse", jit_compile="auto")
    assert model.predict_function is None and model.jit_compile is False
