"""``Model.save`` of any module (``nn.Sequential``, containers, every ``torch.nn`` layer, the
user's own ``nn.Module``) and ``load_model``'s Keras 3 ``safe_mode``: what the file names
must be allowed, and a refused file runs nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import torch_distribute as td
from torch_distribute.checkpoint import Checkpoint
from torch_distribute.keras import saving
from torch_distribute.strategies import owner_of

pytestmark = pytest.mark.timeout(180)


class Net(nn.Module):
    """An importable module (this test module), with no get_config and no recorded arguments."""

    def __init__(self, hidden: int):
        super().__init__()
        self.scale = 0.5
        self.blocks = nn.ModuleList([nn.Linear(4, hidden), nn.Linear(hidden, hidden)])
        self.heads = nn.ModuleDict({"a": nn.Linear(hidden, 3), "b": nn.Linear(hidden, 3)})
        self.heads["b"].weight = self.heads["a"].weight  # tied: stays one parameter
        self.register_buffer("offset", torch.full((3,), 0.25), persistent=False)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.scale * (self.heads["a"](x) + self.heads["b"](x)) + self.offset


class MakesFile(nn.Module):
    """Creating it writes a file: a saved model naming it must not run it under safe_mode."""

    def __init__(self, path: str):
        super().__init__()
        with open(path, "w") as f:
            f.write("ran")


class _Payload:
    """Unpickling it would create a file (plain pickle runs ``open``)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _layers():
    """(layer, input) for the torch.nn layers, by family."""
    seq = torch.randn(2, 5, 8)
    img = torch.randn(2, 3, 8, 8)
    return [
        (nn.Linear(8, 4), seq), (nn.Bilinear(8, 8, 2), (seq, seq)), (nn.Identity(), seq),
        (nn.Conv1d(5, 4, 3, padding=1), seq), (nn.Conv2d(3, 4, 3, stride=2, padding="valid"), img),
        (nn.Conv3d(1, 2, 3), torch.randn(1, 1, 5, 5, 5)), (nn.ConvTranspose2d(3, 2, 3, output_padding=1, stride=2), img),
        (nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect"), img),
        (nn.MaxPool2d(2), img), (nn.AvgPool1d(2), seq), (nn.AdaptiveAvgPool2d((2, 3)), img),
        (nn.BatchNorm2d(3), img), (nn.LayerNorm(8), seq), (nn.GroupNorm(1, 3), img), (nn.InstanceNorm1d(5, affine=True), seq),
        (nn.RMSNorm(8), seq), (nn.Dropout(0.3), seq), (nn.Dropout2d(), img),
        (nn.ReLU(), seq), (nn.GELU("tanh"), seq), (nn.LeakyReLU(0.2), seq), (nn.PReLU(5), seq), (nn.Softmax(dim=-1), seq),
        (nn.ELU(), seq), (nn.SiLU(), seq), (nn.Hardtanh(-2, 2), seq), (nn.Threshold(0.1, 0.0), seq),
        (nn.Flatten(), img), (nn.Unflatten(2, (2, 4)), seq), (nn.Upsample(scale_factor=2), img),
        (nn.Embedding(10, 4, padding_idx=0), torch.tensor([[1, 2, 0]])),
        (nn.EmbeddingBag(10, 4, mode="max"), torch.tensor([[1, 2, 3]])),
        (nn.LSTM(8, 6, num_layers=2, batch_first=True, bidirectional=True), seq), (nn.GRU(8, 6), seq),
        (nn.RNN(8, 6, nonlinearity="relu"), seq), (nn.LSTM(8, 6, proj_size=3), seq),
        (nn.MultiheadAttention(8, 2, batch_first=True, kdim=4, vdim=4), (seq, seq[..., :4], seq[..., :4])),
        (nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, activation="gelu"), 2,
                               enable_nested_tensor=False), seq),
        (nn.Transformer(8, 2, 1, 1, 16, batch_first=True), (seq, seq)),
        (nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 2))), seq),
        (nn.ModuleList([nn.Linear(8, 4)]), None), (nn.ModuleDict({"x": nn.Linear(8, 4)}), None),
        (nn.ParameterList([nn.Parameter(torch.ones(2))]), None),
    ]


