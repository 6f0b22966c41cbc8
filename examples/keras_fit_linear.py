"""The tf.distribute guide's Keras and Estimator programs: a one-unit linear regression.

Keras: ``Dense(1)`` on ``([1.], [1.])`` repeated 1000 times in batches of 10, MSE and SGD,
``fit(epochs=2)`` then ``evaluate``, created in ``MirroredStrategy``'s scope. Estimator: the
same data through ``LinearRegressor`` with ``RunConfig(train_distribute=..., eval_distribute=...)``.

    python examples/keras_fit_linear.py                     # 2 CPU replicas (all GPUs if any)
    python examples/keras_fit_linear.py --strategy one
    torch-distribute launch --nproc 2 examples/keras_fit_linear.py --strategy multiworker
"""

from __future__ import annotations

import argparse

import torch

import torch_distribute as td


def make_strategy(name: str, devices: str | None) -> td.Strategy:
    device_list = devices.split(",") if devices else None
    if name == "one":
        return td.OneDeviceStrategy(device_list[0] if device_list else "cpu")
    if name == "multiworker":
        return td.MultiWorkerMirroredStrategy(devices=device_list)
    if device_list is None and not torch.cuda.is_available():
        device_list = ["cpu:0", "cpu:1"]
    return td.MirroredStrategy(device_list)


def dataset(repeat: int = 1000, batch: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``Dataset.from_tensors(([1.], [1.])).repeat(1000).batch(10)``: 100 global batches."""
    x = torch.ones(repeat, 1)
    return [(x[i:i + batch], x[i:i + batch]) for i in range(0, repeat, batch)]


def run_keras(strategy: td.Strategy, verbose: int | str = "auto") -> dict[str, float]:
    with strategy.scope():
        model = td.keras.Model(torch.nn.Linear(1, 1))      # Dense(1, input_shape=(1,))
    model.compile(loss="mse", optimizer="sgd")
    history = model.fit(dataset(), epochs=2, verbose=verbose)
    loss = model.evaluate(dataset(), verbose=verbose)
    return {"fit_loss": history.history["loss"][-1], "eval_loss": loss,
            "weight": model.module.weight.item(), "bias": model.module.bias.item()}


def run_estimator(strategy: td.Strategy, model_dir: str | None = None) -> dict[str, float]:
    config = td.estimator.RunConfig(train_distribute=strategy, eval_distribute=strategy)
    regressor = td.estimator.LinearRegressor(
        feature_columns=[td.estimator.numeric_column("feats")], optimizer="SGD", config=config,
        model_dir=model_dir)

    def input_fn() -> list:
        return [({"feats": x}, y) for x, y in dataset()]

    regressor.train(input_fn=input_fn, steps=10)
    result = regressor.evaluate(input_fn=input_fn, steps=10)
    return {"average_loss": result["average_loss"], "global_step": result["global_step"],
            "weight": float(regressor.get_variable_value("linear.weight")),
            "bias": float(regressor.get_variable_value("linear.bias"))}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["one", "mirrored", "multiworker"], default="mirrored")
    parser.add_argument("--devices", default=None, help="comma-separated devices, e.g. cpu:0,cpu:1")
    parser.add_argument("--model-dir", default=None, help="the LinearRegressor's checkpoints (default: a temporary folder)")
    parser.add_argument("--verbose", type=int, default=1)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    strategy = make_strategy(args.strategy, args.devices)
    log = print if strategy.extended.should_checkpoint else (lambda *a, **k: None)
    log(f"Number of devices: {strategy.num_replicas_in_sync}")
    keras = run_keras(strategy, verbose=args.verbose)
    log(f"Keras: loss {keras['eval_loss']:.6f}, weight {keras['weight']:.4f}, bias {keras['bias']:.4f}")
    estimator = run_estimator(strategy, args.model_dir)
    log(f"LinearRegressor: average_loss {estimator['average_loss']:.6f} after {estimator['global_step']} steps, "
        f"weight {estimator['weight']:.4f}, bias {estimator['bias']:.4f}")
    return {"keras": keras, "estimator": estimator}


if __name__ == "__main__":
    main()
