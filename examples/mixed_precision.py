"""TensorFlow's "Mixed precision" guide (site/en/guide/mixed_precision.ipynb), ported section by section.

The guide sets a global dtype policy, builds a dense model 784 -> 4096 -> 4096 -> 10 on
MNIST, trains it with ``Model.fit`` (which scales the loss by itself under
``mixed_float16``), then trains it again from the same initial weights with a custom
training loop around a ``LossScaleOptimizer``. Here both parts run under a strategy:

    python examples/mixed_precision.py                                   # 2 CPU replicas / all GPUs
    python examples/mixed_precision.py --strategy one --policy mixed_bfloat16
    python examples/mixed_precision.py --units 4096 --epochs 5           # the guide's model (GPU)

Differences from the guide:

* Data: scikit-learn's handwritten digits upsampled to 28x28 stand in for MNIST (no download).
* The model's width is ``--units`` (default 256): the guide's 4096 units take too long on
  two CPU cores. The guide itself shrinks the model to 64 units without a GPU.
* PyTorch layers have no dtype policy of their own: a ``td.keras.Model`` runs its module
  under ``torch.autocast`` in ``fit``/``evaluate``/``predict`` and casts the outputs to
  float32, which is the guide's float32 last layer. The custom loop does both by hand.
* Mixed float16 on a CPU is emulated and slower than float32; it is run here to exercise
  the API, as the guide suggests for hardware without fast 16-bit math.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import torch_distribute as td
from torch_distribute.datasets import load_image_classification_data
from torch_distribute.keras import mixed_precision
from torch_distribute.mixed_precision import LossScaleOptimizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["one", "mirrored"], default="mirrored")
    parser.add_argument("--devices", default=None,
                        help="comma-separated devices, e.g. 'cpu:0,cpu:1' (default: all GPUs, else 2 CPU "
                        "replicas for mirrored; cuda:0 or cpu for one)")
    parser.add_argument("--policy", choices=["mixed_float16", "mixed_bfloat16", "float32"], default="mixed_float16")
    parser.add_argument("--units", type=int, default=256, help="width of the two hidden layers (the guide: 4096)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (the guide: 8192 for MNIST)")
    parser.add_argument("--initial-scale", type=float, default=2.0 ** 15,
                        help="the custom loop's first loss scale (TensorFlow's default 2**15); a huge one "
                        "shows steps being skipped while the scale comes down")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=2, help="fit's verbosity: 0, 1 or 2")
    return parser.parse_args(argv)


def make_strategy(name: str, devices: str | None) -> td.Strategy:
    device_list = devices.split(",") if devices else None
    if name == "one":
        default = "cuda:0" if torch.cuda.is_available() else "cpu"
        return td.OneDeviceStrategy(device_list[0] if device_list else default)
    if device_list is None and not torch.cuda.is_available():
        device_list = ["cpu:0", "cpu:1"]
    return td.MirroredStrategy(device_list)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        return _run(args)
    finally:
        # The policy is process-wide: leave the next program (or test) in float32.
        mixed_precision.set_global_policy("float32")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    strategy = make_strategy(args.strategy, args.devices)
    devices = strategy.extended.replica_devices
    device_type = devices[0].type

    # -- Supported hardware ---------------------------------------------------------------------
    print(f"Number of devices: {strategy.num_replicas_in_sync} ({', '.join(str(d) for d in devices)})")
    if device_type == "cuda":
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            print(f"GPU {index}: {torch.cuda.get_device_name(index)}, compute capability {major}.{minor}")
    else:
        print("No GPU: mixed precision runs, but expect no speed-up (float16 is emulated on a CPU).")

    # -- Setting the dtype policy -----------------------------------------------------------------
    policy = mixed_precision.Policy(args.policy)
    mixed_precision.set_global_policy(policy)
    mixed_precision.set_global_policy(args.policy)  # the same, from the name alone
    print(f"Compute dtype: {policy.compute_dtype}")
    print(f"Variable dtype: {policy.variable_dtype}")
    compute_dtype = policy.autocast_dtype  # None under float32: autocast is then disabled

    # -- Building the model -------------------------------------------------------------------------
    num_units = args.units
    print(f"The model will run with {num_units} units per hidden layer")
    with strategy.scope():
        dense1 = nn.Linear(784, num_units)
        dense2 = nn.Linear(num_units, num_units)
        dense_logits = nn.Linear(num_units, 10)
        module = nn.Sequential(dense1, nn.ReLU(), dense2, nn.ReLU(), dense_logits)
        model = td.keras.Model(module, name="mixed_precision_mlp")  # takes the global policy

    # What a policy means for one layer: float16 (or bfloat16) outputs, float32 weights.
    probe = torch.rand(2, 784, device=dense1.weight.device)
    with torch.no_grad(), torch.autocast(device_type, dtype=compute_dtype, enabled=compute_dtype is not None):
        x = dense1(probe)
        logits = module(probe)
    print(model.dtype_policy)
    print(f"x.dtype: {x.dtype}")
    print(f"dense1.weight.dtype: {dense1.weight.dtype}")
    # A softmax of 16-bit logits stays 16-bit, which is not precise enough to feed a loss;
    # computing it in float32 is the guide's Activation('softmax', dtype='float32').
    print(f"Outputs dtype (softmax of the autocast logits): {torch.softmax(logits, -1).dtype}")
    print(f"Outputs dtype (softmax in float32): {torch.softmax(logits.float(), -1).dtype}")
    # fit/evaluate/predict cast the model's outputs to float32 before the loss and the
    # metrics, the guide's Activation('linear', dtype='float32') on the last layer.
    print(f"Outputs dtype (model.predict): {model.predict(probe.cpu(), verbose=0).dtype}")

    model.compile(loss=td.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=td.keras.optimizers.RMSprop(), metrics=["accuracy"])

    (x_train, y_train), (x_test, y_test), source = load_image_classification_data()
    print(f"Data: {source}")
    # Inputs stay float32: autocast casts them for the first layer's matmul.
    x_train = x_train.reshape(len(x_train), 784).astype(np.float32)
    x_test = x_test.reshape(len(x_test), 784).astype(np.float32)

    initial_weights = copy.deepcopy(module.state_dict())

    # -- Training the model with Model.fit ----------------------------------------------------------
    started = time.perf_counter()
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, validation_split=0.2,
              verbose=args.verbose)
    test_loss, fit_accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    print(f"Test loss: {test_loss:.4f}")
    print(f"Test accuracy: {fit_accuracy:.4f} ({time.perf_counter() - started:.1f}s)")
    fit_scales = isinstance(model.optimizer, LossScaleOptimizer)
    if fit_scales:  # compile wrapped the optimizer because the policy computes in float16
        print(f"fit scaled the loss with a LossScaleOptimizer, final loss scale {model.optimizer.loss_scale:g}")

    # -- Loss scaling: float16's narrow range -------------------------------------------------------
    x = torch.tensor(256, dtype=torch.float16)
    print(f"256 ** 2 in float16: {(x ** 2).item()}")  # overflow
    x = torch.tensor(1e-5, dtype=torch.float16)
    print(f"1e-5 ** 2 in float16: {(x ** 2).item()}")  # underflow

    # -- Training the model with a custom training loop -----------------------------------------------
    with strategy.scope():
        optimizer: torch.optim.Optimizer | LossScaleOptimizer = td.keras.optimizers.RMSprop().build(
            module.parameters())
        if policy.compute_dtype == "float16":  # bfloat16 has float32's range: no scaling needed
            optimizer = LossScaleOptimizer(optimizer, initial_scale=args.initial_scale)
        test_accuracy = td.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    global_batch_size = args.batch_size
    params = [p for p in module.parameters() if p.requires_grad]
    train_dataset = _batches(x_train, y_train, global_batch_size, shuffle=True, seed=args.seed)
    test_dataset = _batches(x_test, y_test, global_batch_size, shuffle=False)

    def forward(images: torch.Tensor) -> torch.Tensor:
        # Calling the model directly does not apply its policy (only fit/evaluate/predict do).
        with torch.autocast(images.device.type, dtype=compute_dtype, enabled=compute_dtype is not None):
            predictions = model(images)
        return predictions.float()  # the loss and the metrics see float32 outputs

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        model.train()
        predictions = forward(images)
        per_example_loss = F.cross_entropy(predictions, labels, reduction="none")
        loss = td.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
        if isinstance(optimizer, LossScaleOptimizer):
            optimizer.get_scaled_loss(loss).backward()
            # step() unscales the .grad it applies itself; the unscaled copies are for looking at.
            gradients = optimizer.get_unscaled_gradients(p.grad for p in params)
        else:
            loss.backward()
            gradients = [p.grad for p in params]
        # This replica's share only; an inf or NaN in any share makes the summed gradient
        # non-finite, and then step() skips the update and halves the scale.
        finite = all(bool(torch.isfinite(g).all()) for g in gradients if g is not None)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach(), torch.tensor(0.0 if finite else 1.0)

    def test_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        images, labels = batch
        model.eval()
        with torch.no_grad():
            test_accuracy.update_state(labels, forward(images))

    module.load_state_dict(initial_weights)  # train from scratch again, as the guide does

    started = time.perf_counter()
    skipped_steps = 0
    for epoch in range(args.epochs):
        test_accuracy.reset_state()
        total_loss, num_batches = 0.0, 0
        for batch in strategy.experimental_distribute_dataset(train_dataset):
            per_replica_loss, per_replica_nonfinite = strategy.run(train_step, args=(batch,))
            total_loss += float(strategy.reduce(td.ReduceOp.SUM, per_replica_loss, axis=None))
            skipped_steps += int(float(strategy.reduce(td.ReduceOp.SUM, per_replica_nonfinite, axis=None)) > 0)
            num_batches += 1
        for batch in strategy.experimental_distribute_dataset(test_dataset):
            strategy.run(test_step, args=(batch,))
        scale = f", loss scale={optimizer.loss_scale:g}" if isinstance(optimizer, LossScaleOptimizer) else ""
        print(f"Epoch {epoch}: loss={total_loss / num_batches:.4f}, "
              f"test accuracy={float(test_accuracy.result()):.4f}{scale}")
    custom_accuracy = float(test_accuracy.result())
    loss_scale = optimizer.loss_scale if isinstance(optimizer, LossScaleOptimizer) else None
    print(f"Custom loop: test accuracy {custom_accuracy:.4f} ({time.perf_counter() - started:.1f}s), "
          f"{skipped_steps} step(s) skipped for inf/NaN gradients, final loss scale {loss_scale}")

    return {
        "policy": policy.name,
        "fit_test_accuracy": float(fit_accuracy),
        "custom_test_accuracy": custom_accuracy,
        "fit_loss_scale_optimizer": fit_scales,
        "fit_loss_scale": model.optimizer.loss_scale if fit_scales else None,
        "custom_loss_scale_optimizer": isinstance(optimizer, LossScaleOptimizer),
        "loss_scale": loss_scale,
        "skipped_steps": skipped_steps,
    }


def _batches(x: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool,
             seed: int = 0) -> torch.utils.data.DataLoader:
    """The guide's ``Dataset.from_tensor_slices((x, y)).shuffle(...).batch(batch_size)``."""
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator)


if __name__ == "__main__":
    main()