def test_every_torch_nn_layer_round_trips_under_safe_mode(tmp_path):
    torch.manual_seed(0)
    path = os.fspath(tmp_path / "layer.pt")
    for layer, inputs in _layers():
        name = type(layer).__name__
        td.keras.Model(layer).save(path)
        restored = td.keras.models.load_model(path).module  # safe_mode: torch.nn only
        assert type(restored) is type(layer), name
        assert restored.state_dict().keys() == layer.state_dict().keys(), name
        for key, value in layer.state_dict().items():
            torch.testing.assert_close(restored.state_dict()[key], value, rtol=0, atol=0, msg=name)
        if inputs is None:
            continue
        layer.eval()
        restored.eval()
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        torch.manual_seed(1)
        expected = layer(*args)
        torch.manual_seed(1)
        got = restored(*args)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    # Training mode and requires_grad are kept.
    frozen = nn.Linear(2, 2).requires_grad_(False)
    td.keras.Model(nn.Sequential(frozen, nn.Dropout()).eval()).save(path)
    restored = td.keras.models.load_model(path).module
    assert not restored.training and not restored[0].weight.requires_grad


def test_importable_module_with_containers_and_tied_weights(tmp_path):
    torch.manual_seed(0)
    model = td.keras.Model(Net(6))
    model.compile(optimizer="adam", loss="mse")
    x, y = torch.randn(32, 4), torch.randn(32, 3)
    model.fit(x, y, batch_size=8, verbose=0)
    path = model.save(tmp_path / "net.pt")
    with pytest.raises(td.InvalidArgumentError, match=r"names test_keras_saving_modules:Net.*custom_objects=\{'Net': Net\}"):
        td.keras.models.load_model(path)
    for kwargs in ({"custom_objects": {"Net": Net}}, {"custom_objects": {"test_keras_saving_modules:Net": Net}},
                   {"safe_mode": False}):
        restored = td.keras.models.load_model(path, **kwargs)
        net = restored.module
        assert type(net) is Net and net.scale == 0.5 and isinstance(net.blocks, nn.ModuleList)
        assert net.heads["b"].weight is net.heads["a"].weight
        assert "offset" not in net.state_dict()
        torch.testing.assert_close(net.offset, torch.full((3,), 0.25))
        torch.testing.assert_close(restored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=0, atol=0)
    # Both continue training alike (the optimizer state came back too).
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    restored.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    torch.testing.assert_close(restored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def test_saved_sequential_round_trips_under_one_device_mirrored_and_fully_sharded(tmp_path, monkeypatch):
    """Saved in one place, loaded in each strategy's scope: it belongs there and trains as one device."""
    from torch.distributed.tensor import DTensor

    from torch_distribute.cluster import SimpleClusterResolver

    torch.manual_seed(0)
    model = td.keras.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=0.05),
                  loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    path = model.save(tmp_path / "seq.pt")
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))

    def fit_in(strategy):
        with strategy.scope():
            restored = td.keras.models.load_model(path)
        assert restored.distribute_strategy is strategy and owner_of(restored.module[0].weight) is strategy
        history = restored.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
        weights = restored.get_weights()
        return history, weights, restored

    reference, ref_weights, _ = fit_in(td.OneDeviceStrategy("cpu"))
    assert reference[1] < reference[0]
    history, weights, _ = fit_in(td.MirroredStrategy(["cpu:0", "cpu:1"]))
    torch.testing.assert_close(torch.tensor(history), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    for got, want in zip(weights, ref_weights, strict=True):
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-6)
    for var in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    sharded = td.FullyShardedStrategy(cluster_resolver=SimpleClusterResolver({}))
    try:
        history, weights, restored = fit_in(sharded)
        assert {type(p) for p in restored.parameters()} == {DTensor}
        resaved = restored.save(tmp_path / "sharded")
    finally:
        sharded.extended.worker_group.close()
    torch.testing.assert_close(torch.tensor(history), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    for got, want in zip(weights, ref_weights, strict=True):
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-6)
    whole = td.keras.models.load_model(resaved)  # sharded file, loaded whole outside any scope
    assert type(whole.module) is nn.Sequential
    for got, want in zip(whole.get_weights(), ref_weights, strict=True):
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-6)


