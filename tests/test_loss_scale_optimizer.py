"""td.mixed_precision.LossScaleOptimizer: TensorFlow's loss-scaling optimizer on GradScaler's
machinery, so under every strategy it decides on the gradient summed over the replicas, keeps
one scale and checkpoints it with the inner optimizer's state."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import torch_distribute as td

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))

from amp_reference import (  # noqa: E402
    GLOBAL_BATCH,
    GROWTH_INTERVAL,
    INIT_SCALE,
    INJECT_STEP,
    STRATEGIES,
    build,
    flat,
    make_data,
    make_scaler,
    step,
)

STRATEGY_NAMES = ["one", "mirrored3", "central2", "mwms1"]


def _train(strategy, inject_row=None, **options):
    with strategy.scope():
        model, inner = build()
        optimizer = td.mixed_precision.LossScaleOptimizer(
            inner, initial_scale=INIT_SCALE, **({"dynamic_growth_steps": GROWTH_INTERVAL} | options))

    def replica_step(x, y):
        loss = td.compute_average_loss(((model(x) - y) ** 2).squeeze(1), global_batch_size=GLOBAL_BATCH)
        optimizer.get_scaled_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad()

    scales, unchanged = [], None
    for index, (x, y) in enumerate(strategy.experimental_distribute_dataset(make_data(inject_row))):
        before = flat(model).clone()
        strategy.run(replica_step, args=(x, y))
        scales.append(optimizer.loss_scale)
        if index == INJECT_STEP:
            unchanged = torch.equal(before, flat(model))
    return flat(model), scales, unchanged, optimizer


def _reference(inject_row=None):
    model, optimizer = build()
    scaler = make_scaler()
    scales = []
    for batch in make_data(inject_row):
        step(model, optimizer, scaler, batch)
        scales.append(scaler.get_scale())
    return flat(model), scales


@pytest.mark.parametrize("name", STRATEGY_NAMES)
@pytest.mark.parametrize("inject_row", [None, GLOBAL_BATCH - 1])
def test_matches_a_grad_scaler_on_one_device_and_skips_an_inf_in_one_replica_everywhere(name, inject_row):
    params, scales, unchanged, _ = _train(STRATEGIES[name](), inject_row)
    want_params, want_scales = _reference(inject_row)
    assert scales == want_scales and max(scales) > INIT_SCALE
    torch.testing.assert_close(params, want_params, rtol=1e-5, atol=1e-6)
    if inject_row is not None:
        assert unchanged is True and scales[INJECT_STEP] == scales[INJECT_STEP - 1] / 2


def test_a_fixed_scale_stays_fixed_and_still_skips_a_non_finite_step():
    _, scales, unchanged, optimizer = _train(STRATEGIES["mirrored3"](), inject_row=0, dynamic=False,
                                             dynamic_growth_steps=None)
    assert set(scales) == {INIT_SCALE} and unchanged is True
    assert optimizer.dynamic is False and optimizer.dynamic_growth_steps is None


def test_get_unscaled_gradients_divides_by_the_scale():
    model, inner = build()
    optimizer = td.mixed_precision.LossScaleOptimizer(inner, initial_scale=8.0)
    optimizer.get_scaled_loss(model(torch.ones(2, 8)).sum()).backward()
    grads = [p.grad for p in model.parameters()]
    unscaled = optimizer.get_unscaled_gradients([*grads, None])
    assert unscaled[-1] is None
    for got, scaled in zip(unscaled, grads, strict=False):
        torch.testing.assert_close(got, scaled / 8.0, rtol=0, atol=0)


def test_state_round_trips_through_a_checkpoint_across_replica_counts(tmp_path):
    params, scales, _, optimizer = _train(STRATEGIES["mirrored3"](), inject_row=0)
    path = td.Checkpoint(optimizer=optimizer).save(str(tmp_path / "ckpt"))
    strategy = td.OneDeviceStrategy("cpu")
    with strategy.scope():
        _, inner = build()
        restored = td.mixed_precision.LossScaleOptimizer(inner)
    td.Checkpoint(optimizer=restored).restore(path)
    assert restored.loss_scale == scales[-1] and restored.dynamic_counter == optimizer.dynamic_counter
    assert restored.state_dict()["optimizer"] == optimizer.state_dict()["optimizer"]


@pytest.mark.parametrize("kwargs,match", [
    ({"inner_optimizer": "sgd"}, "wraps a torch.optim.Optimizer"),
    ({"dynamic": "yes"}, "dynamic must be True or False"),
    ({"initial_scale": 0}, "initial_scale must be a positive"),
    ({"dynamic_growth_steps": 0}, "dynamic_growth_steps must be a positive int"),
    ({"dynamic": False, "dynamic_growth_steps": 10}, "applies only to a dynamic loss scale"),
])
def test_bad_arguments_are_refused(kwargs, match):
    _, inner = build()
    with pytest.raises(td.InvalidArgumentError, match=match):
        td.mixed_precision.LossScaleOptimizer(**({"inner_optimizer": inner} | kwargs))


def test_a_closure_is_refused_and_a_foreign_state_is_refused():
    _, inner = build()
    optimizer = td.mixed_precision.LossScaleOptimizer(inner)
    with pytest.raises(td.InvalidArgumentError, match="takes no closure"):
        optimizer.step(lambda: 0.0)
    with pytest.raises(td.InvalidArgumentError, match="not a LossScaleOptimizer's"):
        optimizer.load_state_dict(inner.state_dict())
