"""Whole-model save/load (``Model.save``, ``td.keras.models.load_model``) under strategies,
pickling a scoped model, modules deserialized in a scope, ``load_weights`` with the optimizer
state, and ``optimizer.learning_rate``."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle

import numpy as np
import pytest
import torch

import torch_distribute as td
from torch_distribute.keras.training_state import TrainingState
from torch_distribute.strategies import owner_of

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")]

N, BATCH = 48, 8


@td.keras.saving.register_serializable(package="tests")
class Classifier(td.keras.Model):
    """Importable (this test module is on sys.path): rebuilt from its recorded arguments
    (registered: load_model's safe_mode allows it)."""

    def __init__(self, features: int, classes: int, hidden: int = 16):
        super().__init__()
        self.hidden = torch.nn.Linear(features, hidden)
        self.out = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


class ConfiguredBlock(torch.nn.Module):
    """A plain module that says how to rebuild it."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.layer = torch.nn.Linear(4, width)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def get_config(self):
        return {"width": self.width}

    def forward(self, x):
        return self.layer(x)


def scaled_mse(y_true, y_pred):
    return 2.0 * (y_pred - y_true) ** 2


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _compiled(strategy, seed=0):
    torch.manual_seed(seed)
    with _scope(strategy):
        model = Classifier(4, 3, hidden=16)
    model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=0.02),
                  loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _adam_state(model):
    return torch.cat([torch.cat([s["exp_avg"].reshape(-1), s["exp_avg_sq"].reshape(-1)])
                      for s in model.optimizer.state.values()])


def _fit(model, epochs):
    x, y = _data()
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0).history


def _mirrored():
    return td.MirroredStrategy(["cpu:0", "cpu:1"])


@pytest.fixture(scope="module")
def uninterrupted():
    model = _compiled(td.OneDeviceStrategy("cpu"))
    history = _fit(model, 4)
    return _params(model), history


# -- save / load_model -------------------------------------------------------------------------
def test_save_one_device_load_mirrored_continues_like_uninterrupted_run(tmp_path, uninterrupted):
    model = _compiled(td.OneDeviceStrategy("cpu"))
    first = _fit(model, 2)
    path = model.save(tmp_path / "model.pt")
    assert path == os.fspath(tmp_path / "model.pt")
    strategy = _mirrored()
    with strategy.scope():
        restored = td.keras.models.load_model(path)
    assert type(restored) is Classifier and restored.compiled
    assert restored.distribute_strategy is strategy and owner_of(restored.optimizer) is strategy
    assert len(strategy.experimental_local_results(restored.hidden.weight)) == 2
    torch.testing.assert_close(_params(restored), _params(model), rtol=0, atol=0)
    torch.testing.assert_close(_adam_state(restored), _adam_state(model), rtol=0, atol=0)
    assert restored.metrics_names == ["loss", "accuracy"]
    second = _fit(restored, 2)
    params, history = uninterrupted
    torch.testing.assert_close(_params(restored), params, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(first["loss"] + second["loss"], history["loss"], rtol=1e-5, atol=1e-6)


def test_save_mirrored_load_without_strategy(tmp_path):
    strategy = _mirrored()
    model = _compiled(strategy)
    _fit(model, 1)
    path = model.save(tmp_path / "model.pt")
    restored = td.keras.models.load_model(path)
    assert restored.distribute_strategy.is_default and owner_of(restored.hidden.weight) is None
    torch.testing.assert_close(_params(restored), _params(model), rtol=0, atol=0)
    torch.testing.assert_close(_adam_state(restored), _adam_state(model), rtol=0, atol=0)
    _fit(model, 1)
    _fit(restored, 1)
    torch.testing.assert_close(_params(restored), _params(model), rtol=1e-5, atol=1e-5)


def test_wrapped_module_with_get_config_and_compile_arguments_round_trip(tmp_path):
    torch.manual_seed(0)
    model = td.keras.Model(ConfiguredBlock(3), name="block")
    model.compile(optimizer=td.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9), loss=scaled_mse,
                  metrics=["mae"], steps_per_execution=2)
    x = torch.randn(16, 4)
    model.fit(x, torch.zeros(16, 3), batch_size=4, verbose=0)
    model.optimizer.learning_rate = 0.05
    restored = td.keras.models.load_model(model.save(tmp_path / "block.pt"),
                                          custom_objects={"ConfiguredBlock": ConfiguredBlock, "scaled_mse": scaled_mse})
    assert isinstance(restored.module, ConfiguredBlock) and restored.module.width == 3
    assert restored.name == "block" and restored.steps_per_execution == 2
    assert restored.metrics_names == ["loss", "mae"]
    assert restored.optimizer.learning_rate == 0.05
    assert restored.optimizer.param_groups[0]["momentum"] == 0.9
    torch.testing.assert_close(restored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=0, atol=0)
    assert restored.evaluate(x, torch.zeros(16, 3), verbose=0) == pytest.approx(
        model.evaluate(x, torch.zeros(16, 3), verbose=0), rel=1e-6)


def test_include_optimizer_false_and_compile_false_load_uncompiled(tmp_path):
    model = _compiled(None)
    _fit(model, 1)
    for path, kwargs in ((model.save(tmp_path / "a.pt", include_optimizer=False), {}),
                         (model.save(tmp_path / "b.pt"), {"compile": False})):
        restored = td.keras.models.load_model(path, **kwargs)
        assert not restored.compiled and restored.optimizer is None
        torch.testing.assert_close(_params(restored), _params(model), rtol=0, atol=0)


def test_save_refuses_what_load_model_could_not_rebuild(tmp_path):
    local = type("Local", (td.keras.Model,), {"forward": lambda self, x: x})
    local.__qualname__ = "make.<locals>.Local"
    hooked = torch.nn.Linear(4, 3)
    hooked.register_forward_hook(lambda module, args, output: output)
    cases = [
        (td.keras.Model(hooked), r"\(the root module, a Linear\).*hooks \(_forward_hooks\)"),
        (local(torch.nn.Linear(4, 3)), "defined inside a function"),
    ]
    lambda_loss = _compiled(None)
    lambda_loss.compile(optimizer="sgd", loss=lambda t, p: (p - t) ** 2)
    cases.append((lambda_loss, "include_optimizer=False"))
    for model, message in cases:
        with pytest.raises(td.InvalidArgumentError, match=message):
            model.save(tmp_path / "bad.pt")
        assert not (tmp_path / "bad.pt").exists()
    with pytest.raises(td.InvalidArgumentError, match="overwrite=False"):
        _compiled(None).save(lambda_loss.save(tmp_path / "ok.pt", include_optimizer=False), overwrite=False)


def test_load_model_of_weights_file_says_what_to_do(tmp_path):
    model = _compiled(None)
    path = model.save_weights(os.fspath(tmp_path / "weights.pt"))
    with pytest.raises(td.CheckpointError, match="load_weights"):
        td.keras.models.load_model(path)


# -- load_weights and the optimizer ---------------------------------------------------------------
def test_load_weights_restores_optimizer_state_when_file_has_it(tmp_path):
    model = _compiled(_mirrored())
    _fit(model, 1)
    with_optimizer = model.save_weights(os.fspath(tmp_path / "w.pt"), include_optimizer=True)
    other = _compiled(None, seed=1)
    _fit(other, 1)
    other.load_weights(with_optimizer)
    torch.testing.assert_close(_params(other), _params(model), rtol=0, atol=0)
    torch.testing.assert_close(_adam_state(other), _adam_state(model), rtol=0, atol=0)
    # A file without an optimizer leaves the optimizer as it is; so does an uncompiled model.
    before = _adam_state(other).clone()
    other.load_weights(model.save_weights(os.fspath(tmp_path / "plain.pt")))
    torch.testing.assert_close(_adam_state(other), before, rtol=0, atol=0)
    uncompiled = Classifier(4, 3)
    uncompiled.load_weights(with_optimizer)
    torch.testing.assert_close(_params(uncompiled), _params(model), rtol=0, atol=0)


def test_learning_rate_reads_and_sets_every_group():
    model = _compiled(_mirrored())
    assert model.optimizer.learning_rate == pytest.approx(0.02)
    model.optimizer.learning_rate = 0.5
    assert [g["lr"] for g in model.optimizer.param_groups] == [0.5]
    with pytest.raises(td.InvalidArgumentError, match="learning_rate"):
        model.optimizer.learning_rate = -1.0
    x, y = _data()
    before = _params(model).clone()
    model.optimizer.learning_rate = 0.0
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    torch.testing.assert_close(_params(model), before, rtol=0, atol=0)


# -- pickling and modules deserialized in a scope ---------------------------------------------------
def test_pickling_a_scoped_model_gives_the_plain_model():
    strategy = _mirrored()
    model = _compiled(strategy)
    _fit(model, 1)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    plain = torch.load(buffer, weights_only=False)
    assert type(plain) is Classifier and not plain.compiled and plain.optimizer is None
    assert plain.distribute_strategy.is_default and owner_of(plain.hidden.weight) is None
    torch.testing.assert_close(_params(plain), _params(model), rtol=0, atol=0)
    x, _ = _data()
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=0)


class WiderClassifier(Classifier):
    """A subclass of a subclass: the outermost constructor call is the one recorded."""

    def __init__(self, features: int):
        super().__init__(features, 3, hidden=32)


class SameClassifier(Classifier):
    """A subclass without an __init__ of its own."""


def test_constructor_arguments_are_those_of_the_outermost_call_and_survive_copies():
    assert Classifier(4, 3, hidden=8).constructor_arguments == ((4, 3), {"hidden": 8})
    assert WiderClassifier(4).constructor_arguments == ((4,), {})
    assert SameClassifier(4, classes=2).constructor_arguments == ((4,), {"classes": 2})
    model = Classifier(4, 3)
    model.compile("sgd", "mse")
    copied = copy.deepcopy(model)
    assert copied.constructor_arguments == ((4, 3), {}) and copied.compiled
    assert copied.training_state is not model.training_state and copied.optimizer is not model.optimizer
    unpickled = pickle.loads(pickle.dumps(model))
    assert unpickled.constructor_arguments == ((4, 3), {})
    # Pickling drops every field of the training state (what compile and fit set), whatever it holds.
    assert unpickled.training_state == TrainingState()
    model.stop_training = True
    assert model.training_state.stop_training and "stop_training" not in vars(model)


def test_model_unpickled_in_scope_is_mirrored_and_trains_like_one_device():
    torch.manual_seed(0)
    buffer = io.BytesIO()
    torch.save(Classifier(4, 3), buffer)
    results = []
    for strategy in (td.OneDeviceStrategy("cpu"), _mirrored()):
        buffer.seek(0)
        with strategy.scope():
            model = torch.load(buffer, weights_only=False)
        assert model.distribute_strategy is strategy and owner_of(model.out.bias) is strategy
        assert len(strategy.experimental_local_results(model.out.bias)) == strategy.num_replicas_in_sync
        model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=0.02),
                      loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        _fit(model, 2)
        results.append(_params(model))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_modules_loaded_whole_are_adopted_in_scope_and_fine_tune_like_one_device(tmp_path):
    """torch.load of a whole module, or load_model outside the scope, then td.keras.Model(...) in
    the scope: the strategy takes the module over; Mirrored (2 replicas) trains as one device."""
    torch.manual_seed(0)
    buffer = io.BytesIO()
    torch.save(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)), buffer)
    saved = td.keras.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)))
    path = saved.save(tmp_path / "seq.pt")
    loads = {"torch.load": lambda: (buffer.seek(0), torch.load(buffer, weights_only=False))[1],
             "load_model": lambda: td.keras.models.load_model(path).module}
    for name, load in loads.items():
        results = []
        for strategy in (td.OneDeviceStrategy("cpu"), _mirrored()):
            loaded = load()  # outside the scope: a plain module
            with strategy.scope():
                model = td.keras.Model(loaded)
            assert model.distribute_strategy is strategy and owner_of(model.module[0].weight) is strategy, name
            assert len(strategy.experimental_local_results(model.module[2].bias)) == strategy.num_replicas_in_sync
            model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=0.02),
                          loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            _fit(model, 2)
            results.append(_params(model))
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_torchscript_and_exported_modules_say_what_to_do(tmp_path):
    torch.jit.save(torch.jit.script(torch.nn.Linear(4, 3)), os.fspath(tmp_path / "linear.jit"))
    strategy = _mirrored()
    with strategy.scope():
        model = td.keras.Model(torch.jit.load(os.fspath(tmp_path / "linear.jit")))
    with pytest.raises(td.UnmirroredStateError, match=r"TorchScript.*load_state_dict"):
        model.compile("sgd", "mse")
    program = torch.export.export(torch.nn.Linear(4, 3), (torch.ones(2, 4),))
    for exported in (program, program.module()):
        with strategy.scope(), pytest.raises(td.InvalidArgumentError, match=r"does not support train\(\).*load_state_dict"):
            td.keras.Model(exported)


# -- serving -------------------------------------------------------------------------------------
def test_torch_export_of_a_model_trained_under_mirrored(tmp_path):
    strategy = _mirrored()
    model = _compiled(strategy)
    _fit(model, 1)
    x, _ = _data()
    batch = ({0: torch.export.Dim("batch")},)
    with strategy.scope():
        program = torch.export.export(model, (x[:2],), dynamic_shapes=batch)
    torch.export.save(program, os.fspath(tmp_path / "model.pt2"))
    served = torch.export.load(os.fspath(tmp_path / "model.pt2")).module()
    torch.testing.assert_close(served(x), model(x), rtol=0, atol=0)


def test_fully_sharded_save_loads_whole_without_strategy_and_exports(tmp_path, monkeypatch):
    from torch.distributed.tensor import DTensor

    from torch_distribute.cluster import SimpleClusterResolver

    for var in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    strategy = td.FullyShardedStrategy(cluster_resolver=SimpleClusterResolver({}))
    try:
        model = _compiled(strategy)
        _fit(model, 1)
        assert {type(p) for p in model.parameters()} == {DTensor}
        path = model.save(tmp_path / "model")
        whole = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    finally:
        strategy.extended.worker_group.close()
    restored = td.keras.models.load_model(path)
    assert type(restored) is Classifier and restored.compiled
    torch.testing.assert_close(_params(restored), whole, rtol=0, atol=0)
    x, _ = _data()
    program = torch.export.export(restored, (x[:2],), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.testing.assert_close(program.module()(x), restored(x), rtol=0, atol=0)


def test_learning_rate_on_a_loss_scale_optimizer():
    inner = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    optimizer = td.mixed_precision.LossScaleOptimizer(inner)
    assert optimizer.learning_rate == pytest.approx(0.1)
    optimizer.learning_rate = 0.25
    assert [g["lr"] for g in inner.param_groups] == [0.25]
    with pytest.raises(td.InvalidArgumentError, match="learning_rate"):
        optimizer.learning_rate = "fast"