def test_safe_mode_refuses_unknown_classes_without_running_them(tmp_path):
    marker = tmp_path / "ran.txt"
    model = td.keras.Model(nn.Linear(2, 2))
    path = os.fspath(tmp_path / "model.pt")
    model.save(path)
    # A file whose record names a class (that would write a file when made) and a function outside the allowlist.
    holders = {"keras_model": saving.ConfigRecord(), "model": saving.ConfigRecord()}
    Checkpoint(**holders).read(path)
    record = holders["keras_model"].value
    record["model"]["args"] = (saving.encode(nn.Linear(2, 2), "x"),)
    record["model"]["args"][0]["cls"] = "test_keras_saving_modules:MakesFile"
    record["model"]["args"][0]["attributes"]["path"] = os.fspath(marker)
    record["model"]["kwargs"]["name"] = {"__td_keras__": "ref", "path": "os:system"}
    forged = os.fspath(tmp_path / "forged.pt")
    Checkpoint(keras_model=saving.ConfigRecord(record), model=holders["model"]).write(forged)
    with pytest.raises(td.InvalidArgumentError, match=r"os:system, test_keras_saving_modules:MakesFile.*safe_mode"):
        td.keras.models.load_model(forged)
    assert not marker.exists()
    # Plain pickle inside the file: weights_only loading refuses it before running anything.
    pickled = os.fspath(tmp_path / "pickled.pt")
    Checkpoint(keras_model=saving.ConfigRecord({"model": _Payload(os.fspath(marker))}),
               model=holders["model"]).write(pickled)
    for safe_mode in (True, False):
        with pytest.raises(td.CheckpointError, match="weights_only"):
            td.keras.models.load_model(pickled, safe_mode=safe_mode)
    assert not marker.exists()
    with pytest.raises(td.InvalidArgumentError, match="safe_mode must be True or False"):
        td.keras.models.load_model(path, safe_mode="yes")
    with pytest.raises(td.InvalidArgumentError, match="custom_objects must be a dict"):
        td.keras.models.load_model(path, custom_objects=[Net])


_MAIN_SCRIPT = textwrap.dedent("""
    import sys, torch, torch_distribute as td

    class Doubler(torch.nn.Module):  # defined in __main__
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def forward(self, x):
            return 2 * self.layer(x)

    @td.keras.saving.register_serializable()
    def halved_mse(y_true, y_pred):
        return 0.5 * (y_true - y_pred) ** 2

    model = td.keras.Model(Doubler())
    model.compile(optimizer="sgd", loss=halved_mse)
    model.save(sys.argv[1])
    td.keras.models.load_model(sys.argv[1], custom_objects={"Doubler": Doubler})  # halved_mse: registered
""")


class Doubler(nn.Module):
    """The loading program's own definition of the saving script's ``__main__.Doubler``."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x):
        return 2 * self.layer(x)


def halved_mse(y_true, y_pred):
    return 0.5 * (y_true - y_pred) ** 2


def test_classes_of_main_save_and_load_in_a_program_that_defines_them(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(_MAIN_SCRIPT)
    path = os.fspath(tmp_path / "main.pt")
    done = subprocess.run([sys.executable, os.fspath(script), path], capture_output=True, text=True, timeout=150,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    with pytest.raises(td.InvalidArgumentError, match=r"__main__:Doubler, __main__:halved_mse"):
        td.keras.models.load_model(path)
    model = td.keras.models.load_model(path, custom_objects={"Doubler": Doubler, "halved_mse": halved_mse})
    assert type(model.module) is Doubler and model.compiled
    x = torch.ones(4, 2)
    assert model.evaluate(x, model.predict(x, verbose=0), verbose=0) == 0.0


def test_model_checkpoint_writes_the_whole_model(tmp_path):
    torch.manual_seed(0)
    model = td.keras.Model(nn.Sequential(nn.Linear(4, 3)))
    model.compile(optimizer="sgd", loss="mse")
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    whole = td.keras.callbacks.ModelCheckpoint(os.fspath(tmp_path / "whole-{epoch}.pt"))
    weights = td.keras.callbacks.ModelCheckpoint(os.fspath(tmp_path / "weights-{epoch}.pt"), save_weights_only=True)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[whole, weights])
    restored = td.keras.models.load_model(tmp_path / "whole-1.pt")
    assert restored.compiled
    torch.testing.assert_close(restored.predict(x, verbose=0), model.predict(x, verbose=0), rtol=0, atol=0)
    with pytest.raises(td.CheckpointError, match="load_weights"):
        td.keras.models.load_model(tmp_path / "weights-1.pt")


def test_get_and_set_weights_in_keras_order_under_mirrored():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = td.keras.Model(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    weights = model.get_weights()
    assert [w.shape for w in weights] == [(2, 3), (2,), (2,), (2,), (2,), (2,), ()]  # kernel, bias, BN's, counter
    model.set_weights([w + 1 for w in weights])
    for replica_value in strategy.experimental_local_results(model.module[0].weight):
        torch.testing.assert_close(replica_value, torch.as_tensor(weights[0]) + 1)
    with pytest.raises(td.InvalidArgumentError, match="expects 7 arrays"):
        model.set_weights(weights[:2])
    with pytest.raises(td.InvalidArgumentError, match=r"0.weight has shape \(2, 3\), got an array of shape \(3, 2\)"):
        model.set_weights([weights[0].T, *weights[1:]])
