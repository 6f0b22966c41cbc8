"""Keras' mixed-precision policies: fit computes in the policy's dtype, keeps parameters, loss
and metrics in float32, scales the loss under mixed_float16, and refuses a dtype the device
cannot compute in."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_distribute as td
from torch_distribute.datasets import load_image_classification_data

mp = td.keras.mixed_precision
POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]


@pytest.fixture(autouse=True)
def _float32_afterwards():
    yield
    mp.set_global_policy(None)


@pytest.fixture(scope="module")
def digits():
    (x, y), (x_test, y_test), _ = load_image_classification_data()
    as_tensors = [torch.as_tensor(a) for a in (x[:, None], y, x_test[:, None], y_test)]
    return tuple(as_tensors)


def tutorial_cnn() -> nn.Module:
    """The CNN of TensorFlow's "Distributed training with Keras" tutorial."""
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 13 * 13, 64), nn.ReLU(), nn.Linear(64, 10))


def test_policies_name_their_dtypes():
    assert [(mp.Policy(n).compute_dtype, mp.Policy(n).variable_dtype) for n in POLICIES] == [
        ("float32", "float32"), ("bfloat16", "float32"), ("float16", "float32")]
    assert mp.global_policy() == mp.Policy("float32")
    mp.set_global_policy("mixed_float16")
    assert mp.global_policy().name == "mixed_float16" and repr(mp.global_policy()) == '<Policy "mixed_float16">'


@pytest.mark.parametrize("name,match", [("float16", r"module.to\(torch.float16\)"), ("mixed_int8", "Unknown dtype policy")])
def test_unsupported_policies_are_refused(name, match):
    with pytest.raises(td.InvalidArgumentError, match=match):
        mp.set_global_policy(name)


def test_a_model_takes_the_policy_in_force_when_made_or_its_own():
    mp.set_global_policy("mixed_bfloat16")
    made_under_it = td.keras.Model(nn.Linear(2, 1))
    own = td.keras.Model(nn.Linear(2, 1), dtype="float32")
    mp.set_global_policy("float32")
    assert made_under_it.dtype_policy.name == "mixed_bfloat16" and own.dtype_policy.name == "float32"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", POLICIES)
def test_fit_trains_the_tutorial_cnn_under_each_policy(policy, digits):
    x, y, x_test, y_test = digits
    mp.set_global_policy(policy)
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    with strategy.scope():
        model = td.keras.Model(tutorial_cnn())
    model.compile(optimizer=td.keras.optimizers.Adam(learning_rate=1e-3),
                  loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    computed_in = set()
    model.module[0].register_forward_hook(lambda _m, _i, out: computed_in.add(out.dtype))
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    logs = model.evaluate(x_test, y_test, verbose=0, return_dict=True)

    assert computed_in == {getattr(torch, mp.Policy(policy).compute_dtype)}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.predict(x_test[:4], verbose=0).dtype == torch.float32
    assert all(isinstance(v, float) for v in history.history["loss"])
    assert history.history["loss"][-1] < history.history["loss"][0] and logs["accuracy"] > 0.85
    scaled = isinstance(model.optimizer, td.mixed_precision.LossScaleOptimizer)
    assert scaled == (policy == "mixed_float16")


def test_mixed_float16_fit_on_two_replicas_matches_one_device():
    torch.manual_seed(1)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    mp.set_global_policy("mixed_float16")
    losses = {}
    for name, strategy in [("one", td.OneDeviceStrategy("cpu")), ("two", td.MirroredStrategy(["cpu:0", "cpu:1"]))]:
        torch.manual_seed(0)
        with strategy.scope():
            model = td.keras.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
        model.compile("sgd", td.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses[name] = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False).history["loss"]
        assert model.optimizer.loss_scale == 2.0**15
    # float16 rounds an 8-row and a 16-row product differently: close, not equal.
    assert losses["two"] == pytest.approx(losses["one"], rel=2e-3)


def test_auto_scale_loss_false_keeps_the_plain_optimizer_and_a_given_one_is_kept():
    model = td.keras.Model(nn.Linear(2, 1), dtype="mixed_float16")
    model.compile("sgd", "mse", auto_scale_loss=False)
    assert isinstance(model.optimizer, torch.optim.SGD)
    given = td.mixed_precision.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=4.0)
    model.compile(given, "mse")
    assert model.optimizer is given
    model.fit(torch.ones(8, 2), torch.ones(8, 1), batch_size=4, verbose=0)
    with pytest.raises(td.InvalidArgumentError, match="auto_scale_loss must be True or False"):
        model.compile("sgd", "mse", auto_scale_loss="yes")


def test_a_loss_scale_optimizer_made_outside_the_scope_is_refused():
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = td.keras.Model(nn.Linear(2, 1), dtype="mixed_float16")
    outside = td.mixed_precision.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(td.UnmirroredStateError, match="outside MirroredStrategy.scope"):
        model.compile(outside, "mse")


def test_a_dtype_the_device_cannot_compute_in_is_refused_at_compile(monkeypatch):
    with pytest.raises(td.UnsupportedDtypeError, match="cannot compute in torch.float64"):
        td.mixed_precision.check_autocast("cpu", torch.float64)  # torch itself refuses this one
    # A device without float16 autocast, as torch reports it.
    real = torch.autocast

    def no_float16(device_type, dtype=None, **kwargs):
        if dtype == torch.float16:
            warnings.warn("In CPU autocast, but the target dtype is not supported. Disabling autocast.", stacklevel=2)
            return real(device_type, dtype=dtype, enabled=False)
        return real(device_type, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch, "autocast", no_float16)
    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = td.keras.Model(nn.Linear(2, 1), dtype="mixed_float16")
    with pytest.raises(td.UnsupportedDtypeError, match="'cpu' cannot compute in torch.float16.*bfloat16"):
        model.compile("sgd", "mse")


def test_calling_the_model_in_a_custom_loop_computes_under_its_policy():
    mp.set_global_policy("mixed_bfloat16")
    model = td.keras.Model(nn.Linear(4, 2))
    seen = []
    model.module.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    assert model(torch.ones(1, 4)).dtype == torch.float32 and seen == [torch.bfloat16]
