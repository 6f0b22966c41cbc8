"""examples/mixed_precision.py: TensorFlow's mixed precision guide, with fit and a custom loop, under
OneDeviceStrategy and MirroredStrategy (2 CPU replicas)."""

from __future__ import annotations

import os
import sys

import pytest

import torch_distribute as td

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples import mixed_precision  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# 3 epochs of 128-unit layers: 0.87-0.92 test accuracy after fit and 0.92-0.94 after the custom
# loop over seeds 0-3, every policy and both strategies (10 classes: chance is 0.1). float16 is
# emulated on a CPU, ten times slower than float32: the narrower model keeps the file short.
QUICK = ["--epochs", "3", "--units", "128", "--verbose", "0", "--seed", "0"]
MIN_ACCURACY = 0.8


@pytest.fixture(autouse=True)
def _float32_policy():
    """Other tests must not inherit a policy if an assertion fails before the example resets it."""
    td.keras.mixed_precision.set_global_policy("float32")
    yield
    td.keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("strategy", ["one", "mirrored"])
def test_mixed_float16_scales_the_loss_in_fit_and_in_the_custom_loop(strategy, capsys):
    result = mixed_precision.main([*QUICK, "--strategy", strategy, "--policy", "mixed_float16"])
    assert td.keras.mixed_precision.global_policy().name == "float32"
    out = capsys.readouterr().out
    for line in ("Compute dtype: float16", "Variable dtype: float32", "x.dtype: torch.float16",
                 "dense1.weight.dtype: torch.float32", "Outputs dtype (model.predict): torch.float32",
                 "256 ** 2 in float16: inf", "1e-5 ** 2 in float16: 0.0", "Epoch 2: loss="):
        assert line in out
    assert result["policy"] == "mixed_float16"
    assert result["fit_test_accuracy"] > MIN_ACCURACY
    assert result["custom_test_accuracy"] > MIN_ACCURACY
    assert result["fit_loss_scale_optimizer"] and result["custom_loss_scale_optimizer"]
    # Far fewer than 2000 steps: the scale can only have halved, once per skipped step.
    assert result["fit_loss_scale"] <= 2.0**15
    assert result["loss_scale"] == 2.0**15 / 2 ** result["skipped_steps"]


@pytest.mark.parametrize(("strategy", "policy"), [("mirrored", "mixed_bfloat16"), ("one", "float32")])
def test_bfloat16_and_float32_train_without_loss_scaling(strategy, policy, capsys):
    result = mixed_precision.main([*QUICK, "--strategy", strategy, "--policy", policy])
    assert td.keras.mixed_precision.global_policy().name == "float32"
    out = capsys.readouterr().out
    compute = "bfloat16" if policy == "mixed_bfloat16" else "float32"
    assert f"Compute dtype: {compute}" in out and f"x.dtype: torch.{compute}" in out
    assert result["fit_test_accuracy"] > MIN_ACCURACY
    assert result["custom_test_accuracy"] > MIN_ACCURACY
    assert not result["fit_loss_scale_optimizer"] and not result["custom_loss_scale_optimizer"]
    assert result["loss_scale"] is None and result["skipped_steps"] == 0


def test_a_too_large_loss_scale_is_brought_down_by_skipped_steps():
    """The example counts a step as skipped when a replica's unscaled gradients are not finite;
    the optimizer decides on the gradients summed over both replicas. They must agree."""
    result = mixed_precision.main([*QUICK, "--strategy", "mirrored", "--initial-scale", str(2.0**30)])
    assert result["skipped_steps"] > 0
    assert result["loss_scale"] == 2.0**30 / 2 ** result["skipped_steps"]
    assert result["custom_test_accuracy"] > MIN_ACCURACY


def test_the_policy_is_reset_when_the_example_fails(monkeypatch):
    def no_data(*args, **kwargs):
        assert td.keras.mixed_precision.global_policy().name == "mixed_float16"
        raise RuntimeError("no data")

    monkeypatch.setattr(mixed_precision, "load_image_classification_data", no_data)
    with pytest.raises(RuntimeError, match="no data"):
        mixed_precision.main([*QUICK, "--strategy", "one"])
    assert td.keras.mixed_precision.global_policy().name == "float32"
