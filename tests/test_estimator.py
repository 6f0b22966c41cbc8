"""td.estimator: Estimator and LinearRegressor over fit, with RunConfig(train_distribute, eval_distribute)."""

from __future__ import annotations

import pytest
import torch

import torch_distribute as td

pytestmark = pytest.mark.timeout(90)


def _input_fn():
    x = torch.ones(1000, 1)
    return [({"feats": x[i:i + 10]}, x[i:i + 10]) for i in range(0, 1000, 10)]


def test_linear_regressor_seed_program_same_under_mirrored_and_one_device(tmp_path):
    results = []
    for name, strategy in (("mirrored", td.MirroredStrategy(["cpu:0", "cpu:1"])), ("one", None)):
        config = td.estimator.RunConfig(train_distribute=strategy, eval_distribute=strategy)
        regressor = td.estimator.LinearRegressor(feature_columns=[td.estimator.numeric_column("feats")],
                                                 optimizer="SGD", config=config, model_dir=tmp_path / name)
        regressor.train(input_fn=_input_fn, steps=10)
        result = regressor.evaluate(input_fn=_input_fn, steps=10)
        assert result["global_step"] == 10
        assert {"loss", "average_loss", "label/mean", "prediction/mean"} <= set(result)
        assert result["label/mean"] == pytest.approx(1.0)
        results.append((result["average_loss"], regressor.get_variable_value("linear.weight")))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-9)
    torch.testing.assert_close(results[0][1], results[1][1])


def test_training_resumes_from_model_dir_and_eval_runs_under_another_strategy(tmp_path):
    train_strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])
    eval_strategy = td.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    config = td.estimator.RunConfig(train_distribute=train_strategy, eval_distribute=eval_strategy)
    regressor = td.estimator.LinearRegressor(["feats"], model_dir=tmp_path, config=config,
                                             optimizer=td.keras.optimizers.SGD(learning_rate=0.05))
    regressor.train(_input_fn, steps=3).train(_input_fn, max_steps=5)
    assert regressor.evaluate(_input_fn, steps=2)["global_step"] == 5
    again = td.estimator.LinearRegressor(["feats"], model_dir=tmp_path, config=config,
                                         optimizer=td.keras.optimizers.SGD(learning_rate=0.05))
    torch.testing.assert_close(again.get_variable_value("linear.bias"), regressor.get_variable_value("linear.bias"))
    again.train(_input_fn, max_steps=5)  # already there: no step
    assert again.evaluate(_input_fn, steps=1)["global_step"] == 5
    predictions = list(again.predict(lambda: [({"feats": torch.full((3, 1), 2.0)}, torch.zeros(3, 1))]))
    assert len(predictions) == 3 and predictions[0]["predictions"].shape == (1,)


def test_custom_model_fn_and_train_until_input_ends(tmp_path):
    def model_fn(params):
        model = td.keras.Model(torch.nn.Linear(1, 1))
        model.compile(td.keras.optimizers.SGD(learning_rate=params["lr"]), "mse")
        return model

    estimator = td.estimator.Estimator(model_fn, model_dir=tmp_path, params={"lr": 0.1},
                                       config=td.estimator.RunConfig(train_distribute=td.MirroredStrategy(["cpu:0", "cpu:1"])))
    plain = [(features["feats"], labels) for features, labels in _input_fn()]
    estimator.train(lambda: plain[:7], steps=100)  # the input ends first
    assert estimator.evaluate(lambda: plain[:2])["global_step"] == 7
    with pytest.raises(td.InvalidArgumentError, match=r"on which compile\(\) was called"):
        td.estimator.Estimator(lambda: td.keras.Model(torch.nn.Linear(1, 1))).train(_input_fn, steps=1)
    with pytest.raises(td.InvalidArgumentError, match="Ftrl"):
        td.estimator.LinearRegressor(["feats"], optimizer="Ftrl")
